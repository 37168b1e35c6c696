"""The jax backend's step-inputs stage on its own: a small ragged batch in, the exact padded arrays out,
in NumPy, with nothing compiled. The expected arrays are written out by hand from the layout rules
(decoding tokens first, then each prompt chunk's, padding after; padding points past the end)."""

from __future__ import annotations

import numpy as np
import pytest

from ruvllm.backend import NO_BLOCK, ForwardBatch, SequenceChunk
from ruvllm_jax.compiled_steps import CompiledCache
from ruvllm_jax.model import StepPlan
from ruvllm_jax.step_inputs import step_inputs
from ruvllm_jax.step_shapes import partition

BLOCK_SIZE, NUM_BLOCKS = 4, 16


def _i32(*values: int) -> np.ndarray:
    return np.asarray(values, np.int32)


def _batch() -> ForwardBatch:
    """Two decoding sequences between two prompt chunks; the last chunk asks for every position's
    logits and its hidden states."""
    return ForwardBatch(
        [
            SequenceChunk(_i32(7), 5, _i32(3, 9)),  # decoding position 5: block 9, offset 1
            SequenceChunk(_i32(1, 2, 3), 0, _i32(5)),  # a prompt's first 3 tokens
            SequenceChunk(_i32(4), 2, _i32(11)),  # decoding position 2
            SequenceChunk(_i32(8, 9), 4, _i32(2, 6), all_logits=True, hidden_states=True),  # positions 4-5
        ],
        BLOCK_SIZE,
    )


def _no_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    import jax

    def refuse(*_args, **_kwargs):
        raise AssertionError("the step-inputs stage compiled something")

    monkeypatch.setattr(jax, "jit", refuse)


def test_a_ragged_batch_becomes_exactly_these_arrays(monkeypatch):
    _no_jit(monkeypatch)
    batch = _batch()
    assert partition([len(c.token_ids) for c in batch.chunks]) == [[0, 2, 1, 3]]  # one forward pass
    inputs, plan, rows, lora = step_inputs(
        batch.chunks, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, table_tokens=16, attention="reference"
    )
    # 2 decoding sequences pad to 4 beside a prompt group; 2 prompt chunks make a group of 4 chunks of 16.
    sd, sp, qb = 4, 4, 16
    t = sd + sp * qb  # 68 token rows, 7 of them real
    pad = t
    assert plan == StepPlan(
        num_tokens=t,
        decode_seqs=sd,
        decode_blocks=4,  # table_tokens 16 / block size 4
        prefill_seqs=sp,
        prefill_len=qb,
        prefill_blocks=4,
        logit_rows=sd + sp,  # 6 rows asked for fit in one per sequence of the shape
        return_hidden=True,
        attention="reference",
    )
    assert lora is None and inputs.lora_slot is None and inputs.lora_weight is None

    # Rows: decode A (0), decode C (1), prompt B (2-4), prompt D (5-6), then padding.
    def padded(real: list[int], fill: int) -> np.ndarray:
        return _i32(*real, *[fill] * (t - len(real)))

    np.testing.assert_array_equal(inputs.tokens, padded([7, 4, 1, 2, 3, 8, 9], 0))
    np.testing.assert_array_equal(inputs.positions, padded([5, 2, 0, 1, 2, 4, 5], 0))
    np.testing.assert_array_equal(inputs.write_block, padded([9, 11, 5, 5, 5, 6, 6], NUM_BLOCKS))
    np.testing.assert_array_equal(inputs.write_offset, padded([1, 2, 0, 1, 2, 0, 1], 0))

    np.testing.assert_array_equal(inputs.decode_token, _i32(0, 1, pad, pad))
    np.testing.assert_array_equal(inputs.decode_context, _i32(6, 3, 0, 0))
    np.testing.assert_array_equal(inputs.decode_tables, [[3, 9, 0, 0], [11, 0, 0, 0], [0] * 4, [0] * 4])

    prefill_token = np.full((sp, qb), pad, np.int32)
    prefill_token[0, :3] = [2, 3, 4]
    prefill_token[1, :2] = [5, 6]
    np.testing.assert_array_equal(inputs.prefill_token, prefill_token)
    np.testing.assert_array_equal(inputs.prefill_start, _i32(0, 4, 0, 0))
    np.testing.assert_array_equal(inputs.prefill_context, _i32(3, 6, 0, 0))
    np.testing.assert_array_equal(inputs.prefill_tables, [[5, 0, 0, 0], [2, 6, 0, 0], [0] * 4, [0] * 4])

    # Each chunk's last position (A, B, C, D), then D's every position; padding rows read row 0.
    np.testing.assert_array_equal(inputs.logit_rows, _i32(0, 4, 1, 6, 5, 6, 0, 0))
    assert int(inputs.live_tokens) == 7 and int(inputs.live_logits) == 6
    np.testing.assert_array_equal(rows.last, [0, 1, 2, 3])
    assert rows.all_logits == {3: slice(4, 6)} and rows.hidden == {3: slice(5, 7)}
    assert inputs.local_write_block is None and inputs.decode_local_tables is None and inputs.hot_write is None
    for a in (inputs.tokens, inputs.decode_tables, inputs.prefill_token, inputs.logit_rows):
        assert a.dtype == np.int32


def test_a_hybrid_cache_gets_its_windowed_pool_arrays(monkeypatch):
    """The windowed layers' pool: each token's write block there, and tables whose released entries
    (NO_BLOCK, behind the window) read block 0."""
    _no_jit(monkeypatch)
    chunks = [
        SequenceChunk(_i32(7), 5, _i32(3, 9), local_block_table=_i32(NO_BLOCK, 2)),
        SequenceChunk(_i32(4), 2, _i32(11), local_block_table=_i32(5)),
    ]
    inputs, plan, _, _ = step_inputs(chunks, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, local_blocks=8)
    # Decoding only: 2 sequences, 2 token rows, tables as wide as the longest sequence (2 blocks).
    assert (plan.num_tokens, plan.decode_seqs, plan.prefill_seqs, plan.decode_blocks) == (2, 2, 0, 2)
    np.testing.assert_array_equal(inputs.write_block, _i32(9, 11))
    np.testing.assert_array_equal(inputs.local_write_block, _i32(2, 5))
    np.testing.assert_array_equal(inputs.decode_local_tables, [[0, 2], [5, 0]])
    np.testing.assert_array_equal(inputs.decode_tables, [[3, 9], [11, 0]])
    assert inputs.prefill_local_tables.shape == (0, 2)


def test_compiled_cache_counts_hits_misses_and_plans():
    cache = CompiledCache()
    assert cache.get("a") is None
    program, seconds = cache.compile("a", lambda: "program a", plan="plan a")
    assert program == "program a" and seconds >= 0
    assert cache.get("a") == "program a" and cache.get("a") == "program a"
    stats = cache.stats
    assert (stats.count, stats.hits, stats.misses, stats.plans) == (1, 2, 1, ("plan a",))
    assert cache.programs() == ["program a"]
