"""Batch invariance of the native CPU kernels: a row's result is bit for bit the same whatever else
is in the call.

For every ISA variant this CPU runs (forced in turn, as test_cpu_kernel_variants.py does), each row
of a product of M activation rows equals that row computed alone, for M from 1 past a few widths of
the panel kernels' row blocks (so one-row kernels, full blocks and tail blocks all meet, and calls
large enough to be split across threads and handed to helpers); for the plain wxa8 layouts (panel
and row-major, 4-, 5- and 8-bit), w8a8 and the k-quants. Attention likewise: a sequence's decode
alone and beside others (including enough long ones for the work to be split across threads), and a
prompt chunk alone and beside other sequences' chunks in one prefill call.
"""

from __future__ import annotations

import platform

import jax.numpy as jnp
import numpy as np
import pytest

from ruvllm_jax import native
from ruvllm_jax.quant import quantize_w8a8, quantize_wxa8, to_panels

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")

_ARM = platform.machine().lower() in ("aarch64", "arm64")
ISAS = [isa for isa in native.ISAS if isa == "scalar" or isa.startswith("neon") == _ARM]

#: 1 .. a few panel block widths + 1 (AVX-512's plain panel blocks are 8 rows, k-quants 4), then
#: calls past kHelperRows (16) whose parts go to XLA's threads too.
ROW_COUNTS = [*range(1, 18), 19, 24, 33]


def _supported(isa: str) -> None:
    if isa not in native.supported_isas():
        pytest.skip(f"this CPU cannot run {isa} (it runs {', '.join(native.supported_isas())})")


def _each_row_alone(run, x: np.ndarray, what: str) -> None:
    """run(x) [M, N] equals run(x[i:i+1]) for every row i, bit for bit, for each M in ROW_COUNTS."""
    alone = np.concatenate([run(x[i : i + 1]) for i in range(x.shape[0])])
    for rows in ROW_COUNTS:
        got = run(x[:rows])
        bad = np.flatnonzero(~np.all(got == alone[:rows], axis=1))
        assert bad.size == 0, f"{what}: {rows} rows, row {bad[0]} differs by {np.abs(got - alone[:rows]).max():.3g}"


def _activations(rng: np.random.Generator, cols: int) -> np.ndarray:
    x = rng.standard_normal((max(ROW_COUNTS), cols)).astype(np.float32) * rng.uniform(0.1, 30, (max(ROW_COUNTS), 1))
    x[0, :32] = 0.0  # an all-zero group
    return x.astype(np.float32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "panel"), [(4, True), (5, True), (8, True), (4, False), (8, False)])
def test_wxa8_rows_do_not_depend_on_the_row_count(isa, bits, panel):
    _supported(isa)
    rng = np.random.default_rng(bits + 10 * panel)
    for out, cols in ((64, 576), (1536, 576)):  # the second large enough to be split across threads
        w = quantize_wxa8(rng.standard_normal((out, cols)).astype(np.float32), bits)
        if panel:
            w = to_panels(w)
        offset = None if w.offset is None else jnp.asarray(w.offset)
        operands = [(jnp.asarray(w.quant), jnp.asarray(w.scale), offset)]

        def run(x: np.ndarray, operands=operands) -> np.ndarray:
            with native.use_isa(isa):
                return np.asarray(native.wxa8_group(jnp.asarray(x), jnp.int32(0), operands, panel=panel)[0])

        _each_row_alone(run, _activations(rng, cols), f"{isa} {bits}-bit panel={panel} {out}x{cols}")


@pytest.mark.parametrize("isa", ISAS)
def test_w8a8_rows_do_not_depend_on_the_row_count(isa):
    _supported(isa)
    rng = np.random.default_rng(3)
    for cols in (100, 576):
        mats = [quantize_w8a8(rng.standard_normal((out, cols)).astype(np.float32)) for out in (1536, 30)]
        stacked = [(jnp.asarray(m.quant), jnp.asarray(m.scale)) for m in mats]

        def run(x: np.ndarray, stacked=stacked) -> np.ndarray:
            with native.use_isa(isa):
                ys = native.w8a8_group(jnp.asarray(x), jnp.int32(0), None, stacked)
            return np.concatenate([np.asarray(y) for y in ys], axis=1)

        _each_row_alone(run, _activations(rng, cols)[:, :cols], f"{isa} w8a8 {cols} columns")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "q6k"), [(4, False), (5, False), (6, True), (8, True)])
def test_kquant_rows_do_not_depend_on_the_row_count(isa, bits, q6k):
    from test_cpu_kernel_variants import _kquant_operands, _random_kquant

    _supported(isa)
    rng = np.random.default_rng(20 + bits)
    for out, cols in ((48, 512), (1024, 512)):
        ops = _kquant_operands(_random_kquant(rng, out, cols, bits, q6k), bits)

        def run(x: np.ndarray, ops=ops) -> np.ndarray:
            with native.use_isa(isa):
                return np.asarray(native.kxa8_group(jnp.asarray(x), jnp.int32(0), [ops])[0])

        _each_row_alone(run, _activations(rng, cols), f"{isa} k-quant {bits}-bit q6k={q6k} {out}x{cols}")


def _cache(rng: np.random.Generator, blocks: int, bs: int, kv_heads: int, head_dim: int):
    shape = (2, blocks, bs, kv_heads, head_dim)
    return (jnp.asarray(rng.standard_normal(shape).astype(np.float32)),
            jnp.asarray(rng.standard_normal(shape).astype(np.float32)))  # fmt: skip


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 256)])
def test_decode_attention_does_not_depend_on_the_other_sequences(isa, heads, kv_heads, head_dim):
    """One kv head (Gemma-3 270M) is the case a lone sequence's keys are split across threads."""
    _supported(isa)
    rng = np.random.default_rng(heads)
    blocks, bs, width = 400, 16, 24
    k, v = _cache(rng, blocks, bs, kv_heads, head_dim)
    seqs = 40
    tables = np.stack([rng.permutation(blocks)[:width] for _ in range(seqs)]).astype(np.int32)
    context = rng.integers(1, width * bs, seqs).astype(np.int32)
    context[:4] = (300, 7, width * bs, 129)
    first = np.zeros(seqs, np.int32)
    first[1::5] = np.maximum(context[1::5] - 100, 0)  # sliding windows
    q = rng.standard_normal((seqs, heads, head_dim)).astype(np.float32)

    def run(idx: list[int]) -> np.ndarray:
        with native.use_isa(isa):
            out = native.paged_decode(jnp.asarray(q[idx]), k, v, jnp.int32(1), jnp.asarray(tables[idx]),
                                      jnp.asarray(context[idx]), jnp.asarray(first[idx]))  # fmt: skip
        return np.asarray(out)

    alone = [run([s])[0] for s in range(seqs)]
    for n in (2, 3, 8, 17, seqs):
        got = run(list(range(n)))
        for s in range(n):
            np.testing.assert_array_equal(got[s], alone[s], err_msg=f"{isa}: sequence {s} of {n}")
    got = run([3, 0])  # another order
    np.testing.assert_array_equal(got[1], alone[0], err_msg=f"{isa}: sequence 0 second")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 40)])
def test_prefill_attention_does_not_depend_on_the_other_chunks(isa, heads, kv_heads, head_dim):
    _supported(isa)
    rng = np.random.default_rng(30 + heads)
    blocks, bs = 60, 4
    k, v = _cache(rng, blocks, bs, kv_heads, head_dim)
    tables = np.stack([rng.permutation(blocks)[:14] for _ in range(4)]).astype(np.int32)
    # Chunks: (sequence, first position, length); the chunk checked is sequence 0's.
    chunks = [(0, 9, 23), (1, 0, 40), (2, 30, 1), (3, 5, 7)]

    def layout(which: list[int]):
        seq, ctx, first = [], [], []
        for c in which:
            s, p0, n = chunks[c]
            pos = np.arange(p0, p0 + n)
            seq += [s] * n
            ctx += list(pos + 1)
            first += list(np.maximum(pos - 12, 0) if s == 3 else np.zeros(n, int))
        return (np.asarray(seq, np.int32), np.asarray(ctx, np.int32), np.asarray(first, np.int32))

    q_all = {c: rng.standard_normal((chunks[c][2], heads, head_dim)).astype(np.float32) for c in range(len(chunks))}

    def run(which: list[int]) -> np.ndarray:
        seq, ctx, first = layout(which)
        q = np.concatenate([q_all[c] for c in which])
        with native.use_isa(isa):
            out = native.paged_prefill(jnp.asarray(q), k, v, jnp.int32(1), jnp.asarray(tables), jnp.asarray(seq),
                                       jnp.asarray(ctx), jnp.asarray(first))  # fmt: skip
        return np.asarray(out)

    alone = {c: run([c]) for c in range(len(chunks))}
    for which in ([0, 1], [1, 0, 2], [2, 3, 0, 1], [3, 0]):
        got = run(which)
        at = 0
        for c in which:
            n = chunks[c][2]
            np.testing.assert_array_equal(got[at : at + n], alone[c], err_msg=f"{isa}: chunk {c} in {which}")
            at += n


@pytest.mark.parametrize("cols", [576, 640, 1000, 7])
def test_rmsnorm_mean_square_does_not_depend_on_the_row_count(cols):
    """RMSNorm's mean of squares (one native kernel for every ISA): each row alone equals the row in
    any batch, bit for bit, and the float64 mean within float32 rounding of a 1,000-term sum."""
    import jax

    from ruvllm_jax.row_sums import mean_square

    rng = np.random.default_rng(cols)
    x = _activations(rng, cols)
    step = jax.jit(mean_square)
    _each_row_alone(lambda a: np.asarray(step(jnp.asarray(a))), x, f"mean_square over {cols}")
    ref = (x.astype(np.float64) ** 2).mean(axis=-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(step(jnp.asarray(x))), ref, rtol=2e-6)
    # The mean really is the native one on the CPU (the XLA tree is only its fallback).
    assert "ruvllm_mean_square" in step.lower(jnp.asarray(x)).as_text()
