"""The candle-compat paged KV cache: results do not depend on how a prompt is split into chunks, on
which other sequences share the step, or on what a reused block held before; bad batches are refused
before the cache is touched.

Tolerances (SmolLM2, logits of magnitude ~35): chunking and batching change only the float32
summation order inside BLAS, so logits agree to 3e-4 absolute (measured: at most 7e-5 for pieces and
token-by-token prefill, 5e-5 for batching); a reused block gives the fresh cache's result within 1e-5
(measured: bitwise equal, NaN/inf left in the block's unused slots included).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from _candle_compat_fixtures import (
    candle_model_at,
    chunk,
    greedy_decode,
    prefill_in_pieces,
    step,
    write_tiny_hf_checkpoint,
)

from ruvllm.backend import ForwardBatch, LoadOptions
from ruvllm.checkpoint import open_checkpoint
from ruvllm.errors import BackendError, ModelFormatError, RequestError
from ruvllm_candle_compat import CandleCompatModel, PagedKVCache

SPLIT_ABS_TOL = 3e-4
REUSE_ABS_TOL = 1e-5
TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting each of the ninety-nine "
    "steps, and lit the lamp that guided the fishing boats home through the fog."
)


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> CandleCompatModel:
    return candle_model_at(str(smollm2_path))


@pytest.fixture(scope="module")
def text_ids(smollm2_checkpoint) -> list[int]:
    ids = smollm2_checkpoint.tokenizer().encode(TEXT, add_special_tokens=False)
    assert len(ids) > 24
    return ids


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


def test_one_chunk_several_chunks_and_token_by_token_agree(smollm2: CandleCompatModel, text_ids: list[int]) -> None:
    n, table = len(text_ids), [9, 3, 7, 1, 5, 0]
    whole = step(smollm2, PagedKVCache(smollm2.config, 10, 8), chunk(text_ids, 0, table, all_logits=True)).all_logits[0]
    # Cuts inside blocks, on a block boundary (16), and a one-token piece.
    pieces = prefill_in_pieces(smollm2, PagedKVCache(smollm2.config, 10, 8), text_ids, table, [5, 6, 16, 21])
    singles = prefill_in_pieces(smollm2, PagedKVCache(smollm2.config, 10, 8), text_ids, table, list(range(1, n)))
    assert pieces.shape == singles.shape == whole.shape == (n, smollm2.config.vocab_size)
    assert max_diff(pieces, whole) < SPLIT_ABS_TOL
    assert max_diff(singles, whole) < SPLIT_ABS_TOL


def test_sequences_batched_together_match_each_alone(smollm2: CandleCompatModel, text_ids: list[int]) -> None:
    a, b = text_ids, text_ids[7:19]  # b is a different sequence (other start, other length)
    ta, tb = [0, 2, 4, 6], [1, 3, 5]
    alone_a = greedy_decode(smollm2, PagedKVCache(smollm2.config, 8, 16), a, ta, 3)
    alone_b = greedy_decode(smollm2, PagedKVCache(smollm2.config, 8, 16), b, tb, 3)

    cache = PagedKVCache(smollm2.config, 8, 16)
    # Step 1: a prefills its first part alone. Step 2: a finishes prefill while b prefills.
    # Steps 3+: both decode together.
    step(smollm2, cache, chunk(a[:10], 0, ta))
    both = step(smollm2, cache, chunk(a[10:], 10, ta, all_logits=True), chunk(b, 0, tb, all_logits=True))
    ref_a = step(smollm2, PagedKVCache(smollm2.config, 8, 16), chunk(a, 0, ta, all_logits=True)).all_logits[0]
    ref_b = step(smollm2, PagedKVCache(smollm2.config, 8, 16), chunk(b, 0, tb, all_logits=True)).all_logits[0]
    assert max_diff(both.all_logits[0], ref_a[10:]) < SPLIT_ABS_TOL
    assert max_diff(both.all_logits[1], ref_b) < SPLIT_ABS_TOL
    out_a, out_b = [int(np.argmax(both.logits[0]))], [int(np.argmax(both.logits[1]))]
    for _ in range(2):
        o = step(
            smollm2, cache,
            chunk([out_a[-1]], len(a) + len(out_a) - 1, ta), chunk([out_b[-1]], len(b) + len(out_b) - 1, tb),
        )
        out_a.append(int(np.argmax(o.logits[0])))
        out_b.append(int(np.argmax(o.logits[1])))
    assert (out_a, out_b) == (alone_a, alone_b)


def test_reused_blocks_do_not_leak_earlier_contents(smollm2: CandleCompatModel, text_ids: list[int]) -> None:
    prompt = text_ids[3:13]  # 10 tokens: fills block 4 only partly
    fresh = PagedKVCache(smollm2.config, 6, 16)
    expected = step(smollm2, fresh, chunk(prompt, 0, [4, 3], all_logits=True)).all_logits[0]
    expected_next = step(smollm2, fresh, chunk([17], 10, [4, 3])).logits[0]

    used = PagedKVCache(smollm2.config, 6, 16)
    step(smollm2, used, chunk(text_ids, 0, [3, 4, 0]))  # another sequence fills blocks 3, 4, 0 ...
    for layer_k, layer_v in zip(used.k, used.v, strict=True):  # ... and the tail of block 4 turns to NaN
        layer_k[4, 10:] = np.nan
        layer_v[4, 10:] = np.inf
    got = step(smollm2, used, chunk(prompt, 0, [4, 3], all_logits=True)).all_logits[0]
    got_next = step(smollm2, used, chunk([17], 10, [4, 3])).logits[0]
    assert np.isfinite(got).all() and np.isfinite(got_next).all()
    assert max_diff(got, expected) < REUSE_ABS_TOL
    assert max_diff(got_next, expected_next) < REUSE_ABS_TOL


# -- tiny checkpoint: block copies, validation, the plugin door -------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_kv"), max_positions=32, seed=11)


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> CandleCompatModel:
    return candle_model_at(str(tiny_dir))


def test_block_copies_fork_a_sequence(tiny: CandleCompatModel) -> None:
    prefix, tail = [5, 9, 14, 3, 8, 21], [30, 31]
    cache = PagedKVCache(tiny.config, 8, 4)
    step(tiny, cache, chunk(prefix, 0, [0, 1]))  # block 1 holds positions 4, 5 of the shared prefix
    direct = step(tiny, cache, chunk(tail, 6, [0, 1])).logits[0]
    cache2 = PagedKVCache(tiny.config, 8, 4)
    step(tiny, cache2, chunk(prefix, 0, [0, 1]))
    # Copy-on-write: the fork continues in block 6, a copy of block 1 made before the step.
    forked = tiny.forward(ForwardBatch([chunk(tail, 6, [0, 6])], 4, block_copies=[(1, 6)]), cache2).logits[0]
    assert max_diff(forked, direct) < REUSE_ABS_TOL
    np.testing.assert_array_equal(cache2.k[0][1, :2], cache2.k[0][6, :2])


@pytest.mark.parametrize(
    ("bad_chunk", "message"),
    [
        (dict(ids=[1] * 9, start=0, table=[0, 1]), "block table holds 2 blocks"),
        (dict(ids=[1, 2], start=7, table=[0, 1]), "block table holds 2 blocks"),
        (dict(ids=[1] * 4, start=30, table=list(range(9))), "beyond the model's context of 32"),
        (dict(ids=[1, 97], start=0, table=[0]), "token id outside 0..96"),
        (dict(ids=[1, 2], start=0, table=[8]), "block outside 0..7"),
        (dict(ids=[], start=0, table=[0]), "has no tokens"),
        (dict(ids=[1], start=0, table=[0], adapter=object()), "has no delta(layer, proj, x) method"),
    ],
)
def test_bad_chunks_are_refused_before_the_cache_changes(
    tiny: CandleCompatModel, bad_chunk: dict, message: str
) -> None:
    cache = PagedKVCache(tiny.config, 8, 4)
    ok = chunk([3, 4, 5], 0, [2])
    bad = chunk(bad_chunk["ids"], bad_chunk["start"], bad_chunk["table"], adapter=bad_chunk.get("adapter"))
    with pytest.raises(RequestError, match=rf"chunk 1\b.*{re.escape(message)}"):
        step(tiny, cache, ok, bad)
    assert all(not k.any() for k in cache.k), "the valid chunk's keys were written before the batch was refused"


def test_refuses_what_it_does_not_do(tiny_dir: Path, tiny: CandleCompatModel, tmp_path: Path) -> None:
    ckpt = open_checkpoint(tiny_dir)
    with pytest.raises(BackendError, match="use the jax backend for q8/q4"):
        CandleCompatModel.from_checkpoint(ckpt, LoadOptions(quantization="q8"))
    with pytest.raises(BackendError, match="float32 only"):
        CandleCompatModel.from_checkpoint(ckpt, LoadOptions(dtype="bfloat16"))
    with pytest.raises(BackendError, match="does not match the cache's 4"):
        tiny.forward(ForwardBatch([chunk([1], 0, [0])], 16), PagedKVCache(tiny.config, 2, 4))
    with pytest.raises(RequestError, match="block copy 0 -> 9"):
        tiny.forward(ForwardBatch([], 4, block_copies=[(0, 9)]), PagedKVCache(tiny.config, 2, 4))
    lying = write_tiny_hf_checkpoint(tmp_path / "lying", seed=11)
    cfg = json.loads((lying / "config.json").read_text())
    (lying / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 64}))
    with pytest.raises(ModelFormatError, match=r"gate_proj.weight has shape \(72, 40\), the config implies \(64, 40\)"):
        CandleCompatModel.from_checkpoint(open_checkpoint(lying), LoadOptions())


def test_runs_through_the_plugin_hooks(tiny_dir: Path) -> None:
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model

    host = load_plugins()
    assert host.backends["candle-compat"].priority == 10
    loaded = load_model(str(tiny_dir), backend="candle-compat", host=host)
    assert isinstance(loaded.model, CandleCompatModel)
    with pytest.raises(BackendError, match="KV cache in float32"):
        loaded.allocate_cache(4, 4, dtype="int8")
    cache = loaded.allocate_cache(4, 4)
    assert cache.k[0].shape == (4, 4, loaded.config.num_kv_heads, loaded.config.head_dim)
    out = loaded.forward(ForwardBatch([chunk([1, 2, 3, 4, 5], 0, [3, 1])], 4), cache)
    assert out.logits.shape == (1, loaded.config.vocab_size) and np.isfinite(out.logits).all()
    assert cache.k[0][3].any() and cache.k[0][1, 0].any() and not cache.k[0][1, 1:].any()
    # What the model declares it can do, and the cache it refuses.
    caps = loaded.capabilities
    assert caps.adapters and caps.hidden_states and caps.all_logits and caps.dtypes == ("float32",)
    with pytest.raises(BackendError, match="cache it allocated"):
        loaded.forward(ForwardBatch([chunk([1], 0, [0])], 4), object())
