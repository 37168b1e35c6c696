"""Every ISA variant of the native CPU kernels against the scalar one, and how a variant is chosen.

The library holds one build of the kernels per ISA variant (scalar, avx2, avxvnni, avx512vnni on
x86-64); each variant this CPU can run is forced in turn (``native.use_isa``) and must give:

* the panel-layout wxa8 product and the w8a8 product bit for bit as the scalar loops do (integer dot
  products, then the same float operations in the same order);
* the row-major wxa8 product and paged decode attention within float rounding of the scalar loops
  (their vector paths sum in another order);

over odd shapes, 1-19 activation rows, 4-bit and 8-bit codes (the full 0..255 range of 8-bit codes,
where AVX2's vpmaddubsw would saturate without its sign trick). ``RUVLLM_CPU_ISA`` forces a variant in
a fresh process; an unknown name or one the CPU cannot run is a one-line error. The kernels' thread
count follows ``RUVLLM_THREADS``, else the process's CPU affinity.
"""

from __future__ import annotations

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

VECTOR_ISAS = [isa for isa in native.ISAS if isa != "scalar"]


def _supported(isa: str) -> None:
    if isa not in native.supported_isas():
        pytest.skip(f"this CPU cannot run {isa} (it runs {', '.join(native.supported_isas())})")


def _wxa8(x: np.ndarray, w: QuantArray, isa: str) -> np.ndarray:
    operands = [(jnp.asarray(w.quant), jnp.asarray(w.scale), jnp.asarray(w.offset))]
    with native.use_isa(isa):
        return np.asarray(native.wxa8_group(jnp.asarray(x), jnp.int32(0), operands, panel=bool(w.panel))[0])


def _full_range_8bit(rng: np.random.Generator, out: int, cols: int) -> QuantArray:
    """8-bit codes over all of 0..255 (Q8_0's -128..127 + 128), the case vpmaddubsw saturates on."""
    w = quantize_wxa8(rng.standard_normal((out, cols)).astype(np.float32), 8)
    codes = rng.integers(0, 256, (out, cols), dtype=np.uint8)
    codes[0, :32] = 255
    return QuantArray(codes, w.scale, w.offset, bits=8, group_size=32, act_bits=8)


@pytest.mark.parametrize("isa", VECTOR_ISAS)
@pytest.mark.parametrize("bits", [4, 8])
def test_panel_kernel_equals_scalar_bit_for_bit(isa, bits):
    _supported(isa)
    rng = np.random.default_rng(bits)
    for out, cols in ((16, 32), (48, 576), (32, 1536)):
        if bits == 8:
            w = to_panels(_full_range_8bit(rng, out, cols))
        else:
            w = to_panels(quantize_wxa8(rng.standard_normal((out, cols)).astype(np.float32), 4))
        assert w.panel == 16
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 19):
            x = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.1, 30)
            x[0, :32] = 0.0  # an all-zero group
            x[-1, 3] = 127.0 * np.abs(x[-1]).max()  # one activation code at +-127, the rest small
            want = _wxa8(x, w, "scalar")
            np.testing.assert_array_equal(_wxa8(x, w, isa), want, err_msg=f"{isa} {bits}-bit {rows}x{out}x{cols}")


@pytest.mark.parametrize("isa", VECTOR_ISAS)
@pytest.mark.parametrize("bits", [4, 8])
def test_row_major_kernel_matches_scalar(isa, bits):
    _supported(isa)
    rng = np.random.default_rng(10 + bits)
    for out, cols in ((7, 96), (33, 64), (50, 1536)):  # not multiples of 16 rows: row-major
        w = _full_range_8bit(rng, out, cols) if bits == 8 else quantize_wxa8(rng.standard_normal((out, cols)), 4)
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
    operands = [(jnp.asarray(w.quant), jnp.asarray(w.scale), jnp.asarray(w.offset))]
    f = jax.jit(lambda x: native.wxa8_group(x, jnp.int32(0), operands, panel=True)[0])
    x = jnp.asarray(rng.standard_normal((2, 64)).astype(np.float32))
    results = {}
    for isa in native.supported_isas():
        with native.use_isa(isa):
            results[isa] = np.asarray(f(x))
    for isa, y in results.items():
        np.testing.assert_array_equal(y, results["scalar"], err_msg=isa)
