"""Paged attention: the jax.numpy reference against a float64 NumPy loop, and the Pallas kernels
(decode, flash prefill) in interpret mode against the reference, over GQA ratios, ragged lengths,
empty (padding) sequences and block boundaries; then the kernels inside the whole model.

Tolerance: inputs are O(1) float32; 1e-5 absolute allows float32 summation-order differences
(online vs two-pass softmax) and nothing else."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from ruvllm_jax.attention import reference_paged_attention
from ruvllm_jax.kernels import paged_decode_attention, paged_prefill_attention

ATOL = 1e-5


def numpy_attention(q, k_cache, v_cache, layer, tables, q_pos, context, window=0, scale=None):
    """Float64, one query and one head at a time, straight from the definition in attention.py:
    keys ``max(0, q - window + 1) .. q`` (all up to ``q`` without a window), scores times ``scale``."""
    s_n, q_n, h_n, d = q.shape
    bs, kv_n = k_cache.shape[2], k_cache.shape[3]
    group = h_n // kv_n
    out = np.zeros(q.shape, np.float64)
    for s in range(s_n):
        for i in range(q_n):
            n = min(int(q_pos[s, i]) + 1, int(context[s]))
            lo = max(0, int(q_pos[s, i]) - window + 1) if window else 0
            if n <= lo:
                continue
            pos = np.arange(lo, n)
            blocks, offs = tables[s, pos // bs], pos % bs
            keys = k_cache[layer, blocks, offs].astype(np.float64)
            vals = v_cache[layer, blocks, offs].astype(np.float64)
            for h in range(h_n):
                sc = keys[:, h // group] @ q[s, i, h].astype(np.float64)
                sc = sc / math.sqrt(d) if scale is None else sc * scale
                p = np.exp(sc - sc.max())
                out[s, i, h] = (p / p.sum()) @ vals[:, h // group]
    return out


def _case(rng, *, seqs, q_len, heads, kv_heads, head_dim, block_size, num_blocks, layers=2):
    k = rng.standard_normal((layers, num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((layers, num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    q = rng.standard_normal((seqs, q_len, heads, head_dim)).astype(np.float32)
    width = num_blocks // seqs
    tables = np.stack([rng.permutation(num_blocks)[:width] for _ in range(seqs)]).astype(np.int32)
    return q, k, v, tables


# (seqs, heads, kv_heads, head_dim, block_size, contexts): GQA 1, 3, 4, 8; contexts on and off block
# boundaries, 1, and 0 (a padding row, which must come out as zeros).
DECODE_CASES = [
    (3, 4, 4, 16, 4, [1, 8, 13]),
    (4, 9, 3, 64, 16, [0, 16, 17, 95]),
    (2, 8, 2, 32, 8, [40, 7]),
    (5, 8, 1, 16, 4, [4, 5, 3, 0, 19]),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"gqa{c[1] // c[2]}-bs{c[4]}")
def test_decode_kernel_matches_reference(case):
    seqs, heads, kv, hd, bs, contexts = case
    rng = np.random.default_rng(len(contexts) * 7 + heads)
    blocks_needed = max(-(-c // bs) for c in contexts) + 1
    q, k, v, tables = _case(
        rng,
        seqs=seqs,
        q_len=1,
        heads=heads,
        kv_heads=kv,
        head_dim=hd,
        block_size=bs,
        num_blocks=blocks_needed * seqs,
    )
    ctx = np.asarray(contexts, np.int32)
    q_pos = (ctx - 1)[:, None]
    want = numpy_attention(q, k, v, 1, tables, q_pos, ctx)
    ref = np.asarray(reference_paged_attention(q, k, v, jnp.int32(1), tables, q_pos, ctx))
    np.testing.assert_allclose(ref, want, atol=ATOL, rtol=0)
    got = np.asarray(paged_decode_attention(q[:, 0], k, v, jnp.int32(1), tables, ctx, interpret=True))
    np.testing.assert_allclose(got, ref[:, 0], atol=ATOL, rtol=0)
    assert np.all(got[ctx == 0] == 0)


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("window", [0, 100])
def test_split_decode_kernel_matches_reference(splits, window):
    """Flash decoding (``splits`` > 1): each sequence's key steps are cut into parts, one program
    each, merged by their softmax statistics. Contexts from none (padding: zeros) to 11 key steps, so
    some parts are empty, some ranges uneven; with a window, the parts cover only the window's steps."""
    rng = np.random.default_rng(splits * 10 + window)
    heads, kv, hd, bs = 8, 2, 32, 16
    contexts = np.asarray([0, 1, 64, 65, 300, 700], np.int32)
    seqs = len(contexts)
    q, k, v, tables = _case(
        rng, seqs=seqs, q_len=1, heads=heads, kv_heads=kv, head_dim=hd, block_size=bs, num_blocks=45 * seqs
    )
    q_pos = (contexts - 1)[:, None]
    want = numpy_attention(q, k, v, 1, tables, q_pos, contexts, window)
    got = np.asarray(
        paged_decode_attention(
            q[:, 0], k, v, jnp.int32(1), tables, contexts, window=jnp.int32(window), interpret=True, splits=splits
        )
    )
    np.testing.assert_allclose(got, want[:, 0], atol=ATOL, rtol=0)
    assert np.all(got[contexts == 0] == 0)
    with pytest.raises(ValueError, match="splits must be a positive integer"):
        paged_decode_attention(q[:, 0], k, v, jnp.int32(1), tables, contexts, interpret=True, splits=0)


# (heads, kv_heads, head_dim, block_size, q_len, starts, chunk lengths): chunks from scratch and
# continuing earlier context, shorter than the padded q_len, crossing blocks.
PREFILL_CASES = [
    (4, 2, 16, 4, 8, [0, 3, 9], [8, 5, 1]),
    (9, 3, 64, 16, 32, [0, 20], [32, 13]),
    (8, 1, 32, 8, 16, [0, 0, 30], [11, 16, 2]),
    (6, 6, 16, 4, 4, [7, 0], [4, 0]),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"gqa{c[0] // c[1]}-bs{c[3]}-q{c[4]}")
def test_prefill_kernel_matches_reference(case):
    heads, kv, hd, bs, q_len, starts, lens = case
    rng = np.random.default_rng(q_len * 3 + heads)
    seqs = len(starts)
    ctx = np.asarray(starts, np.int32) + np.asarray(lens, np.int32)
    blocks_needed = max(-(-int(c) // bs) for c in ctx) + 1
    q, k, v, tables = _case(
        rng,
        seqs=seqs,
        q_len=q_len,
        heads=heads,
        kv_heads=kv,
        head_dim=hd,
        block_size=bs,
        num_blocks=blocks_needed * seqs,
    )
    start = np.asarray(starts, np.int32)
    q_pos = start[:, None] + np.arange(q_len, dtype=np.int32)[None, :]
    want = numpy_attention(q, k, v, 0, tables, q_pos, ctx)
    ref = np.asarray(reference_paged_attention(q, k, v, jnp.int32(0), tables, q_pos, ctx))
    np.testing.assert_allclose(ref, want, atol=ATOL, rtol=0)
    got = np.asarray(paged_prefill_attention(q, k, v, jnp.int32(0), tables, start, ctx, interpret=True))
    real = q_pos < ctx[:, None]  # rows past a chunk's end are padding: the model drops them
    np.testing.assert_allclose(got[real], ref[real], atol=ATOL, rtol=0)


# Sliding windows (as Mistral, Gemma-3 and Phi-3 use them) with a model's own score scale: windows
# shorter than a key step, not a multiple of the block size, and longer than every context (no-op).
@pytest.mark.parametrize("window", [3, 9, 21, 200])
def test_kernels_apply_sliding_windows_and_score_scale(window):
    rng = np.random.default_rng(window)
    heads, kv, hd, bs, scale = 8, 2, 32, 4, 0.0625
    contexts = np.asarray([1, 7, 40, 93, 0], np.int32)
    seqs = len(contexts)
    q, k, v, tables = _case(
        rng, seqs=seqs, q_len=1, heads=heads, kv_heads=kv, head_dim=hd, block_size=bs, num_blocks=25 * seqs
    )
    q_pos = (contexts - 1)[:, None]
    want = numpy_attention(q, k, v, 1, tables, q_pos, contexts, window, scale)
    ref = np.asarray(
        reference_paged_attention(q, k, v, jnp.int32(1), tables, q_pos, contexts, jnp.int32(window), scale=scale)
    )
    np.testing.assert_allclose(ref, want, atol=ATOL, rtol=0)
    got = paged_decode_attention(
        q[:, 0], k, v, jnp.int32(1), tables, contexts, window=jnp.int32(window), scale=scale, interpret=True
    )
    np.testing.assert_allclose(np.asarray(got), want[:, 0], atol=ATOL, rtol=0)

    start = np.asarray([0, 5, 30, 70, 0], np.int32)
    q_len = 24
    ctx = np.minimum(start + q_len, 93).astype(np.int32)
    qp = rng.standard_normal((seqs, q_len, heads, hd)).astype(np.float32)
    q_pos = start[:, None] + np.arange(q_len, dtype=np.int32)[None, :]
    want = numpy_attention(qp, k, v, 0, tables, q_pos, ctx, window, scale)
    ref = np.asarray(
        reference_paged_attention(qp, k, v, jnp.int32(0), tables, q_pos, ctx, jnp.int32(window), scale=scale)
    )
    np.testing.assert_allclose(ref, want, atol=ATOL, rtol=0)
    got = np.asarray(
        paged_prefill_attention(
            qp, k, v, jnp.int32(0), tables, start, ctx, window=jnp.int32(window), scale=scale, interpret=True
        )
    )
    real = q_pos < ctx[:, None]
    np.testing.assert_allclose(got[real], want[real], atol=ATOL, rtol=0)


# Tables as wide as the longest context served (one compiled shape for all lengths): the reference
# loops over key chunks of KEY_CHUNK_TOKENS, only those some query sees; long contexts, a window
# that skips leading chunks, padding rows and a table far wider than any context.
@pytest.mark.parametrize("window", [0, 300])
def test_reference_attention_loops_over_key_chunks_of_wide_tables(window):
    rng = np.random.default_rng(7 + window)
    heads, kv, hd, bs = 6, 2, 16, 16
    contexts = np.asarray([700, 0, 257, 1, 1030], np.int32)
    seqs, width = len(contexts), 128  # 2048 tokens of table
    q, k, v, _ = _case(rng, seqs=seqs, q_len=1, heads=heads, kv_heads=kv, head_dim=hd, block_size=bs, num_blocks=80)
    tables = np.zeros((seqs, width), np.int32)
    for s, c in enumerate(contexts):
        n = -(-int(c) // bs)
        tables[s, :n] = rng.choice(80, n, replace=True)
    q_pos = (contexts - 1)[:, None]
    want = numpy_attention(q, k, v, 1, tables, q_pos, contexts, window)
    ref = np.asarray(reference_paged_attention(q, k, v, jnp.int32(1), tables, q_pos, contexts, jnp.int32(window)))
    np.testing.assert_allclose(ref, want, atol=ATOL, rtol=0)

    start = np.asarray([600, 0, 200, 0, 1000], np.int32)
    q_len = 40
    ctx = np.where(contexts > 0, np.minimum(start + q_len, contexts), 0).astype(np.int32)
    qp = rng.standard_normal((seqs, q_len, heads, hd)).astype(np.float32)
    q_pos = start[:, None] + np.arange(q_len, dtype=np.int32)[None, :]
    want = numpy_attention(qp, k, v, 0, tables, q_pos, ctx, window)
    ref = np.asarray(reference_paged_attention(qp, k, v, jnp.int32(0), tables, q_pos, ctx, jnp.int32(window)))
    real = q_pos < ctx[:, None]
    np.testing.assert_allclose(ref[real], want[real], atol=ATOL, rtol=0)


def test_kernels_inside_the_model_match_reference_attention(tmp_path):
    """A whole model step with the kernels (interpreted) equals the jax.numpy attention path."""
    from _gguf_files import write_tiny_llama_gguf
    from _jax_fixtures import load_jax

    from ruvllm.backend import ForwardBatch, SequenceChunk
    from ruvllm.checkpoint import open_checkpoint

    ckpt = open_checkpoint(write_tiny_llama_gguf(tmp_path / "tiny.gguf", hidden=64, layers=2))
    ref_model = load_jax(ckpt)
    kern_model = load_jax(ckpt, extra={"attention": "pallas_interpret"})
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 256, size=11).tolist(), rng.integers(0, 256, size=6).tolist()
    tables = [np.array([6, 2, 9], np.int32), np.array([1, 4], np.int32)]
    steps = [
        [
            SequenceChunk(np.asarray(a[:10], np.int32), 0, tables[0], all_logits=True),
            SequenceChunk(np.asarray(b[:5], np.int32), 0, tables[1], all_logits=True),
        ],
        [
            SequenceChunk(np.asarray(a[10:], np.int32), 10, tables[0]),  # decode
            SequenceChunk(np.asarray(b[5:], np.int32), 5, tables[1]),
        ],
    ]
    caches = [m.allocate_cache(10, 4) for m in (ref_model, kern_model)]
    for chunks in steps:
        want = ref_model.forward(ForwardBatch(chunks, 4), caches[0])
        got = kern_model.forward(ForwardBatch(chunks, 4), caches[1])
        np.testing.assert_allclose(got.logits, want.logits, atol=1e-4, rtol=0)
        for i, rows in want.all_logits.items():
            np.testing.assert_allclose(got.all_logits[i], rows, atol=1e-4, rtol=0)


def test_split_decode_inside_the_model_matches_one_part(tmp_path):
    """Decode steps with each sequence's keys cut into parts (``decode_splits``, the interpreted
    kernel) give the logits of one part, over contexts that span several of the kernel's key steps;
    the plan carries the forced number and a prefill-only step keeps one part."""
    from _gguf_files import write_tiny_llama_gguf
    from _jax_fixtures import load_jax

    from ruvllm.backend import ForwardBatch, SequenceChunk
    from ruvllm.checkpoint import open_checkpoint

    ckpt = open_checkpoint(write_tiny_llama_gguf(tmp_path / "tiny.gguf", hidden=64, layers=2))
    one = load_jax(ckpt, extra={"attention": "pallas_interpret", "decode_splits": 1})
    split = load_jax(ckpt, extra={"attention": "pallas_interpret", "decode_splits": "4"})
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 256, size=120).tolist(), rng.integers(0, 256, size=70).tolist()
    tables = [np.arange(0, 32, dtype=np.int32), np.arange(32, 64, dtype=np.int32)]
    caches = [m.allocate_cache(64, 4) for m in (one, split)]
    prompt = [  # the kernel streams 64 keys a step: 2 steps, so of 4 parts 2 hold keys and 2 none
        SequenceChunk(np.asarray(a[:119], np.int32), 0, tables[0]),
        SequenceChunk(np.asarray(b[:69], np.int32), 0, tables[1]),
    ]
    decode = [
        SequenceChunk(np.asarray(a[119:], np.int32), 119, tables[0]),
        SequenceChunk(np.asarray(b[69:], np.int32), 69, tables[1]),
    ]
    for chunks in (prompt, decode):
        want = one.forward(ForwardBatch(chunks, 4), caches[0])
        got = split.forward(ForwardBatch(chunks, 4), caches[1])
        np.testing.assert_allclose(got.logits, want.logits, atol=1e-4, rtol=0)
    plans = [p for p in split.compiled_steps.stats.plans if hasattr(p, "decode_splits")]
    assert {(p.decode_seqs > 0 and not p.prefill_seqs, p.decode_splits) for p in plans} == {(False, 1), (True, 4)}


def test_decode_splits_fill_the_sms_only_where_the_keys_pay():
    from ruvllm_jax.step_shapes import SPLIT_MIN_KEYS, decode_splits

    assert decode_splits(1, 8, 4096, 132) == 16  # Llama-3-8B, one stream: 8 programs -> 128
    assert decode_splits(4, 8, 4096, 132) == 4
    assert decode_splits(16, 8, 4096, 132) == 1  # 128 programs already fill 132 SMs
    assert decode_splits(256, 8, 4096, 132) == 1
    assert decode_splits(1, 8, 2 * SPLIT_MIN_KEYS, 132) == 2  # short tables: parts of SPLIT_MIN_KEYS at least
    assert decode_splits(1, 8, SPLIT_MIN_KEYS, 132) == 1


def test_decode_splits_option_is_refused_by_name(tmp_path):
    from _gguf_files import write_tiny_llama_gguf
    from _jax_fixtures import load_jax

    from ruvllm.checkpoint import open_checkpoint
    from ruvllm.errors import BackendError

    ckpt = open_checkpoint(write_tiny_llama_gguf(tmp_path / "tiny.gguf", hidden=64, layers=2))
    for bad in (0, -2, "many", 2.5, True):
        with pytest.raises(BackendError, match="decode_splits must be auto or a positive integer"):
            load_jax(ckpt, extra={"attention": "pallas_interpret", "decode_splits": bad})
    with pytest.raises(BackendError, match=r"decode_splits=4 .*attention='reference'"):
        load_jax(ckpt, extra={"attention": "reference", "decode_splits": 4})
    model = load_jax(ckpt, extra={"attention": "pallas_interpret"})  # auto: one part on CPU
    assert model.decode_splits is None and model.gpu_cores is None
