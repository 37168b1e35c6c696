"""Tiny random mixture-of-experts checkpoints written through transformers (``Qwen3MoeForCausalLM``,
``MixtralForCausalLM``, ``GptOssForCausalLM``), and the same weights as GGUF files the way llama.cpp's converter writes
them (``qwen3moe``; Mixtral as a ``llama`` file with experts, Q/K rows permuted), independently of
ruvllm's readers.

Weights are redrawn after transformers' init so every parameter matters (as in
:mod:`_family_checkpoints`): the router's logits O(1), so tokens spread over the experts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from _family_checkpoints import COMMON, _llama_permute

MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
#: Families with a GGUF form here (gpt-oss's GGUF architecture is not read yet).
GGUF_FAMILIES = ("qwen3_moe", "mixtral")


def moe_config(family: str, **edit: Any) -> Any:
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig

    if family == "qwen3_moe":
        # norm_topk_prob off: the weights stay the softmax's (Qwen3-30B-A3B has it on; mixtral covers that).
        fields = dict(
            head_dim=24, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False
        )
        return Qwen3MoeConfig(**{**COMMON, "intermediate_size": 48, "tie_word_embeddings": False, **fields, **edit})
    if family == "gpt_oss":
        # Alternating sliding (window 5) and full layers, YaRN without truncation, and a SwiGLU limit
        # low enough that the clamps bite.
        fields = dict(
            intermediate_size=32,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
            swiglu_limit=1.5,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        )
        return GptOssConfig(**{**COMMON, **fields, **edit})
    fields = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=5, tie_word_embeddings=False)
    return MixtralConfig(**{**COMMON, **fields, **edit})


def write_moe_checkpoint(directory: Path, family: str, seed: int = 0, **edit: Any) -> Path:
    """Save a random ``family`` model through transformers (safetensors + config.json)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(family, **edit)).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed" in name:
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("bias") or name.endswith("sinks"):
                p.copy_(0.5 * torch.randn_like(p))
            elif family == "gpt_oss" and name.endswith(("gate_up_proj", "down_proj")):  # [experts, in, out]
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-2]))
            else:
                sharp = 2.0 if any(k in name for k in ("q_proj", "k_proj", "gate.weight", "router.weight")) else 1.0
                p.copy_(sharp * torch.randn_like(p) / np.sqrt(p.shape[-1]))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


#: HF (v4 layout, as saved) per-layer names -> llama.cpp's.
_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
            "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def write_moe_gguf(hf_dir: Path, family: str, out: Path, ggml_type: str = "F32") -> Path:
    """The checkpoint of :func:`write_moe_checkpoint` as a GGUF file: experts stacked ``[experts,
    out, in]`` per layer (``ffn_*_exps``), the router as ``ffn_gate_inp``. ``ggml_type``: the experts'
    and projections' block type (``Q8_0`` quantized with the gguf library's own quantizer)."""
    import gguf
    from safetensors.numpy import load_file

    c = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    arch = "qwen3moe" if family == "qwen3_moe" else "llama"
    n_head, n_kv = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // n_head
    n_exp = c.get("num_experts") or c["num_local_experts"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base((c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_expert_count(n_exp)
    w.add_expert_used_count(c["num_experts_per_tok"])
    if family == "qwen3_moe":
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if c.get("sliding_window"):
        w.add_sliding_window(c["sliding_window"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c["vocab_size"])])
    w.add_token_types([1] * c["vocab_size"])
    w.add_token_merges([])
    qtype = gguf.GGMLQuantizationType[ggml_type]

    def add(name: str, t: np.ndarray) -> None:
        t = np.ascontiguousarray(t, np.float32)
        if t.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t)

    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in tensors.items():
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", t)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", t)
        elif name == "lm_head.weight":
            add("output.weight", t)
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            base = rest.rsplit(".", 1)[0]
            parts = base.split(".")
            if "experts" in parts:
                e, proj = int(parts[-2]), parts[-1]
                experts.setdefault((layer, _EXPERTS[proj]), {})[e] = t
                continue
            if arch == "llama" and base == "self_attn.q_proj":
                t = _llama_permute(t, n_head)
            if arch == "llama" and base == "self_attn.k_proj":
                t = _llama_permute(t, n_kv)
            if base.endswith("norm") or base.endswith("layernorm"):
                w.add_tensor(f"blk.{layer}.{_TO_GGUF[base]}.weight", np.ascontiguousarray(t, np.float32))
            else:
                add(f"blk.{layer}.{_TO_GGUF[base]}.weight", t)
    for (layer, key), by_expert in sorted(experts.items()):
        add(f"blk.{layer}.{key}.weight", np.stack([by_expert[e] for e in range(n_exp)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def mxfp4_representable(hf_dir: Path) -> None:
    """Round a gpt_oss checkpoint's expert matrices to MXFP4 values in place (blocks of 32 along each
    matrix's input, as llama.cpp's GGUF stores them), so its MXFP4 GGUF holds exactly these weights."""
    import gguf
    from safetensors.numpy import load_file, save_file

    file = hf_dir / "model.safetensors"
    tensors = load_file(str(file))
    mx = gguf.GGMLQuantizationType.MXFP4
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [experts, in, out]
            rows = np.ascontiguousarray(t.swapaxes(-1, -2), np.float32)
            back = gguf.quants.dequantize(gguf.quants.quantize(rows, mx), mx).reshape(rows.shape)
            tensors[name] = np.ascontiguousarray(back.swapaxes(-1, -2))
    save_file(tensors, str(file), metadata={"format": "pt"})


def write_gpt_oss_gguf(hf_dir: Path, out: Path, experts_type: str = "F32") -> Path:
    """A gpt_oss checkpoint as llama.cpp's converter writes it (architecture ``gpt-oss``): the pre-MLP
    norm as ``post_attention_norm``, sinks as ``attn_sinks.weight``, the fused interleaved experts
    split into ``ffn_{gate,up,down}_exps`` ``[experts, out, in]`` with their biases, the experts in
    ``experts_type`` (``MXFP4``: gguf's own quantizer)."""
    import gguf
    from safetensors.numpy import load_file

    c = json.loads((hf_dir / "config.json").read_text())
    rp = c["rope_parameters"]
    tensors = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rp["factor"])
    w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c["intermediate_size"])
    w.add_sliding_window(c["sliding_window"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c["vocab_size"])])
    w.add_token_types([1] * c["vocab_size"])
    w.add_token_merges([])
    qtype = gguf.GGMLQuantizationType[experts_type]
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.sinks": "attn_sinks.weight",
        "mlp.router.weight": "ffn_gate_inp.weight",
        "mlp.router.bias": "ffn_gate_inp.bias",
        **{f"self_attn.{p}_proj.{k}": f"attn_{g}.{k}" for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
           for k in ("weight", "bias")},
    }  # fmt: skip

    def experts(name: str, t: np.ndarray) -> None:
        t = np.ascontiguousarray(t, np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)

    for name, t in tensors.items():
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", t)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", t)
        elif name == "lm_head.weight":
            w.add_tensor("output.weight", t)
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            blk = f"blk.{layer}"
            if rest == "mlp.experts.gate_up_proj":  # [experts, in, 2 * inter], gate/up interleaved
                rows = t.swapaxes(-1, -2)
                experts(f"{blk}.ffn_gate_exps.weight", rows[:, ::2])
                experts(f"{blk}.ffn_up_exps.weight", rows[:, 1::2])
            elif rest == "mlp.experts.gate_up_proj_bias":
                w.add_tensor(f"{blk}.ffn_gate_exps.bias", np.ascontiguousarray(t[:, ::2]))
                w.add_tensor(f"{blk}.ffn_up_exps.bias", np.ascontiguousarray(t[:, 1::2]))
            elif rest == "mlp.experts.down_proj":
                experts(f"{blk}.ffn_down_exps.weight", t.swapaxes(-1, -2))
            elif rest == "mlp.experts.down_proj_bias":
                w.add_tensor(f"{blk}.ffn_down_exps.bias", t)
            else:
                w.add_tensor(f"{blk}.{names[rest]}", np.ascontiguousarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
