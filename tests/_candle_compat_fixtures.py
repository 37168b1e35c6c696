"""Shared by the candle-compat tests: tiny random-weight HF checkpoints, the backend loaded on
SmolLM2 once per session, and small drivers of the paged forward step."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np

from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm_candle_compat import CandleCompatModel, PagedKVCache


def write_tiny_hf_checkpoint(
    path: Path,
    *,
    model_type: str = "llama",
    num_heads: int = 6,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    hidden: int = 40,
    intermediate: int = 72,
    layers: int = 2,
    vocab: int = 97,
    max_positions: int = 64,
    tied: bool = True,
    seed: int = 0,
) -> Path:
    """A Hugging Face model directory (config.json + model.safetensors) with random weights.

    ``head_dim * num_heads`` need not equal ``hidden`` (as in some Qwen/Llama variants); qwen2 gets
    q/k/v biases. Weights are scaled so activations stay O(1) through the layers."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden)).astype(np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": mat(q_dim, hidden) * 2.0,  # sharper attention than uniform
            p + "self_attn.k_proj.weight": mat(kv_dim, hidden) * 2.0,
            p + "self_attn.v_proj.weight": mat(kv_dim, hidden),
            p + "self_attn.o_proj.weight": mat(hidden, q_dim),
            p + "mlp.gate_proj.weight": mat(intermediate, hidden),
            p + "mlp.up_proj.weight": mat(intermediate, hidden),
            p + "mlp.down_proj.weight": mat(hidden, intermediate),
        }
        if model_type == "qwen2":
            for proj, dim in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
                tensors[p + f"self_attn.{proj}.bias"] = (0.5 * rng.standard_normal(dim)).astype(np.float32)
    tensors["model.norm.weight"] = norm(hidden)
    if not tied:
        tensors["lm_head.weight"] = mat(vocab, hidden)
    config = {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500.0,  # small base: high-frequency rotation shows up within a few positions
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def float64_rope_and_rms(config: dict, n: int) -> tuple[Any, Any]:
    """The float64 reference's rotary embedding (Hugging Face rotate-half, positions ``0..n-1``, one
    head ``[n, head_dim]`` at a time) and RMSNorm, from a checkpoint's config.json."""
    hd = config["head_dim"]
    angle = np.arange(n)[:, None] * (1.0 / config["rope_theta"] ** (np.arange(0, hd, 2) / hd))[None, :]
    cos, sin = np.cos(angle), np.sin(angle)

    def rope(t: np.ndarray) -> np.ndarray:
        a, b = t[:, : hd // 2], t[:, hd // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=1)

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + config["rms_norm_eps"]) * g

    return rope, rms


def load_candle(path: Path) -> CandleCompatModel:
    return CandleCompatModel.from_checkpoint(open_checkpoint(path), LoadOptions())


@functools.cache
def candle_model_at(path: str) -> CandleCompatModel:
    """The backend's model of a checkpoint, loaded once per session."""
    return load_candle(Path(path))


def chunk(ids: Any, start: int, table: Any, **kw: Any) -> SequenceChunk:
    return SequenceChunk(np.asarray(ids, np.int32), start, np.asarray(table, np.int32), **kw)


def step(model: CandleCompatModel, cache: PagedKVCache, *chunks: SequenceChunk) -> Any:
    return model.forward(ForwardBatch(list(chunks), cache.block_size), cache)


def prefill_in_pieces(
    model: CandleCompatModel, cache: PagedKVCache, ids: list[int], table: list[int], cuts: list[int]
) -> np.ndarray:
    """Prefill ``ids`` in pieces split at ``cuts``; returns the logits of every position, ``[n, vocab]``."""
    bounds = [0, *cuts, len(ids)]
    pieces = [
        step(model, cache, chunk(ids[a:b], a, table, all_logits=True)).all_logits[0]
        for a, b in itertools.pairwise(bounds)
    ]
    return np.concatenate(pieces)


def greedy_decode(
    model: CandleCompatModel, cache: PagedKVCache, ids: list[int], table: list[int], new_tokens: int
) -> list[int]:
    """Prefill ``ids`` in one chunk, then decode ``new_tokens`` greedily one token per forward step."""
    logits = step(model, cache, chunk(ids, 0, table)).logits[0]
    out: list[int] = []
    for _ in range(new_tokens):
        out.append(int(np.argmax(logits)))
        logits = step(model, cache, chunk([out[-1]], len(ids) + len(out) - 1, table)).logits[0]
    return out
