"""Every ISA variant of the native CPU kernels against the scalar one, and how a variant is chosen.

The library holds one build of the kernels per ISA variant (scalar, avx2, avxvnni, avx512vnni on
x86-64); each variant this CPU can run is forced in turn (``native.use_isa``) and must give:

* the panel-layout wxa8 product and the w8a8 product bit for bit as the scalar loops do (integer dot
  products, then the same float operations in the same order);
* the row-major wxa8 product, paged decode and prefill attention and the LoRA kernel within float
  rounding of the scalar loops (their vector paths sum in another order);

over odd shapes, 1-19 activation rows, 4-, 5- and 8-bit codes (the full 0..255 range of 8-bit codes,
where AVX2's vpmaddubsw would saturate without its sign trick), with stored offsets (Q4_1) and in the
symmetric form (Q4_0, Q5_0, Q8_0: no offsets stored, ``m = -2^(bits-1) d`` formed by the kernels, the
same results bit for bit as with that offset stored). ``RUVLLM_CPU_ISA`` forces a variant in
a fresh process; an unknown name or one the CPU cannot run is a one-line error. The kernels' thread
count follows ``RUVLLM_THREADS``, else the process's CPU affinity.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ruvllm_jax import native
from ruvllm_jax.quant import QuantArray, quantize_w8a8, quantize_wxa8, to_panels

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")

#: This architecture's vector variants (the other architecture's are checked under qemu, see
#: test_cpu_kernels_cross.py).
_ARM = platform.machine().lower() in ("aarch64", "arm64")
VECTOR_ISAS = [isa for isa in native.ISAS if isa != "scalar" and isa.startswith("neon") == _ARM]


def _supported(isa: str) -> None:
    if isa not in native.supported_isas():
        pytest.skip(f"this CPU cannot run {isa} (it runs {', '.join(native.supported_isas())})")


def _wxa8(x: np.ndarray, w: QuantArray, isa: str) -> np.ndarray:
    offset = None if w.offset is None else jnp.asarray(w.offset)
    operands = [(jnp.asarray(w.quant), jnp.asarray(w.scale), offset)]
    with native.use_isa(isa):
        return np.asarray(native.wxa8_group(jnp.asarray(x), jnp.int32(0), operands, panel=bool(w.panel))[0])


def _full_range_8bit(rng: np.random.Generator, out: int, cols: int) -> QuantArray:
    """8-bit codes over all of 0..255 (Q8_0's -128..127 + 128), the case vpmaddubsw saturates on;
    symmetric (zero point 128, no offset stored), as Q8_0 loads."""
    w = quantize_wxa8(rng.standard_normal((out, cols)).astype(np.float32), 8)
    codes = rng.integers(0, 256, (out, cols), dtype=np.uint8)
    codes[0, :32] = 255
    return QuantArray(codes, w.scale, None, bits=8, group_size=32, zero_point=128, act_bits=8)


def _matrix(rng: np.random.Generator, bits: int, form: str, out: int, cols: int) -> QuantArray:
    """A row-major wxa8 matrix: ``symmetric`` (Q4_0 / Q5_0 / Q8_0 as loaded: no offsets), ``stored``
    (the same weights with ``m = -2^(bits-1) d`` stored as float16 offsets, the form symmetric blocks
    had before) or ``offset`` (Q4_1's real per-group offsets, 4-bit only)."""
    if form == "offset":
        return quantize_wxa8(rng.standard_normal((out, cols)).astype(np.float32), 4)
    if bits == 8:
        w = _full_range_8bit(rng, out, cols)
    else:
        from gguf import GGMLQuantizationType, quants

        from ruvllm_jax.gguf_blocks import wxa8_from_gguf_blocks

        kind = {4: "Q4_0", 5: "Q5_0"}[bits]
        data = quants.quantize(rng.standard_normal((out, cols)).astype(np.float32), GGMLQuantizationType[kind])
        w = wxa8_from_gguf_blocks(kind, data, (out, cols))
    assert w.offset is None and w.zero_point == 1 << (bits - 1)
    if form == "stored":
        m = (np.asarray(w.scale, np.float32) * -w.zero_point).astype(np.float16)
        return dataclasses.replace(w, offset=m, zero_point=0)
    return w


FORMS = [(4, "offset"), (4, "symmetric"), (5, "symmetric"), (8, "symmetric"), (8, "stored")]


@pytest.mark.parametrize("isa", VECTOR_ISAS)
@pytest.mark.parametrize(("bits", "form"), FORMS)
def test_panel_kernel_equals_scalar_bit_for_bit(isa, bits, form):
    _supported(isa)
    rng = np.random.default_rng(bits)
    for out, cols in ((16, 32), (48, 576), (32, 1536)):
        w = to_panels(_matrix(rng, bits, form, out, cols))
        assert w.panel == 16
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 19):
            x = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.1, 30)
            x[0, :32] = 0.0  # an all-zero group
            x[-1, 3] = 127.0 * np.abs(x[-1]).max()  # one activation code at +-127, the rest small
            want = _wxa8(x, w, "scalar")
            np.testing.assert_array_equal(_wxa8(x, w, isa), want, err_msg=f"{isa} {bits}-bit {rows}x{out}x{cols}")


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_symmetric_form_equals_the_stored_offsets_bit_for_bit(bits):
    """No offsets stored (the kernels form ``-2^(bits-1) d``) gives what the same blocks gave with
    their offsets stored as float16, on every variant this CPU runs, panel and row-major, and the
    XLA formulation agrees within float rounding."""
    from ruvllm_jax.quant import linear

    rng = np.random.default_rng(30 + bits)
    sym = _matrix(rng, bits, "symmetric", 48, 576)
    stored = dataclasses.replace(sym, offset=(np.asarray(sym.scale, np.float32) * -sym.zero_point).astype(np.float16),
                                 zero_point=0)  # fmt: skip
    x = rng.standard_normal((5, 576)).astype(np.float32)
    for isa in native.supported_isas():
        for panel in (False, True):
            a, b = (to_panels(sym), to_panels(stored)) if panel else (sym, stored)
            np.testing.assert_array_equal(_wxa8(x, a, isa), _wxa8(x, b, isa), err_msg=f"{isa} panel={panel}")
    want = _wxa8(x, sym, "scalar")
    got = np.asarray(linear(jnp.asarray(x), jax.tree_util.tree_map(jnp.asarray, sym)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert sym.nbytes < stored.nbytes  # the offsets are not held


@pytest.mark.parametrize("isa", VECTOR_ISAS)
@pytest.mark.parametrize(("bits", "form"), FORMS)
def test_row_major_kernel_matches_scalar(isa, bits, form):
    _supported(isa)
    rng = np.random.default_rng(10 + bits)
    for out, cols in ((7, 96), (33, 64), (50, 1536)):  # not multiples of 16 rows: row-major
        w = _matrix(rng, bits, form, out, cols)
        for rows in (1, 3, 4, 6, 19):
            x = rng.standard_normal((rows, cols)).astype(np.float32)
            want = _wxa8(x, w, "scalar")
            np.testing.assert_allclose(_wxa8(x, w, isa), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("isa", VECTOR_ISAS)
def test_w8a8_kernel_equals_scalar_bit_for_bit(isa):
    _supported(isa)
    rng = np.random.default_rng(7)
    for cols in (64, 100, 576, 1537):
        mats = [quantize_w8a8(rng.standard_normal((out, cols)).astype(np.float32)) for out in (64, 30, 7)]
        stacked = [(jnp.asarray(m.quant), jnp.asarray(m.scale)) for m in mats]
        for rows in (1, 2, 3, 4, 5, 19):
            x = jnp.asarray(rng.standard_normal((rows, cols)).astype(np.float32))
            with native.use_isa("scalar"):
                want = [np.asarray(y) for y in native.w8a8_group(x, jnp.int32(0), None, stacked)]
            with native.use_isa(isa):
                got = [np.asarray(y) for y in native.w8a8_group(x, jnp.int32(0), None, stacked)]
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("isa", VECTOR_ISAS)
def test_paged_decode_matches_scalar(isa):
    _supported(isa)
    rng = np.random.default_rng(3)
    layers, blocks, bs, heads, kv_heads, head_dim = 2, 10, 4, 9, 3, 64
    k = rng.standard_normal((layers, blocks, bs, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((layers, blocks, bs, kv_heads, head_dim)).astype(np.float32)
    context = np.array([1, 5, 19, 0], np.int32)
    tables = np.stack([rng.permutation(blocks)[:5] for _ in context]).astype(np.int32)
    q = rng.standard_normal((len(context), heads, head_dim)).astype(np.float32)
    args = (*map(jnp.asarray, (q, k, v)), jnp.int32(1), tables, context)
    with native.use_isa("scalar"):
        want = np.asarray(native.paged_decode(*args))
    with native.use_isa(isa):
        got = np.asarray(native.paged_decode(*args))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("isa", VECTOR_ISAS)
def test_paged_prefill_matches_scalar(isa):
    _supported(isa)
    rng = np.random.default_rng(4)
    for heads, kv_heads, head_dim in ((9, 3, 64), (4, 1, 40), (8, 8, 16)):
        layers, blocks, bs = 2, 30, 4
        k = rng.standard_normal((layers, blocks, bs, kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((layers, blocks, bs, kv_heads, head_dim)).astype(np.float32)
        seq = np.array([0] * 19 + [1] * 5 + [2] * 3, np.int32)
        context = np.array([*range(3, 22), 40, 41, 42, 0, 0, 1, 2, 0], np.int32)
        first = np.where(np.arange(len(seq)) % 4 == 0, np.maximum(context - 6, 0), 0).astype(np.int32)
        tables = np.stack([rng.permutation(blocks)[:12] for _ in range(3)]).astype(np.int32)
        q = rng.standard_normal((len(seq), heads, head_dim)).astype(np.float32)
        args = (*map(jnp.asarray, (q, k, v)), jnp.int32(1), tables, seq, context, first)
        with native.use_isa("scalar"):
            want = np.asarray(native.paged_prefill(*args))
        with native.use_isa(isa):
            got = np.asarray(native.paged_prefill(*args))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("isa", ["scalar", *VECTOR_ISAS])
def test_16_bit_caches_attend_as_their_float32_values_bit_for_bit(isa, dtype):
    """A float16 or bfloat16 cache is read in place, each row widened to float32 as it is read
    (exact): decode (whole tasks, and one kv head split across threads) and prefill equal, bit for
    bit, the same variant over a float32 cache holding the same values. Head dimension 36 leaves a
    tail after the 8-wide conversions."""
    _supported(isa)
    rng = np.random.default_rng(11)
    half = jnp.dtype(dtype)
    for heads, kv_heads, head_dim, blocks, bs, context in (
        (9, 3, 64, 12, 4, [1, 5, 19, 0]),
        (4, 1, 256, 24, 16, [300]),
        (6, 2, 36, 12, 4, [7, 33]),
    ):
        layers = 2
        k16 = jnp.asarray(rng.standard_normal((layers, blocks, bs, kv_heads, head_dim)), half)
        v16 = jnp.asarray(rng.standard_normal((layers, blocks, bs, kv_heads, head_dim)), half)
        k32, v32 = k16.astype(jnp.float32), v16.astype(jnp.float32)
        ctx = np.array(context, np.int32)
        width = -(-max(context) // bs)
        tables = np.stack([rng.permutation(blocks)[:width] for _ in ctx]).astype(np.int32)
        q = jnp.asarray(rng.standard_normal((len(ctx), heads, head_dim)), jnp.float32)
        with native.use_isa(isa):
            got = np.asarray(native.paged_decode(q, k16, v16, jnp.int32(1), tables, ctx))
            want = np.asarray(native.paged_decode(q, k32, v32, jnp.int32(1), tables, ctx))
        np.testing.assert_array_equal(got, want)
        assert np.abs(want).max() > 0.1  # attention over real keys, not zeros
        # prefill: every sequence's last three positions as a chunk (fewer where the context is short)
        seq = np.array([s for s, c in enumerate(context) for _ in range(min(3, c))], np.int32)
        pos = np.array([c - min(3, c) + i for c in context for i in range(min(3, c))], np.int32)
        qp = jnp.asarray(rng.standard_normal((len(seq), heads, head_dim)), jnp.float32)
        first = np.zeros_like(pos)
        with native.use_isa(isa):
            got = np.asarray(native.paged_prefill(qp, k16, v16, jnp.int32(0), tables, seq, pos + 1, first))
            want = np.asarray(native.paged_prefill(qp, k32, v32, jnp.int32(0), tables, seq, pos + 1, first))
        np.testing.assert_array_equal(got, want)


def test_caches_of_another_element_type_are_refused():
    rng = np.random.default_rng(12)
    k = jnp.asarray(rng.standard_normal((1, 4, 4, 1, 16)), jnp.float16)
    q = jnp.zeros((1, 2, 16), jnp.float32)
    tables, ctx = np.zeros((1, 2), np.int32), np.array([5], np.int32)
    with pytest.raises(Exception, match="K and V caches differ in element type"):
        np.asarray(native.paged_decode(q, k, k.astype(jnp.bfloat16), jnp.int32(0), tables, ctx))
    with pytest.raises(Exception, match="float32, float16 or bfloat16"):
        np.asarray(native.paged_decode(q, k.astype(jnp.int8), k.astype(jnp.int8), jnp.int32(0), tables, ctx))


@pytest.mark.parametrize("isa", VECTOR_ISAS)
def test_lora_kernel_matches_scalar(isa):
    _supported(isa)
    rng = np.random.default_rng(6)
    for rank, d_in, d_out, tokens in ((4, 64, 64, 3), (16, 576, 192, 33), (5, 37, 19, 1)):
        a = jnp.asarray(rng.standard_normal((2, 3 * rank, d_in)).astype(np.float32))
        bt = jnp.asarray(rng.standard_normal((2, 3 * rank, d_out)).astype(np.float32))
        x = jnp.asarray(rng.standard_normal((tokens, d_in)).astype(np.float32))
        slot = jnp.asarray(rng.integers(-1, 3, tokens).astype(np.int32))
        with native.use_isa("scalar"):
            want = np.asarray(native.lora_delta(x, jnp.int32(1), a, bt, slot, rank))
        with native.use_isa(isa):
            got = np.asarray(native.lora_delta(x, jnp.int32(1), a, bt, slot, rank))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(np.abs(want).max(), 1.0))

def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)


def test_cpu_isa_env_forces_a_variant_in_a_fresh_process():
    code = "from ruvllm_jax import native; native.available(); print(native.isa())"
    for isa in native.supported_isas():
        out = _run(code, RUVLLM_CPU_ISA=isa)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == isa
    auto = _run(code, RUVLLM_CPU_ISA="auto").stdout.strip().splitlines()[-1]
    assert auto == native.supported_isas()[-1]  # the best this CPU runs


def test_cpu_isa_env_refuses_unknown_and_unsupported_variants():
    code = "from ruvllm_jax import native; native.available()"
    other_arch = "neon" if platform.machine().lower() in ("x86_64", "amd64") else "avx2"
    for name, why in (("sse9", "unknown or not built"), (other_arch, "unknown or not built")):
        out = _run(code, RUVLLM_CPU_ISA=name)
        assert out.returncode != 0
        last = out.stderr.strip().splitlines()[-1]
        assert f"RUVLLM_CPU_ISA={name}: {why}" in last and "scalar" in last
    lacking = [isa for isa in ("avx2", "avxvnni", "avx512vnni") if isa not in native.supported_isas()]
    if lacking and native.supported_isas()[-1] not in ("neon", "neon-dotprod", "neon-i8mm"):
        out = _run(code, RUVLLM_CPU_ISA=lacking[-1])
        assert "this CPU lacks its instructions" in out.stderr.strip().splitlines()[-1]


def test_thread_count_follows_env_then_affinity():
    code = "from ruvllm_jax import native; native.available(); print(native.threads())"
    assert _run(code, RUVLLM_THREADS="3").stdout.strip().splitlines()[-1] == "3"
    cpu = min(os.sched_getaffinity(0))
    pinned = f"import os; os.sched_setaffinity(0, {{{cpu}}}); " + code
    env = {k: v for k, v in os.environ.items() if k != "RUVLLM_THREADS"}
    out = subprocess.run([sys.executable, "-c", pinned], env=env, capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "1"
    bad = _run("from ruvllm_jax import native; native.available()", RUVLLM_THREADS="zero")
    assert "RUVLLM_THREADS must be a positive integer" in bad.stderr.strip().splitlines()[-1]


def test_jitted_steps_see_the_forced_variant():
    """The FFI handlers read the selected table at every call: a compiled function needs no retrace."""
    rng = np.random.default_rng(0)
    w = to_panels(_full_range_8bit(rng, 32, 64))
    operands = [(jnp.asarray(w.quant), jnp.asarray(w.scale), None)]
    f = jax.jit(lambda x: native.wxa8_group(x, jnp.int32(0), operands, panel=True)[0])
    x = jnp.asarray(rng.standard_normal((2, 64)).astype(np.float32))
    results = {}
    for isa in native.supported_isas():
        with native.use_isa(isa):
            results[isa] = np.asarray(f(x))
    for isa, y in results.items():
        np.testing.assert_array_equal(y, results["scalar"], err_msg=isa)


# -- k-quants (two-level factors per half group; cpu_kernels.h, KMatrix) ---------------------------------


def _panel_rows(a: np.ndarray) -> np.ndarray:
    """A per-row ``[N, X]`` array in the panel layout: for each 16 rows and column, the 16 rows."""
    n, cols = a.shape
    return np.ascontiguousarray(a.reshape(n // 16, 16, cols).swapaxes(1, 2)).reshape(n, cols)


def _random_kquant(rng: np.random.Generator, out: int, cols: int, bits: int, q6k: bool) -> dict[str, np.ndarray]:
    """Row-major codes and factors in the ranges GGUF's Q4_K / Q5_K (6-bit sc and mn) and Q6_K
    (int8 sc, mn = sc under 32 d) produce, in ``gguf_blocks.kernel_form``."""
    top = {4: 16, 5: 32, 6: 64, 8: 64 if q6k else 32}[bits]
    codes = rng.integers(0, top, (out, cols)).astype(np.uint8)
    d = rng.uniform(1e-4, 2e-2, (out, cols // 256)).astype(np.float16)
    if q6k:
        sc = rng.integers(-128, 128, (out, cols // 16)).astype(np.int8)
        return dict(codes=codes, D=d, Dm=(32 * d.astype(np.float32)).astype(np.float16), sc=sc, mn=sc)
    m6 = rng.integers(0, 64, (out, cols // 32))
    s6 = rng.integers(0, 64, (out, cols // 32))
    dmin = rng.uniform(1e-4, 2e-2, (out, cols // 256)).astype(np.float16)
    sc, mn = np.repeat(s6, 2, 1).astype(np.int8), np.repeat(m6, 2, 1).astype(np.int8)
    return dict(codes=codes, D=d, Dm=dmin, sc=sc, mn=mn)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes ``[N, K]`` in cpu_kernels.h's row-major layout: per group of 32, 4-bit: byte j = code j
    (low nibble) | code j + 16 (high nibble); 5-bit: those nibbles, then 4 bytes of the codes' bit 4,
    bit i of byte k being code 4 i + k's; 6-bit: those nibbles, then 8 bytes of the codes' bits 4-5,
    code j's at bits 2 ((j % 16) // 4) and the next of byte 4 (j // 16) + j % 4; 8-bit: one byte per
    code."""
    out, cols = codes.shape
    if bits == 8:
        return codes
    c = codes.reshape(out, cols // 32, 32)
    nibbles = (c[..., :16] & 15) | ((c[..., 16:] & 15) << 4)
    if bits == 4:
        return nibbles.reshape(out, -1).astype(np.uint8)
    planes = [nibbles.astype(np.uint8)]
    j = np.arange(32)
    if bits == 5:
        high = ((c >> 4) & 1).astype(np.uint8) << (j // 4).astype(np.uint8)  # code j: bit j // 4 of byte j % 4
        planes.append(np.stack([high[..., j % 4 == k].sum(-1) for k in range(4)], -1).astype(np.uint8))
    else:
        high = ((c >> 4) & 3).astype(np.int64) << (2 * ((j % 16) // 4))
        byte = 4 * (j // 16) + j % 4
        planes.append(np.stack([high[..., byte == b].sum(-1) for b in range(8)], -1).astype(np.uint8))
    return np.concatenate(planes, -1).reshape(out, -1)


def _panel_codes(packed: np.ndarray, groups: int) -> np.ndarray:
    """cpu_kernels.h's panel_byte: per 16 rows and group, gb / 4 runs of 16 dwords, one per row."""
    out, nbytes = packed.shape
    gb = nbytes // groups
    runs = packed.reshape(out // 16, 16, groups, gb // 4, 4).transpose(0, 2, 3, 1, 4)
    return np.ascontiguousarray(runs).reshape(out, nbytes)


def _kquant_operands(k: dict[str, np.ndarray], bits: int) -> tuple[jax.Array, ...]:
    codes = _panel_codes(_pack(k["codes"], bits), k["codes"].shape[1] // 32)
    return (jnp.asarray(codes), *(jnp.asarray(_panel_rows(k[f])) for f in ("D", "Dm", "sc", "mn")))


def _quantized_activations(x: np.ndarray) -> np.ndarray:
    """float64 of ``x`` quantized per group of 32 as the kernels do (written out)."""
    rows, cols = x.shape
    xg = x.astype(np.float32).reshape(rows, cols // 32, 32)
    amax = np.abs(xg).max(-1)
    dx = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(amax > 0, dx, np.float32(1))
    xq = np.where(amax[..., None] > 0, np.clip(np.rint(xg / safe[..., None]), -127, 127), 0)
    return (xq * dx[..., None].astype(np.float64)).reshape(rows, cols)


def _reference_kquant(x: np.ndarray, k: dict[str, np.ndarray]) -> np.ndarray:
    """float64: activations quantized per group of 32 (written out), weights dequantized exactly."""
    xdq = _quantized_activations(x)
    up = lambda a, n: np.repeat(a.astype(np.float64), n, axis=1)  # noqa: E731
    w = up(k["D"], 256) * up(k["sc"], 16) * k["codes"] - up(k["Dm"], 256) * up(k["mn"], 16)
    return xdq @ w.T


@pytest.mark.parametrize("isa", ["scalar", *VECTOR_ISAS])
@pytest.mark.parametrize(("bits", "q6k"), [(4, False), (5, False), (6, True), (8, False), (8, True)])
def test_kquant_kernel_matches_reference_and_scalar(isa, bits, q6k):
    _supported(isa)
    rng = np.random.default_rng(bits + 10 * q6k)
    for out, cols in ((16, 256), (48, 512), (32, 1536)):
        k = _random_kquant(rng, out, cols, bits, q6k)
        ops = _kquant_operands(k, bits)
        for rows in (1, 2, 3, 5, 8, 9, 19):
            x = rng.standard_normal((rows, cols)).astype(np.float32)
            x[0, :32] = 0.0
            with native.use_isa(isa):
                got = np.asarray(native.kxa8_group(jnp.asarray(x), jnp.int32(0), [ops])[0])
            want = _reference_kquant(x, k)
            np.testing.assert_allclose(got, want, rtol=0, atol=3e-6 * np.abs(want).max())
            if isa != "scalar":
                with native.use_isa("scalar"):
                    ref = np.asarray(native.kxa8_group(jnp.asarray(x), jnp.int32(0), [ops])[0])
                np.testing.assert_array_equal(got, ref, err_msg=f"{isa} {bits}-bit q6k={q6k} {rows}x{out}x{cols}")


def test_kquant_call_mixes_plain_and_kquant_matrices_and_indexes_layers():
    rng = np.random.default_rng(5)
    cols = 512
    ks = [_random_kquant(rng, 32, cols, 4, False) for _ in range(2)]
    stacked = tuple(jnp.stack(parts) for parts in zip(*(_kquant_operands(k, 4) for k in ks), strict=True))
    plain = to_panels(quantize_wxa8(rng.standard_normal((16, cols)).astype(np.float32), 8))
    assert plain.offset is None  # Q8_0-like: symmetric, its offset operand empty
    plain_stacked = (*(jnp.stack([jnp.asarray(getattr(plain, f))] * 2) for f in ("quant", "scale")), None)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    for layer in (0, 1):
        got = native.kxa8_group(jnp.asarray(x), jnp.int32(layer), [stacked, plain_stacked])
        np.testing.assert_allclose(np.asarray(got[0]), _reference_kquant(x, ks[layer]), rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(np.asarray(got[1]), _wxa8(x, plain, native.isa()))
    with pytest.raises(Exception, match="layer index out of range"):
        jax.block_until_ready(native.kxa8_group(jnp.asarray(x), jnp.int32(2), [stacked]))


@pytest.mark.parametrize("isa", VECTOR_ISAS)
def test_activation_quantization_equals_scalar(isa):
    """Each variant quantizes activations with its own vector code (division and round-half-to-even
    as the scalar loop's): inputs with all-zero groups, exact halves and scales from 0.01 to 100 give
    the scalar variant's products bit for bit, through a random matrix and through one whose codes
    are all 1 (each output then is the sum of the groups' dx * sum(codes))."""
    _supported(isa)
    rng = np.random.default_rng(21)
    w = to_panels(quantize_wxa8(rng.standard_normal((16, 1024)).astype(np.float32), 4))
    ones = to_panels(QuantArray(np.full((16, 1024), 0x11, np.uint8)[:, :512], w.scale * 0 + 1, w.offset * 0, bits=4,
                                group_size=32, act_bits=8))  # fmt: skip
    x = (rng.standard_normal((7, 1024)) * rng.uniform(0.01, 100, (7, 1))).astype(np.float32)
    x[1, :64] = 0.0
    x[2, ::3] = np.round(x[2, ::3])  # exact halves after scaling hit round-half-to-even
    x[3, :32] = np.arange(32) - 15.5
    for m in (w, ones):  # the "ones" matrix sums the codes of each group: the codes themselves
        want = _wxa8(x, m, "scalar")
        np.testing.assert_array_equal(_wxa8(x, m, isa), want)


@pytest.mark.parametrize("isa", ["scalar", *VECTOR_ISAS])
@pytest.mark.parametrize("bits", [5, 6])
def test_packed_5_and_6_bit_panel_kernel_matches_reference_and_scalar(isa, bits):
    """Codes packed as nibbles plus a plane of fifth bits or the bytes of bit pairs 4-5
    (cpu_kernels.h): every code of 0..2^bits - 1, in plain groups (d * code + m per 32)."""
    _supported(isa)
    rng = np.random.default_rng(55 + bits)
    for out, cols in ((16, 32), (48, 576), (32, 1536)):
        codes = rng.integers(0, 1 << bits, (out, cols)).astype(np.uint8)
        codes[0, :32] = np.arange(32) * ((1 << bits) - 1) // 31
        d = rng.uniform(1e-3, 2e-2, (out, cols // 32)).astype(np.float16)
        m = (-16 * d.astype(np.float32)).astype(np.float16)
        ops = [(jnp.asarray(_panel_codes(_pack(codes, bits), cols // 32)), jnp.asarray(_panel_rows(d)),
                jnp.asarray(_panel_rows(m)))]  # fmt: skip
        w = np.repeat(d.astype(np.float64), 32, 1) * codes + np.repeat(m.astype(np.float64), 32, 1)
        for rows in (1, 2, 4, 5, 9, 19):
            x = rng.standard_normal((rows, cols)).astype(np.float32)
            with native.use_isa(isa):
                got = np.asarray(native.wxa8_group(jnp.asarray(x), jnp.int32(0), ops, panel=True)[0])
            want = _quantized_activations(x) @ w.T
            np.testing.assert_allclose(got, want, rtol=0, atol=3e-6 * np.abs(want).max())
            if isa != "scalar":
                with native.use_isa("scalar"):
                    ref = np.asarray(native.wxa8_group(jnp.asarray(x), jnp.int32(0), ops, panel=True)[0])
                np.testing.assert_array_equal(got, ref, err_msg=f"{isa} {rows}x{out}x{cols}")


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "RUVLLM_LOG": "ERROR", "JAX_PLATFORMS": "cpu", **env}
    cmd = [sys.executable, "-m", "ruvllm", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=full, timeout=300)


def test_info_names_block_types_auto_form_and_kernel_variant():
    isa = native.supported_isas()[1] if len(native.supported_isas()) > 1 else "scalar"
    out = _cli("info", "smollm2", RUVLLM_CPU_ISA=isa)
    assert out.returncode == 0, out.stderr
    rows = {line[:26].strip(): line[27:].strip() for line in out.stdout.splitlines()}  # f"{k:<26} {v}"
    assert rows["block types"] == "Q4_1 x210"
    assert rows["jax: quantization auto"] == ("w4a8" if isa != "scalar" else "none")
    assert rows["jax: cpu kernels"].startswith(f"{isa} (this CPU runs: scalar")


def test_cli_with_an_unsupported_cpu_isa_is_a_one_line_error():
    out = _cli("generate", "smollm2", "Hi", "--max-tokens", "1", "--backend", "jax", RUVLLM_CPU_ISA="sse9")
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "RUVLLM_CPU_ISA=sse9" in lines[0], out.stderr


def _own_form_operands(k: dict[str, np.ndarray], bits: int, q6k: bool) -> tuple[jax.Array | None, ...]:
    """The same matrix in the form the file holds it (``gguf_blocks.kernel_form``): Q6_K symmetric (no
    Dm, no mn: Dm = 32 D, mn = sc in the kernels), Q4_K / Q5_K with sc and mn per 32."""
    codes = jnp.asarray(_panel_codes(_pack(k["codes"], bits), k["codes"].shape[1] // 32))
    if q6k:
        return (codes, jnp.asarray(_panel_rows(k["D"])), None, jnp.asarray(_panel_rows(k["sc"])), None)
    per32 = [jnp.asarray(_panel_rows(np.ascontiguousarray(k[f][:, ::2]))) for f in ("sc", "mn")]
    return (codes, jnp.asarray(_panel_rows(k["D"])), jnp.asarray(_panel_rows(k["Dm"])), *per32)


@pytest.mark.parametrize("isa", ["scalar", *VECTOR_ISAS])
@pytest.mark.parametrize(("bits", "q6k"), [(4, False), (5, False), (6, False), (8, False), (6, True)])
def test_kquant_own_forms_against_the_sixteen_wide_forms(isa, bits, q6k):
    """The symmetric form (Dm, mn formed in the kernel) does the 16-wide form's arithmetic on the same
    values: equal bits. Sub-scales per 32 take a group's two halves in one integer sum and one pair of
    float steps (cpu_kernels.h): every variant gives the scalar loop's bits, and the values are the
    16-wide form's to float32 rounding. Every block of activation rows; the native call refuses
    factors of other sizes."""
    _supported(isa)
    rng = np.random.default_rng(100 + bits + 10 * q6k)
    for out, cols in ((16, 256), (48, 512), (32, 1536)):
        k = _random_kquant(rng, out, cols, bits, q6k)
        wide, own = _kquant_operands(k, bits), _own_form_operands(k, bits, q6k)
        for rows in (1, 2, 3, 5, 8, 9, 19):
            x = jnp.asarray(rng.standard_normal((rows, cols)).astype(np.float32))
            with native.use_isa(isa):
                a = np.asarray(native.kxa8_group(x, jnp.int32(0), [wide])[0])
                b = np.asarray(native.kxa8_group(x, jnp.int32(0), [own])[0])
            msg = f"{isa} {bits}-bit q6k={q6k} {rows}x{out}x{cols}"
            if q6k:
                np.testing.assert_array_equal(b, a, err_msg=msg)
                continue
            with native.use_isa("scalar"):
                ref = np.asarray(native.kxa8_group(x, jnp.int32(0), [own])[0])
            np.testing.assert_array_equal(b, ref, err_msg=msg)
            # float32 rounding of a sum of 2 * cols / 16 terms, against the output's scale
            np.testing.assert_allclose(b, a, rtol=0, atol=2e-6 * np.abs(a).max() * cols / 16, err_msg=msg)
            assert not np.array_equal(b, a) or rows == 1, msg  # the arithmetic differs: not every bit agrees
    bad = (*own[:3], own[3][:, :-1], own[4])
    with pytest.raises(Exception, match="k-quant factors have the wrong sizes"):
        native.kxa8_group(x, jnp.int32(0), [bad])[0].block_until_ready()
