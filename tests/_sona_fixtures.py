"""Shared by the SONA tests: SmolLM2 on the candle-compat backend with a private plugin host (so
registering a SONA learner never touches another test's engines), SONA's gradient model of it, and
Hugging Face transformers in float64 with LoRA hooks as the independent gradient reference."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ruvllm.checkpoint import Checkpoint

MODULE_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@functools.cache
def sona_smollm2(path: str) -> Any:
    """SmolLM2 on candle-compat, loaded once per session, with a plugin host of its own."""
    from ruvllm.errors import BackendError
    from ruvllm.runtime import load_model

    try:
        return load_model(path, backend="candle-compat")
    except BackendError as exc:
        pytest.skip(f"candle-compat backend not usable: {exc}")


@functools.cache
def sona_net(path: str) -> Any:
    """SONA's differentiable NumPy model of the checkpoint at ``path``, once per session."""
    from ruvllm.checkpoint import open_checkpoint
    from ruvllm_sona.model import LoraLlama

    return LoraLlama.from_checkpoint(open_checkpoint(path))


def random_entries(net: Any, keys: list[tuple[int, str]], rank: int = 2, scale: float = 2.0, seed: int = 0,
                   size: float = 0.05) -> dict:
    from ruvllm_sona.model import LoraFactors

    rng = np.random.default_rng(seed)
    return {
        (li, p): LoraFactors(
            (rng.standard_normal((rank, net.in_features(p))) * size).astype(np.float32),
            (rng.standard_normal((net.out_features(p), rank)) * size).astype(np.float32),
            scale,
        )
        for li, p in keys
    }


def hf_float64(checkpoint: Checkpoint, first_layer: int = 0, hf_dir: Path | None = None) -> Any:
    """Transformers' model of the layers ``first_layer ..`` of ``checkpoint`` in float64, fed the
    residual stream through ``inputs_embeds`` (layer ``first_layer + i`` becomes layer ``i``)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = checkpoint.config
    n_layers = cfg.num_layers - first_layer
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=n_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=False,
    )
    if cfg.architecture == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, attention_bias=cfg.attention_bias))
    model = model.to(torch.float64).eval()
    state = {}
    for name in checkpoint.tensor_names():
        if name.startswith("model.layers."):
            li = int(name.split(".")[2])
            if li >= first_layer:
                state[name.replace(f"layers.{li}.", f"layers.{li - first_layer}.", 1)] = torch.from_numpy(
                    checkpoint.tensor(name).astype(np.float64))
    state["model.norm.weight"] = torch.from_numpy(checkpoint.tensor("model.norm.weight").astype(np.float64))
    head = "lm_head.weight" if "lm_head.weight" in checkpoint.tensor_names() else "model.embed_tokens.weight"
    state["lm_head.weight"] = torch.from_numpy(checkpoint.tensor(head).astype(np.float64))
    state["model.embed_tokens.weight"] = state["lm_head.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def hf_weighted_loglik_grads(
    model: Any, first_layer: int, residual: np.ndarray, entries: dict, rows: np.ndarray, targets: np.ndarray,
    weights: np.ndarray,
) -> tuple[float, dict, np.ndarray]:
    """``sum_i w_i log p(targets_i | rows_i)`` by the float64 reference with the LoRA ``entries``
    hooked onto its projections, its gradient w.r.t. every factor and w.r.t. the input residual."""
    import torch

    params, hooks = {}, []
    for (li, proj), f in entries.items():
        a = torch.tensor(f.A, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(f.B, dtype=torch.float64, requires_grad=True)
        params[(li, proj)] = (a, b)
        module = getattr(getattr(model.model.layers[li - first_layer], MODULE_OF[proj]), proj)

        def hook(_m: Any, inputs: Any, out: Any, a: Any = a, b: Any = b, s: float = f.scale) -> Any:
            return out + s * (inputs[0] @ a.T) @ b.T

        hooks.append(module.register_forward_hook(hook))
    try:
        x = torch.tensor(residual, dtype=torch.float64, requires_grad=True)
        n = residual.shape[0]
        logits = model(inputs_embeds=x[None], position_ids=torch.arange(n)[None]).logits[0]
        logp = torch.log_softmax(logits, -1)[torch.as_tensor(rows), torch.as_tensor(targets)]
        objective = (torch.as_tensor(weights, dtype=torch.float64) * logp).sum()
        objective.backward()
    finally:
        for h in hooks:
            h.remove()
    grads = {k: (a.grad.numpy(), b.grad.numpy()) for k, (a, b) in params.items()}
    return float(objective.detach()), grads, x.grad.numpy()


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    return list(tokenizer.encode_chat([{"role": "user", "content": question}]))
