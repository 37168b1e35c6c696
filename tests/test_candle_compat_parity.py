"""The candle-compat backend computes what independent implementations of the same weights compute.

* SmolLM2 (the bundled Q4_1 GGUF) against Hugging Face transformers reading the same file: logits at
  every prompt position of a ragged four-prompt batch agree to max abs diff < 1e-3 (measured: at most
  1.3e-4 over all positions, 5e-5 at the last position, on logits of magnitude 27-37), and 32-token
  greedy continuations are identical.
* Tiny random-weight HF checkpoints (GQA ratios 1 and 3, qwen2 biases, tied and untied heads, head_dim
  not equal to hidden / heads) against a float64 full-attention forward written below: ragged batches
  mixing prefill and decode across block boundaries agree to 2e-5 of the logit scale (measured: below
  1e-6).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _candle_compat_fixtures import (
    candle_model_at,
    chunk,
    float64_rope_and_rms,
    greedy_decode,
    step,
    write_tiny_hf_checkpoint,
)
from _hf_reference import hf_greedy, hf_logits

from ruvllm_candle_compat import PagedKVCache
from ruvllm_candle_compat import model as candle_model

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is the boiling point of water in Celsius?<|im_end|>\n<|im_start|>assistant\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Les saisons de l'année sont le printemps, l'été, l'automne et",
]
HF_LOGITS_ABS_TOL = 1e-3


# -- SmolLM2 against Hugging Face transformers ------------------------------------------------------
@pytest.fixture(scope="module")
def prompt_ids(smollm2_checkpoint) -> list[list[int]]:
    # Both implementations get the same ids, so which tokenizer makes them does not matter here.
    tokenizer = smollm2_checkpoint.tokenizer()
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def test_ragged_batch_logits_match_transformers(smollm2_path: Path, prompt_ids: list[list[int]]) -> None:
    prompts = prompt_ids
    model = candle_model_at(str(smollm2_path))
    cache = PagedKVCache(model.config, num_blocks=32, block_size=16)
    # Each prompt gets its own non-adjacent blocks; all four run through one forward step.
    tables = [[4 * i + 3, 4 * i + 1, 4 * i + 2, 4 * i] for i in range(len(prompts))]
    out = step(model, cache, *(chunk(ids, 0, t, all_logits=True) for ids, t in zip(prompts, tables, strict=True)))
    for i, ids in enumerate(prompts):
        ref = hf_logits(smollm2_path, ids)
        diff = np.abs(out.all_logits[i] - ref).max()
        scale = np.abs(ref).max()
        assert diff < HF_LOGITS_ABS_TOL, f"prompt {i}: max |logit diff| {diff:.2e} (logit scale {scale:.1f})"
        np.testing.assert_array_equal(out.logits[i], out.all_logits[i][-1])
        assert int(np.argmax(out.logits[i])) == int(np.argmax(ref[-1]))


@pytest.mark.parametrize("prompt", [0, 1], ids=["completion", "chat"])
def test_greedy_decode_matches_transformers_generate(
    smollm2_path: Path, prompt_ids: list[list[int]], prompt: int
) -> None:
    ids = prompt_ids[prompt]
    model = candle_model_at(str(smollm2_path))
    cache = PagedKVCache(model.config, num_blocks=8, block_size=16)
    ours = greedy_decode(model, cache, ids, [6, 2, 7, 0, 5], new_tokens=32)
    assert ours == hf_greedy(smollm2_path, ids, 32)


# -- tiny random checkpoints against a float64 NumPy forward ---------------------------------------
def reference_forward(ckpt: Path, ids: list[int], adapter: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Plain float64 Llama forward over one whole sequence, head by head, with full causal attention.
    Returns (logits ``[n, vocab]``, final-norm hidden states ``[n, hidden]``)."""
    from safetensors.numpy import load_file

    c = json.loads((ckpt / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    n, nh, nkv, hd = len(ids), c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    rope, rms = float64_rope_and_rms(c, n)

    def proj(layer: int, name: str, prefix: str, x: np.ndarray) -> np.ndarray:
        y = x @ w[f"{prefix}{name}.weight"].T
        if f"{prefix}{name}.bias" in w:
            y = y + w[f"{prefix}{name}.bias"]
        if adapter is not None:
            d = adapter.delta(layer, name, x)
            y = y + (0.0 if d is None else d)
        return y

    causal = np.triu(np.ones((n, n), bool), k=1)
    x = w["model.embed_tokens.weight"][ids]
    for li in range(c["num_hidden_layers"]):
        p = f"model.layers.{li}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q, k, v = (proj(li, name, p + "self_attn.", h) for name in ("q_proj", "k_proj", "v_proj"))
        heads = []
        for head in range(nh):
            kv = head // (nh // nkv)
            qh = rope(q[:, head * hd : (head + 1) * hd])
            kh = rope(k[:, kv * hd : (kv + 1) * hd])
            s = qh @ kh.T / np.sqrt(hd)
            s[causal] = -np.inf
            e = np.exp(s - s.max(axis=1, keepdims=True))
            heads.append((e / e.sum(axis=1, keepdims=True)) @ v[:, kv * hd : (kv + 1) * hd])
        x = x + proj(li, "o_proj", p + "self_attn.", np.concatenate(heads, axis=1))
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g, u = proj(li, "gate_proj", p + "mlp.", h), proj(li, "up_proj", p + "mlp.", h)
        x = x + proj(li, "down_proj", p + "mlp.", g / (1.0 + np.exp(-g)) * u)
    hidden = rms(x, w["model.norm.weight"])
    head_w = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return hidden @ head_w.T, hidden


TINY_CONFIGS = {
    "llama-mha-tied": dict(model_type="llama", num_heads=4, num_kv_heads=4, head_dim=10, hidden=40, tied=True),
    "llama-gqa3-untied": dict(model_type="llama", num_heads=6, num_kv_heads=2, head_dim=8, hidden=40, tied=False),
    "qwen2-gqa3-bias": dict(model_type="qwen2", num_heads=6, num_kv_heads=2, head_dim=8, hidden=40, tied=True),
}
F64_REL_TOL = 2e-5


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp(request.param), seed=7, **TINY_CONFIGS[request.param])


def assert_close_f64(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < F64_REL_TOL, f"{what}: max diff {rel:.2e} of the reference's scale"


@pytest.mark.parametrize("score_tile", [None, 40], ids=["one-tile", "query-tiles"])
def test_paged_ragged_steps_match_float64_reference(
    tiny_ckpt: Path, score_tile: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if score_tile is not None:  # forces attention over query tiles of a few rows, as for long prompts
        monkeypatch.setattr(candle_model, "SCORE_TILE_FLOATS", score_tile)
    model = candle_model_at(str(tiny_ckpt))
    rng = np.random.default_rng(1)
    seqs = {s: rng.integers(0, model.config.vocab_size, n).tolist() for s, n in (("a", 9), ("b", 10), ("c", 5))}
    ref = {s: reference_forward(tiny_ckpt, ids) for s, ids in seqs.items()}
    cache = PagedKVCache(model.config, num_blocks=16, block_size=4)
    tables = {"a": [5, 2, 9], "b": [0, 7, 3], "c": [11, 1]}  # scattered, non-monotonic block ids
    # (sequence, start, end, all_logits+hidden_states): prefill next to decode, chunked prefill
    # starting mid-block and crossing two block boundaries, a decode that opens a new block.
    steps = [
        [("a", 0, 7, True), ("b", 0, 3, False)],
        [("a", 7, 8, False), ("b", 3, 9, True), ("c", 0, 4, False)],
        [("a", 8, 9, False), ("b", 9, 10, False), ("c", 4, 5, True)],
    ]
    for plan in steps:
        out = step(
            model,
            cache,
            *(chunk(seqs[s][a:b], a, tables[s], all_logits=full, hidden_states=full) for s, a, b, full in plan),
        )
        for i, (s, a, b, full) in enumerate(plan):
            logits, hidden = ref[s]
            assert_close_f64(out.logits[i], logits[b - 1], f"{s}[{a}:{b}] last logits")
            if full:
                assert_close_f64(out.all_logits[i], logits[a:b], f"{s}[{a}:{b}] all logits")
                assert_close_f64(out.hidden_states[i], hidden[a:b], f"{s}[{a}:{b}] hidden states")
            else:
                assert i not in out.all_logits and i not in out.hidden_states


class LowRankAdapter:
    """A MicroLoRA-shaped adapter: ``x @ A @ B`` on some projections, nothing (None) on the rest."""

    def __init__(self, model: Any, seed: int) -> None:
        cfg = model.config
        rng = np.random.default_rng(seed)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        h, i = cfg.hidden_size, cfg.intermediate_size
        dims = {"q_proj": (h, q), "v_proj": (h, kv), "o_proj": (q, h), "up_proj": (h, i), "down_proj": (i, h)}
        self.factors = {
            (layer, name): (rng.standard_normal((d_in, 2)) * 0.3, rng.standard_normal((2, d_out)) * 0.3)
            for layer in range(cfg.num_layers)
            for name, (d_in, d_out) in dims.items()
        }
        self.rows_seen: list[int] = []

    def delta(self, layer: int, proj: str, x: np.ndarray) -> np.ndarray | None:
        self.rows_seen.append(len(x))
        if (layer, proj) not in self.factors:
            return None
        a, b = self.factors[(layer, proj)]
        return (x @ a) @ b


def test_adapter_deltas_apply_to_their_chunk_only(tiny_ckpt: Path) -> None:
    model = candle_model_at(str(tiny_ckpt))
    rng = np.random.default_rng(2)
    plain = rng.integers(0, model.config.vocab_size, 6).tolist()
    adapted = rng.integers(0, model.config.vocab_size, 7).tolist()
    adapter = LowRankAdapter(model, seed=3)
    cache = PagedKVCache(model.config, num_blocks=8, block_size=4)
    out = step(
        model,
        cache,
        chunk(plain, 0, [0, 1], all_logits=True),
        chunk(adapted, 0, [2, 3], all_logits=True, adapter=adapter),
    )
    assert set(adapter.rows_seen) == {len(adapted)}
    assert_close_f64(out.all_logits[0], reference_forward(tiny_ckpt, plain)[0], "sequence without adapter")
    with_adapter = reference_forward(tiny_ckpt, adapted, adapter)[0]
    assert_close_f64(out.all_logits[1], with_adapter, "sequence with adapter")
    assert np.abs(with_adapter - reference_forward(tiny_ckpt, adapted)[0]).max() > 0.1  # the adapter mattered
    # Decode continues with the adapter through the paged cache.
    nxt = int(np.argmax(with_adapter[-1]))
    dec = step(model, cache, chunk([nxt], len(adapted), [2, 3], adapter=adapter))
    ref_next = reference_forward(tiny_ckpt, [*adapted, nxt], adapter)[0][-1]
    assert_close_f64(dec.logits[0], ref_next, "decode with adapter")
