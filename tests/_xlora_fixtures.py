"""Tiny X-LoRA models written by peft for the tests: a random Llama, three LoRA experts of different
ranks and targets, and X-LoRA configurations over them (classifier depth, top-k on and off, layerwise
scalings, a non-zero scaling pass). Each X-LoRA directory is self-contained: ``adapter_config.json``
(peft's ``XLoraConfig``, experts by relative path), the experts' own directories, and the classifier
in ``adapter_model.safetensors`` under the names of peft's state dict."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CONFIG = dict(
    vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
EXPERTS = {
    "e0": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "e1": dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["gate_proj", "down_proj"]),
    "e2": dict(r=8, lora_alpha=16, target_modules=["q_proj", "o_proj", "up_proj"]),
}
#: One more plain adapter (a batch mixing four different ones).
EXTRA = {"e3": dict(r=4, lora_alpha=4, target_modules=["k_proj", "down_proj"])}
#: name -> XLoraConfig fields beyond the defaults.
VARIANTS = {
    "dense": dict(xlora_depth=2, xlora_size=16, softmax_temperature=0.7),
    "topk": dict(xlora_depth=1, top_k_lora=2, enable_softmax_topk=True),
    "layerwise-top1": dict(xlora_depth=2, xlora_size=16, layerwise_scalings=True, top_k_lora=1),
    "scaling-pass": dict(xlora_depth=3, xlora_size=8, scaling_pass_value=0.5, global_scaling_weight=1.5),
}


def write_base(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(path)


def write_experts(base: Path, out: Path, experts: dict[str, dict] = EXPERTS) -> dict[str, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    paths = {}
    for i, (name, kw) in enumerate(experts.items()):
        model = get_peft_model(LlamaForCausalLM.from_pretrained(base), LoraConfig(**kw))
        torch.manual_seed(20 + i + 10 * (experts is not EXPERTS))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.3)
        model.save_pretrained(out / name)
        paths[name] = out / name
    return paths


def xlora_model(base: Path, experts: dict[str, Path], variant: str, out: Path):
    """peft's X-LoRA model of ``variant`` (classifier random), written to ``out``; returns the model."""
    import shutil

    import torch
    from peft import XLoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base)
    model.config.use_cache = False
    # peft names the experts "0", "1", ... internally; the mapping's order is the classifier's.
    adapters = {str(i): str(p) for i, p in enumerate(experts.values())}
    conf = XLoraConfig(task_type="CAUSAL_LM", hidden_size=CONFIG["hidden_size"], adapters=adapters, **VARIANTS[variant])
    xm = get_peft_model(model, conf)
    torch.manual_seed(7)
    with torch.no_grad():
        for n, p in xm.named_parameters():
            if "internal_xlora_classifier" in n:
                p.normal_(0, 0.5)
    xm.eval()
    out.mkdir(parents=True)
    for i, p in enumerate(experts.values()):
        shutil.copytree(p, out / f"expert{i}")
    saved = conf.to_dict()
    saved["adapters"] = {str(i): f"expert{i}" for i in range(len(experts))}
    saved["peft_type"] = "XLORA"
    (out / "adapter_config.json").write_text(json.dumps(saved, default=str))
    state = {k: v.contiguous() for k, v in xm.state_dict().items() if "internal_xlora_classifier" in k}
    save_file(state, str(out / "adapter_model.safetensors"))
    return xm


def peft_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()
