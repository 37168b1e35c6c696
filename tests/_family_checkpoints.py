"""Tiny random-weight checkpoints of every model family, written through transformers itself, with
configs that exercise each field of the architecture table: llama3 RoPE scaling, a mistral window
shorter than the test's context, gemma3's 5 local : 1 global interleave with a window shorter than the
context (plus its sandwich norms, QK-norm, GELU gate, scaled embeddings, query scalar, local/global
RoPE bases and final-logit soft-capping), qwen2 with YaRN, qwen3's QK-norm with a head_dim that is
not hidden / heads, phi3's fused projections with LongRoPE and a window.

Weights are redrawn after transformers' own init so every parameter matters: matrices ~ N(0, 1/in)
scaled for sharp attention, norms away from their neutral value, biases non-zero.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

COMMON = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _configs() -> dict[str, Any]:
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    return {
        "llama3": LlamaConfig(
            **COMMON,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        "mistral": MistralConfig(**COMMON, sliding_window=5, tie_word_embeddings=True),
        "qwen2-yarn": Qwen2Config(
            **COMMON,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "qwen3": Qwen3Config(**{**COMMON, "num_hidden_layers": 2}, head_dim=24, tie_word_embeddings=True),
        "gemma3": Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 7, "num_key_value_heads": 1},
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=24,
            final_logit_softcapping=5.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
        "phi3": Phi3Config(
            **{**COMMON, "max_position_embeddings": 256},
            original_max_position_embeddings=64,
            sliding_window=7,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.25 * i for i in range(8)],
                "long_factor": [2.0 + i for i in range(8)],
            },
        ),
    }


FAMILIES = ("llama3", "mistral", "qwen2-yarn", "qwen3", "gemma3", "phi3")
#: The architecture ruvllm reports for each.
ARCHITECTURE = {"llama3": "llama", "mistral": "mistral", "qwen2-yarn": "qwen2", "qwen3": "qwen3",
                "gemma3": "gemma3", "phi3": "phi3"}


def write_family_checkpoint(directory: Path, family: str, seed: int = 0) -> Path:
    """Save a random ``family`` model through transformers (safetensors + config.json)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _configs()[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms are 1 + w: centre w on 0 there
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif "embed" in name:
                # O(1) logits through a tied head; gemma multiplies its embeddings by sqrt(hidden) = 8
                p.copy_((0.05 if gemma else 0.3) * torch.randn_like(p))
            else:
                sharp = 2.0 if any(k in name for k in ("q_proj", "k_proj", "qkv")) else 1.0
                p.copy_(sharp * torch.randn_like(p) / np.sqrt(p.shape[-1]))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@functools.cache
def hf_model(path: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_all_logits(path: str | Path, ids: list[int]) -> np.ndarray:
    """float32 logits ``[len(ids), vocab]`` at every position, by transformers."""
    import torch

    with torch.no_grad():
        return hf_model(str(path))(torch.tensor([ids])).logits[0].float().numpy()


#: HF per-layer names -> GGUF names, as llama.cpp's convert_hf_to_gguf.py writes them.
_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GGUF_ARCH = {"llama3": "llama", "mistral": "llama", "qwen2-yarn": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order for interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_family_gguf(hf_dir: Path, family: str, out: Path) -> Path:
    """The checkpoint of :func:`write_family_checkpoint` as a float32 GGUF file, written the way
    llama.cpp's converter writes it (names, Q/K permutation, llama3 ``rope_freqs``, phi3's LongRoPE
    factor tensors, YaRN and window keys), independently of ruvllm's reader."""
    import json
    import math

    import gguf
    from safetensors.numpy import load_file

    c = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    arch = GGUF_ARCH[family]
    rp = c.get("rope_parameters") or {}
    n_head, n_kv = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // n_head
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
    w.add_rope_freq_base(rp.get("rope_theta", 10000.0))
    if c.get("sliding_window"):
        w.add_sliding_window(c["sliding_window"])
    kind = rp.get("rope_type", "default")
    if kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    if kind == "llama3":  # convert_hf_to_gguf.py's LlamaModel: per-pair divisors of the base frequencies
        factor, low, high = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        old = rp["original_max_position_embeddings"]
        freqs = 1.0 / (rp["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
        divisors = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                divisors.append(1.0)
            elif wavelen > old / low:
                divisors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                divisors.append(1 / ((1 - smooth) / factor + smooth))
        w.add_tensor("rope_freqs.weight", np.asarray(divisors, np.float32))
    if kind == "longrope":
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.asarray(rp["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rp["short_factor"], np.float32))
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c["vocab_size"])])
    w.add_token_types([1] * c["vocab_size"])
    w.add_token_merges([])
    for name, t in tensors.items():
        t = np.ascontiguousarray(t, np.float32)
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", t)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", t)
        elif name == "lm_head.weight":
            w.add_tensor("output.weight", t)
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            base, kind_ = rest.rsplit(".", 1)
            if arch == "llama" and base == "self_attn.q_proj":
                t = _llama_permute(t, n_head)
            if arch == "llama" and base == "self_attn.k_proj":
                t = _llama_permute(t, n_kv)
            w.add_tensor(f"blk.{layer}.{_TO_GGUF[base]}.{kind_}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
