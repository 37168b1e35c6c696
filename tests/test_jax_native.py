"""Native CPU kernels of the JAX backend (``ruvllm_jax.native``, called through the XLA FFI) and the
``w4a8`` format they serve.

* each kernel is checked against an independent float64 NumPy reference of the arithmetic it claims
  (grouped int8 activations times group-quantized 4/8-bit weights; per-row int8 activations times
  per-channel int8 weights; paged decode attention over ragged block tables), over shapes that take
  the vector paths, their scalar tails and the scalar fallback;
* the XLA formulations of the same products agree with the same references, so steps without the
  kernels compute the same model;
* stacked weights are indexed by layer without copies, and a bad layer index is an error, not a read
  outside the array;
* on SmolLM2, ``w4a8`` keeps the GGUF's Q4_1 codes bit for bit, stays close to float32, gives the
  same greedy text with and without the kernels, and decodes a batch as it decodes each alone.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jax_fixtures import SMOLLM2_PROMPTS, GreedyDecoder, jax_model_at, load_jax, mean_kl, prompt_logits

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm_jax import native
from ruvllm_jax.attention import reference_paged_attention
from ruvllm_jax.gguf_blocks import wxa8_from_gguf_blocks
from ruvllm_jax.quant import (
    QuantArray,
    _linear_w8a8,
    _linear_wxa8,
    _unpack_nibbles,
    from_panels,
    quantize_w8a8,
    quantize_wxa8,
    take_rows,
    to_panels,
)


def test_kernels_are_built_at_install_and_load():
    """The suite installs the backend with RUVLLM_NATIVE_REQUIRED=1: the library must be there."""
    assert native.library_path() is not None
    assert native.available(), native.unavailable_reason()
    assert native.isa() in native.supported_isas()
    assert native.supported_isas()[0] == "scalar"


# -- grouped weights x grouped int8 activations -------------------------------------------------------


def _optional(a: object) -> jax.Array | None:
    """An offset operand: the array, or None for a symmetric matrix (Q4_0, Q5_0, Q8_0 forms)."""
    return None if a is None else jnp.asarray(a)


def _reference_wxa8(x: np.ndarray, w: QuantArray) -> np.ndarray:
    """float64 of ``sum_g d dx (codes . xq) + m sx`` with the activation quantization written out."""
    rows, k = x.shape
    g = k // 32
    xg = x.astype(np.float32).reshape(rows, g, 32)
    amax = np.abs(xg).max(-1)
    dx = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(amax > 0, dx, np.float32(1))
    xq = np.where(amax[..., None] > 0, np.clip(np.rint(xg / safe[..., None]), -127, 127), 0).astype(np.int64)
    codes = np.asarray(_unpack_nibbles(jnp.asarray(w.quant), 32)) if w.bits == 4 else np.asarray(w.quant)
    c = codes.reshape(codes.shape[0], g, 32).astype(np.int64)
    p = np.einsum("rgk,ogk->rog", xq, c).astype(np.float64)
    d = np.asarray(w.scale, np.float64)
    m = np.asarray(w.offset, np.float64) if w.offset is not None else -w.zero_point * d  # symmetric forms
    sx = dx.astype(np.float64) * xq.sum(-1)
    return np.einsum("rog,og,rg->ro", p, d, dx.astype(np.float64)) + sx @ m.T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    ("rows", "out", "cols"), [(1, 64, 576), (3, 50, 128), (6, 7, 1536), (9, 33, 96), (19, 48, 64), (2, 32, 1536)]
)
def test_wxa8_kernel_matches_float64_reference(bits, rows, out, cols):
    """Matrices of a multiple of 16 rows run in the panel layout, others row-major (both kernels)."""
    rng = np.random.default_rng(rows * 100 + out)
    w = quantize_wxa8(rng.standard_normal((out, cols)).astype(np.float32), bits)
    stored = to_panels(w)
    assert stored.panel == (16 if out % 16 == 0 else 0)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero group
    x[-1, 5] *= 50.0  # an outlier
    want = _reference_wxa8(x, w)
    scale = np.abs(want).max()
    operands = [(jnp.asarray(stored.quant), jnp.asarray(stored.scale), _optional(stored.offset))]
    call = jax.jit(lambda x: native.wxa8_group(x, jnp.int32(0), operands, panel=bool(stored.panel))[0])
    got = np.asarray(call(x), np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)
    # One row's result does not depend on the other rows (same float operations at any batch size).
    np.testing.assert_array_equal(np.asarray(call(x[-1:]))[0], np.asarray(call(x))[-1])
    xla = np.asarray(jax.jit(lambda x: _linear_wxa8(x, stored))(x), np.float64)
    np.testing.assert_allclose(xla, want, rtol=0, atol=2e-6 * scale)
    # A quantized version of the float product, not something else.
    exact = x.astype(np.float64) @ np.asarray(w.dequantize(jnp.float32), np.float64).T
    assert np.abs(got - exact).max() < 0.05 * np.abs(exact).max()


@pytest.mark.parametrize("bits", [4, 8])
def test_products_of_many_rows_are_split_across_every_thread(bits):
    """A call of 16 rows or more is split into several parts per kernel thread, claimed by the pool's
    threads and by XLA's own as helpers (cpu_pool.h, the pool). However the parts fall, the product
    equals float64, and each row equals the same row multiplied alone (one part per thread, no
    helpers) bit for bit, call after call (a part run twice or skipped would show); the w8a8
    products split the same way."""
    rng = np.random.default_rng(bits)
    rows, out, cols = 40, 320, 512
    w = quantize_wxa8(rng.standard_normal((out, cols)).astype(np.float32), bits)
    stored = to_panels(w)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    operands = [(jnp.asarray(stored.quant), jnp.asarray(stored.scale), _optional(stored.offset))]
    call = jax.jit(lambda x: native.wxa8_group(x, jnp.int32(0), operands, panel=True)[0])
    got = np.asarray(call(x))
    want = _reference_wxa8(x, w)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    for r in (0, 17, rows - 1):
        np.testing.assert_array_equal(np.asarray(call(x[r : r + 1]))[0], got[r])
    for _ in range(20):
        np.testing.assert_array_equal(np.asarray(call(x)), got)

    s = rng.uniform(0.5, 2.0, cols).astype(np.float32)
    q8 = quantize_w8a8(rng.standard_normal((out, cols)).astype(np.float32), s)
    call8 = jax.jit(lambda x: native.w8a8_group(x, jnp.int32(0), jnp.asarray(q8.in_scale[None]), [
        (jnp.asarray(q8.quant[None]), jnp.asarray(q8.scale[None]))
    ])[0])
    got8 = np.asarray(call8(x))
    np.testing.assert_allclose(got8, np.asarray(jax.jit(lambda x: _linear_w8a8(x, q8))(x)), rtol=1e-6, atol=0)
    for r in (0, rows - 1):
        np.testing.assert_array_equal(np.asarray(call8(x[r : r + 1]))[0], got8[r])


def test_wxa8_group_indexes_stacked_layers_and_shares_the_input():
    rng = np.random.default_rng(3)
    layers = [[quantize_wxa8(rng.standard_normal((n, 64)).astype(np.float32), 4) for n in (40, 24)] for _ in range(3)]
    stacked = [
        tuple(jnp.asarray(np.stack([getattr(layers[i][j], f) for i in range(3)])) for f in ("quant", "scale", "offset"))
        for j in range(2)
    ]
    x = rng.standard_normal((2, 64)).astype(np.float32)
    for layer in range(3):
        got = jax.jit(lambda x, at: native.wxa8_group(x, at, stacked))(x, jnp.int32(layer))
        for j in range(2):
            np.testing.assert_allclose(np.asarray(got[j]), _reference_wxa8(x, layers[layer][j]), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="layer index out of range"):
        jax.block_until_ready(native.wxa8_group(jnp.asarray(x), jnp.int32(3), stacked))


@pytest.mark.parametrize("live", [0, 1, 5, 9])
def test_products_skip_padding_rows_after_the_live_ones(live):
    """``[layer, live]`` as the layer operand: live rows equal the full product bit for bit (a row's
    result never depends on other rows), padding rows come out 0 (wxa8 row-major and panel, k-quant
    panel entry, w8a8)."""
    rng = np.random.default_rng(live)
    x = jnp.asarray(rng.standard_normal((9, 256)).astype(np.float32))
    at = jnp.asarray([0, live], jnp.int32)
    for out, bits in ((40, 4), (48, 8)):
        stored = to_panels(quantize_wxa8(rng.standard_normal((out, 256)).astype(np.float32), bits))
        ops = [(jnp.asarray(stored.quant), jnp.asarray(stored.scale), _optional(stored.offset))]
        full = np.asarray(native.wxa8_group(x, jnp.int32(0), ops, panel=bool(stored.panel))[0])
        got = np.asarray(native.wxa8_group(x, at, ops, panel=bool(stored.panel))[0])
        np.testing.assert_array_equal(got[:live], full[:live])
        assert (got[live:] == 0).all()
        if stored.panel:
            got_k = np.asarray(native.kxa8_group(x, at, ops)[0])
            np.testing.assert_array_equal(got_k[:live], full[:live])
            assert (got_k[live:] == 0).all()
    w = quantize_w8a8(rng.standard_normal((30, 256)).astype(np.float32), np.ones(256, np.float32))
    pair = [(jnp.asarray(w.quant), jnp.asarray(w.scale))]
    full = np.asarray(native.w8a8_group(x, jnp.int32(0), None, pair)[0])
    got = np.asarray(native.w8a8_group(x, at, None, pair)[0])
    np.testing.assert_array_equal(got[:live], full[:live])
    assert (got[live:] == 0).all()


def test_wxa8_keeps_gguf_blocks_bit_for_bit():
    """Q4_1, Q4_0 and Q8_0 blocks become codes + scale + offset that dequantize to the file's values."""
    from ruvllm_jax.gguf_blocks import from_gguf_blocks

    rng = np.random.default_rng(5)
    out, cols = 4, 64
    d = rng.uniform(0.01, 0.1, (out, cols // 32)).astype(np.float16)
    m = rng.uniform(-1, 0, (out, cols // 32)).astype(np.float16)
    nib = rng.integers(0, 256, (out, cols // 32, 16), dtype=np.uint8)
    q8 = rng.integers(-127, 128, (out, cols // 32, 32), dtype=np.int8)
    blocks = {
        "Q4_1": np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), nib], -1),
        "Q4_0": np.concatenate([d[..., None].view(np.uint8), nib], -1),
        "Q8_0": np.concatenate([d[..., None].view(np.uint8), q8.view(np.uint8)], -1),
    }
    for ggml_type, data in blocks.items():
        data = data.reshape(out, -1)
        want = np.asarray(from_gguf_blocks(ggml_type, data, (out, cols)).dequantize(jnp.float32))
        got = wxa8_from_gguf_blocks(ggml_type, data, (out, cols))
        assert got.act_bits == 8 and got.group_size == 32
        np.testing.assert_array_equal(np.asarray(got.dequantize(jnp.float32)), want)


def test_panel_layout_is_a_permutation_that_reads_back():
    rng = np.random.default_rng(11)
    for bits in (4, 8):
        w = quantize_wxa8(rng.standard_normal((48, 96)).astype(np.float32), bits)
        p = to_panels(w)
        assert p.quant.shape == w.quant.shape and p.nbytes == w.nbytes
        assert sorted(np.asarray(p.quant).ravel()) == sorted(np.asarray(w.quant).ravel())
        back = from_panels(p)
        for f in ("quant", "scale", "offset"):
            np.testing.assert_array_equal(np.asarray(getattr(back, f)), np.asarray(getattr(w, f)))
        np.testing.assert_array_equal(np.asarray(p.dequantize(jnp.float32)), np.asarray(w.dequantize(jnp.float32)))
        ids = jnp.asarray([0, 15, 16, 47, 5])
        rows = np.asarray(take_rows(p, ids, jnp.float32))
        np.testing.assert_array_equal(rows, np.asarray(w.dequantize(jnp.float32))[np.asarray(ids)])
    assert to_panels(quantize_wxa8(rng.standard_normal((40, 64)).astype(np.float32), 4)).panel == 0


# -- per-channel int8 weights x per-row int8 activations ------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("cols", [576, 100])
def test_w8a8_kernel_equals_the_xla_product(rows, cols):
    """Both are exact int32 sums of the same codes, scaled by the same factors (XLA may round the
    two scale multiplications in another order: a last-bit difference at most)."""
    rng = np.random.default_rng(rows + cols)
    mats = []
    s = rng.uniform(0.5, 2.0, cols).astype(np.float32)  # one group shares its smoothing factors
    for out in (64, 30):
        w = rng.standard_normal((3, out, cols)).astype(np.float32)
        mats.append([quantize_w8a8(w[i], s) for i in range(3)])
    stacked = [(jnp.asarray(np.stack([q.quant for q in m])), jnp.asarray(np.stack([q.scale for q in m]))) for m in mats]
    in_scale = jnp.asarray(np.stack([q.in_scale for q in mats[0]]))
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    for layer in (0, 2):
        got = jax.jit(lambda x, at: native.w8a8_group(x, at, in_scale, stacked))(x, jnp.int32(layer))
        for j in range(2):
            want = jax.jit(lambda x, w=mats[j][layer]: _linear_w8a8(x, w))(x)
            np.testing.assert_allclose(np.asarray(got[j]), np.asarray(want), rtol=1e-6, atol=0)


# -- paged decode attention -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 16)])
def test_paged_decode_matches_reference_attention(heads, kv_heads, head_dim):
    rng = np.random.default_rng(heads * kv_heads)
    layers, blocks, bs, width = 2, 12, 4, 5
    k = rng.standard_normal((layers, blocks, bs, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((layers, blocks, bs, kv_heads, head_dim)).astype(np.float32)
    context = np.array([1, 4, 5, 17, 20, 0], np.int32)  # block boundaries, a full table, padding
    tables = np.stack([rng.permutation(blocks)[:width] for _ in context]).astype(np.int32)
    tables[-1] = blocks  # a padding row points past the end, as the runner pads
    q = rng.standard_normal((len(context), heads, head_dim)).astype(np.float32)
    for layer in range(layers):
        got = np.asarray(native.paged_decode(*map(jnp.asarray, (q, k, v)), jnp.int32(layer), tables, context))
        want = np.asarray(
            reference_paged_attention(
                jnp.asarray(q[:, None]), k, v, jnp.int32(layer), tables, (context - 1)[:, None], context
            )[:, 0]
        )
        np.testing.assert_allclose(got[:-1], want[:-1], rtol=1e-5, atol=1e-5)
        assert np.all(got[-1] == 0.0)
        # float64 by hand for one sequence, one head.
        s, h = 3, heads - 1
        g = h // (heads // kv_heads)
        keys = np.concatenate([k[layer, b, :, g] for b in tables[s]])[: context[s]].astype(np.float64)
        vals = np.concatenate([v[layer, b, :, g] for b in tables[s]])[: context[s]].astype(np.float64)
        sc = keys @ q[s, h].astype(np.float64) / np.sqrt(head_dim)
        p = np.exp(sc - sc.max())
        np.testing.assert_allclose(got[s, h], (p / p.sum()) @ vals, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 6, 13])
def test_paged_decode_sliding_window_and_scale(window):
    """Sliding-window layers pass each sequence's first key (``q - window + 1``) and the model's score
    scale; the kernel equals the reference attention with the same window and scale."""
    from ruvllm_jax.attention import window_start

    rng = np.random.default_rng(window)
    layers, blocks, bs, width, heads, kv_heads, head_dim, scale = 2, 40, 4, 8, 8, 2, 32, 0.07
    k = rng.standard_normal((layers, blocks, bs, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((layers, blocks, bs, kv_heads, head_dim)).astype(np.float32)
    context = np.array([1, 5, 14, 27, 32], np.int32)
    tables = np.stack([rng.permutation(blocks)[:width] for _ in context]).astype(np.int32)
    q = rng.standard_normal((len(context), heads, head_dim)).astype(np.float32)
    first = window_start(jnp.asarray(context - 1), window)
    got = np.asarray(
        native.paged_decode(*map(jnp.asarray, (q, k, v)), jnp.int32(1), tables, context, first, scale=scale)
    )
    want = reference_paged_attention(
        jnp.asarray(q[:, None]), k, v, jnp.int32(1), tables, (context - 1)[:, None], context, window, scale=scale
    )[:, 0]
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
    no_window = native.paged_decode(*map(jnp.asarray, (q, k, v)), jnp.int32(1), tables, context, scale=scale)
    assert np.abs(got[3:] - np.asarray(no_window)[3:]).max() > 1e-2  # the window changed something


@pytest.mark.parametrize(("context", "first"), [(300, 0), (257, 0), (300, 41), (129, 0), (64, 0)])
def test_paged_decode_one_kv_head_split_across_threads(context, first):
    """One sequence of a model with one kv head (Gemma-3 270M decoding alone) is one task: with two or
    more kernel threads its keys are split into ranges of at least 64, one per thread, and the ranges
    merged (at these shapes from 128 keys, where the kernel starts using its threads; 64 stay whole).
    Whatever the split, it equals float64 attention over the same keys."""
    rng = np.random.default_rng(context + first)
    layers, blocks, bs, heads, head_dim, scale = 2, 24, 16, 4, 256, 0.0625
    k = rng.standard_normal((layers, blocks, bs, 1, head_dim)).astype(np.float32)
    v = rng.standard_normal((layers, blocks, bs, 1, head_dim)).astype(np.float32)
    table = rng.permutation(blocks)[None, :20].astype(np.int32)
    q = rng.standard_normal((1, heads, head_dim)).astype(np.float32)
    ctx, start = np.array([context], np.int32), np.array([first], np.int32)
    got = np.asarray(native.paged_decode(*map(jnp.asarray, (q, k, v)), jnp.int32(1), table, ctx, start, scale=scale))
    keys = np.concatenate([k[1, b, :, 0] for b in table[0]])[first:context].astype(np.float64)
    vals = np.concatenate([v[1, b, :, 0] for b in table[0]])[first:context].astype(np.float64)
    sc = q[0].astype(np.float64) @ keys.T * scale
    p = np.exp(sc - sc.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ vals
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=2e-6)


# -- paged prefill attention ------------------------------------------------------------------------------------


def _prefill_float64(q, k, v, layer, tables, seq, context, first, scale):
    """Attention of each query by hand in float64: its sequence's keys ``first .. context - 1``."""
    n, heads, head_dim = q.shape
    group = heads // k.shape[3]
    out = np.zeros((n, heads, head_dim))
    for i in range(n):
        if context[i] == 0:
            continue
        keys = np.concatenate([k[layer, b] for b in tables[seq[i]]])[first[i] : context[i]].astype(np.float64)
        vals = np.concatenate([v[layer, b] for b in tables[seq[i]]])[first[i] : context[i]].astype(np.float64)
        for h in range(heads):
            sc = keys[:, h // group] @ q[i, h].astype(np.float64) * scale
            p = np.exp(sc - sc.max())
            out[i, h] = (p / p.sum()) @ vals[:, h // group]
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "window", "scale"),
    [(9, 3, 64, 0, None), (4, 1, 256, 7, 0.06), (8, 8, 40, 0, None), (6, 2, 24, 5, 0.3), (16, 1, 16, 0, None)],
)
def test_paged_prefill_matches_float64_attention(heads, kv_heads, head_dim, window, scale):
    """Prompt chunks of several sequences (ragged, longer than a tile, padded queries between them, a
    chunk after cached positions, one that starts at 0) against float64 attention by hand, and against
    the XLA reference attention the kernel replaces; padding queries get zeros."""
    from ruvllm_jax.attention import window_start

    rng = np.random.default_rng(heads * head_dim + window)
    layers, blocks, bs, width = 2, 48, 4, 12
    k = rng.standard_normal((layers, blocks, bs, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((layers, blocks, bs, kv_heads, head_dim)).astype(np.float32)
    qb = 37  # queries per sequence in the padded group
    start = np.array([0, 9, 3, 0], np.int32)
    length = np.array([37, 22, 1, 0], np.int32)  # the last sequence is padding
    tables = np.stack([rng.permutation(blocks)[:width] for _ in start]).astype(np.int32)
    q_pos = start[:, None] + np.arange(qb, dtype=np.int32)[None]
    context = start + length
    live = q_pos < context[:, None]
    ctx = np.where(live, q_pos + 1, 0).astype(np.int32).reshape(-1)
    first = np.asarray(window_start(jnp.asarray(q_pos), window)).reshape(-1)
    q = rng.standard_normal((len(start) * qb, heads, head_dim)).astype(np.float32)
    seq = np.repeat(np.arange(len(start), dtype=np.int32), qb)
    sc = head_dim**-0.5 if scale is None else scale
    for layer in range(layers):
        got = np.asarray(
            native.paged_prefill(*map(jnp.asarray, (q, k, v)), jnp.int32(layer), tables, seq, ctx, first, scale=scale)
        )
        want = _prefill_float64(q, k, v, layer, tables, seq, ctx, first, sc)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
        assert np.all(got[ctx == 0] == 0.0)
        ref = reference_paged_attention(
            jnp.asarray(q.reshape(len(start), qb, heads, head_dim)), k, v, jnp.int32(layer), tables, q_pos,
            context, window, scale=scale,
        )
        np.testing.assert_allclose(
            got[live.reshape(-1)], np.asarray(ref).reshape(-1, heads, head_dim)[live.reshape(-1)], rtol=1e-5, atol=2e-6
        )


def test_paged_prefill_refuses_a_sequence_index_out_of_range():
    k = jnp.zeros((1, 4, 4, 1, 16), jnp.float32)
    q = jnp.zeros((2, 2, 16), jnp.float32)
    tables = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(Exception, match="sequence index out of range"):
        native.paged_prefill(q, k, k, jnp.int32(0), tables, jnp.array([0, 3], jnp.int32), jnp.array([1, 2], jnp.int32))


# -- LoRA ----------------------------------------------------------------------------------------------------


def test_lora_delta_applies_each_tokens_own_adapter():
    """Tokens of one step with different adapter slots (and none): B_s (A_s x) by hand in float64, at
    every layer of stacked factors; a token without an adapter gets zeros."""
    rng = np.random.default_rng(0)
    layers, slots, rank, d_in, d_out, tokens = 3, 4, 8, 96, 40, 21
    a = rng.standard_normal((layers, slots * rank, d_in)).astype(np.float32)
    bt = rng.standard_normal((layers, slots * rank, d_out)).astype(np.float32)
    x = rng.standard_normal((tokens, d_in)).astype(np.float32)
    slot = rng.integers(-1, slots, tokens).astype(np.int32)
    slot[:2] = (-1, slots - 1)
    for layer in range(layers):
        got = np.asarray(native.lora_delta(*map(jnp.asarray, (x,)), jnp.int32(layer), a, bt, slot, rank))
        want = np.zeros((tokens, d_out))
        for t, s in enumerate(slot):
            if s >= 0:
                rows = slice(s * rank, (s + 1) * rank)
                want[t] = (a[layer, rows].astype(np.float64) @ x[t]) @ bt[layer, rows].astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert np.all(got[slot < 0] == 0.0)


# -- SmolLM2 --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def w4a8_model(smollm2_path):
    return jax_model_at(str(smollm2_path), "w4a8")


def test_smollm2_w4a8_keeps_the_files_q4_1_codes(w4a8_model, smollm2_checkpoint):
    raw = smollm2_checkpoint.raw_tensor("model.layers.3.mlp.down_proj.weight")
    assert raw.ggml_type == "Q4_1"
    w = w4a8_model.weights.layers.down_proj
    assert (w.bits, w.group_size, w.act_bits) == (4, 32, 8)
    assert w.panel == 16  # stored in the kernels' panel layout: a permutation of the file's bytes
    layer3 = from_panels(dataclasses.replace(w, quant=w.quant[3], scale=w.scale[3], offset=w.offset[3]))
    direct = wxa8_from_gguf_blocks(raw.ggml_type, raw.data, raw.shape)
    np.testing.assert_array_equal(np.asarray(layer3.quant), direct.quant)
    np.testing.assert_array_equal(np.asarray(layer3.scale), direct.scale)
    np.testing.assert_array_equal(np.asarray(layer3.offset), direct.offset)
    assert w4a8_model.native


def test_smollm2_w4a8_is_close_to_float32(smollm2_path, smollm2_checkpoint, w4a8_model):
    """The weights are the file's own; only the activation quantization (int8 per 32) is new. On
    benchmarks/jax_quality.py's 390-token text: KL 0.0029 nats, top-1 96.9% (w8a8: 0.0154, 93.6%);
    on this shorter text top-1 is 94.4% (51 of 54 positions)."""
    ids = smollm2_checkpoint.tokenizer().encode(
        "The committee met on Tuesday to review the budget. Spending on maintenance had grown by twelve "
        "percent, mostly because of repairs to the roof of the library, while the sports programme came in "
        "under budget. Photosynthesis turns light into chemical energy in the chloroplasts of green plants."
    )
    want = prompt_logits(jax_model_at(str(smollm2_path)), ids).astype(np.float64)
    got = prompt_logits(w4a8_model, ids).astype(np.float64)
    kl = mean_kl(want, got)
    assert 0 < kl < 0.01
    assert float(np.mean(got.argmax(-1) == want.argmax(-1))) >= 0.9


def test_smollm2_w4a8_same_text_with_and_without_kernels(smollm2_path, smollm2_checkpoint, w4a8_model):
    """The kernels and XLA's w4a8 path pick the same greedy token wherever the choice is not a
    near-tie. Their logits agree up to float rounding order, which activation quantization amplifies
    (a code flips when rounding moves a value across a half step; scaling one norm weight by
    (1 + 1e-6) moves the XLA path's logits by 0.33 at scale 27; the two paths differ by 0.4-1.4), and
    XLA's own rounding differs between CPUs (an AVX2 EPYC flipped a 0.06-logit tie that an AVX-512
    Xeon did not). So along XLA's greedy continuation of each prompt (teacher-forced through both),
    a different pick is allowed only where XLA's top-2 margin is under twice the two paths' largest
    logit difference at that position, and most positions must be clear of that."""
    tok = smollm2_checkpoint.tokenizer()
    xla = load_jax(smollm2_checkpoint, quantization="w4a8", extra={"native": False})
    assert not xla.native
    clear = 0
    positions = 0
    for prompt in (tok.encode(p) for p in SMOLLM2_PROMPTS):
        ids = prompt + GreedyDecoder(xla).run([prompt], 10)[0]
        a, b = prompt_logits(w4a8_model, ids), prompt_logits(xla, ids)
        assert np.abs(a - b).max() < 0.1 * np.abs(b).max()
        for i in range(len(prompt) - 1, len(ids) - 1):
            top2 = np.sort(b[i])[-2:]
            margin, bound = top2[1] - top2[0], 2 * np.abs(a[i] - b[i]).max()
            positions += 1
            if margin >= bound:
                clear += 1
                assert a[i].argmax() == b[i].argmax(), (tok.decode(ids[: i + 1]), margin, bound)
    assert clear >= positions // 2, (clear, positions)


def test_smollm2_w4a8_batch_invariance(smollm2_checkpoint, w4a8_model):
    """Every row is quantized and multiplied on its own, attention reads each sequence's own blocks:
    a sequence's logits do not depend on its batch at all."""
    tok = smollm2_checkpoint.tokenizer()
    prompts = [tok.encode(p) for p in SMOLLM2_PROMPTS]
    together = GreedyDecoder(w4a8_model).run(prompts, 12)
    alone = [GreedyDecoder(w4a8_model).run([p], 12)[0] for p in prompts]
    assert together == alone
    assert tok.decode(together[0]).startswith(" Paris")
    # Decode steps: logits bit for bit, whatever else is in the step.
    cache = w4a8_model.allocate_cache(32, 16)
    tables = [np.arange(4, dtype=np.int32) + 4 * i for i in range(len(prompts))]
    for i, p in enumerate(prompts):
        w4a8_model.forward(ForwardBatch([SequenceChunk(np.asarray(p, np.int32), 0, tables[i])], 16), cache)
    steps = [SequenceChunk(np.asarray([together[i][0]], np.int32), len(p), tables[i]) for i, p in enumerate(prompts)]
    batched = w4a8_model.forward(ForwardBatch(steps, 16), cache).logits
    single = np.stack([w4a8_model.forward(ForwardBatch([s], 16), cache).logits[0] for s in steps])
    np.testing.assert_array_equal(batched, single)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_smollm2_w4a8_attends_natively_over_a_16_bit_cache(smollm2_checkpoint, w4a8_model, dtype):
    """``--kv-cache-dtype float16`` / ``bfloat16`` under w4a8: the native kernels read the 16-bit
    cache in place (the compiled steps call them with it; that they read it exactly as its float32
    values is test_cpu_kernel_variants.py's); prefill and decode logits stay close to the float32
    cache's, and the greedy continuation is the same."""
    tok = smollm2_checkpoint.tokenizer()
    ids = tok.encode(SMOLLM2_PROMPTS[0])
    table = np.arange(4, dtype=np.int32)
    runs = []
    for options in ({}, {"dtype": dtype}):
        cache = w4a8_model.allocate_cache(8, 16, options)
        pre = SequenceChunk(np.asarray(ids, np.int32), 0, table, all_logits=True)
        logits = [w4a8_model.forward(ForwardBatch([pre], 16), cache).all_logits[0]]
        tokens = [int(logits[0][-1].argmax())]
        for step in range(6):
            chunk = SequenceChunk(np.asarray(tokens[-1:], np.int32), len(ids) + step, table)
            logits.append(w4a8_model.forward(ForwardBatch([chunk], 16), cache).logits)
            tokens.append(int(logits[-1][0].argmax()))
        runs.append((np.concatenate(logits), tokens, cache))
    (want, want_tokens, _), (got, got_tokens, half_cache) = runs
    assert str(half_cache.state.k.dtype) == dtype
    hlo = [step.as_text() for step in w4a8_model.compiled_steps.programs()]
    for target in ("ruvllm_paged_decode", "ruvllm_paged_prefill"):
        called = [text for text in hlo if target in text]
        assert any(f"{'f16' if dtype == 'float16' else 'bf16'}[" in text for text in called), target
    # Any change to an attention output moves some of o_proj's int8 activation codes by one step
    # (see the test above), so float16 and bfloat16 land at the same distance: 0.004 nats here. Rows
    # compared while both runs had the same inputs: the cache's rounding may tip a near tie of the
    # float32 run's greedy choice (top-2 gap under 0.5), and after it the inputs differ.
    same = next((i for i, (a, b) in enumerate(zip(want_tokens, got_tokens, strict=True)) if a != b), len(want_tokens))
    rows = len(ids) + same
    assert 0 < mean_kl(want[:rows].astype(np.float64), got[:rows].astype(np.float64)) < 0.01
    if same < len(want_tokens):
        top2 = np.sort(want[rows - 1])[-2:]
        assert top2[1] - top2[0] < 0.5, (same, want_tokens, got_tokens)


def test_native_option_is_validated(smollm2_checkpoint):
    from ruvllm.errors import BackendError

    with pytest.raises(BackendError, match="native must be true or false"):
        load_jax(smollm2_checkpoint, quantization="w4a8", extra={"native": "sometimes"})
    assert not load_jax(smollm2_checkpoint, quantization="w4a8", extra={"native": "false"}).native


def test_without_kernels_the_reason_is_given():
    """Turned off, or installed without its library (no compiler at install): ``available()`` is
    False with the reason, nothing raises at load, and the steps take the XLA path (the native=False
    tests above run that path)."""
    import os
    import subprocess
    import sys

    code = "from ruvllm_jax import native; print(native.available(), '|', native.unavailable_reason())"
    off = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "RUVLLM_JAX_NATIVE": "0"}, capture_output=True
    )
    assert off.stdout.decode().strip().splitlines()[-1] == "False | turned off by RUVLLM_JAX_NATIVE"
    missing = "from ruvllm_jax import native; native.library_path = lambda: None; " + code.split("; ", 1)[1]
    out = subprocess.run([sys.executable, "-c", missing], capture_output=True).stdout.decode()
    assert out.strip().splitlines()[-1].startswith("False | the package was installed without its native library")


def test_auto_quantization_picks_w4a8_for_q4_gguf_only(smollm2_checkpoint, tmp_path):
    from _jax_fixtures import write_tiny_hf_model

    from ruvllm.checkpoint import open_checkpoint

    auto = load_jax(smollm2_checkpoint, quantization="auto")
    if native.has_vector_path():
        assert auto.options.quantization == "w4a8" and auto.native
    else:  # the scalar loops are no faster than float32: auto keeps the weights as they are
        assert auto.options.quantization == "none"
    # Asked to stay off the native kernels: the float path.
    assert load_jax(smollm2_checkpoint, quantization="auto", extra={"native": False}).options.quantization == "none"
    # A float checkpoint keeps its precision.
    tiny = open_checkpoint(write_tiny_hf_model(tmp_path / "tiny", "llama"))
    assert load_jax(tiny, quantization="auto").options.quantization == "none"
