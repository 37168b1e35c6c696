"""Quantized weights: RTN int8 / int4 against a float64 NumPy statement of the same scheme, GGUF
Q8_0 / Q4_0 / Q4_1 blocks kept as they are against the gguf library's own dequantizer, and the one
matmul wrapper against a float64 matmul with the dequantized weights."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from ruvllm_jax.gguf_blocks import from_gguf_blocks
from ruvllm_jax.quant import QuantArray, linear, quantize_int4, quantize_int8, take_rows


def _dequant(q: QuantArray) -> np.ndarray:
    return np.asarray(q.dequantize(jnp.float32))


@pytest.fixture
def w():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    w[3, 17] = 9.0  # an outlier: per-group scales must confine its damage to one group
    return w


@pytest.mark.parametrize("group", [None, 32], ids=["per-channel", "group32"])
def test_int8_is_round_to_nearest(w, group):
    q = quantize_int8(w, group)
    groups = 1 if group is None else 128 // group
    assert q.quant.dtype == np.int8 and q.scale.shape == (48, groups)
    g = w.astype(np.float64).reshape(48, groups, -1)
    scale = q.scale.astype(np.float64)[..., None]
    # The stored scale is amax / 127 (rounded to float16 for groups).
    np.testing.assert_allclose(scale, np.abs(g).max(-1, keepdims=True) / 127, rtol=1e-3)
    want = np.clip(np.rint(g / scale), -127, 127) * scale
    np.testing.assert_allclose(_dequant(q), want.reshape(48, 128), atol=1e-6, rtol=0)
    # Half a step of error (a float16 scale can clip the group maximum by a hair more).
    assert np.all(np.abs(_dequant(q) - w).reshape(48, groups, -1) <= scale * 0.52)


def test_int4_is_asymmetric_round_to_nearest_and_packed(w):
    q = quantize_int4(w)
    assert q.quant.dtype == np.uint8 and q.quant.shape == (48, 64)  # two weights per byte
    assert q.scale.shape == q.offset.shape == (48, 4)
    g = w.astype(np.float64).reshape(48, 4, 32)
    scale = ((g.max(-1) - g.min(-1)) / 15).astype(np.float16).astype(np.float64)[..., None]
    lo = g.min(-1).astype(np.float16).astype(np.float64)[..., None]
    levels = np.clip(np.rint((g - lo) / scale), 0, 15)
    np.testing.assert_allclose(_dequant(q), (levels * scale + lo).reshape(48, 128), atol=1e-5, rtol=0)
    err = np.abs(_dequant(q) - w).reshape(48, 4, 32)
    assert np.all(err <= scale * 0.51 + 1e-3)  # half a step (float16 scale and minimum add a little)
    # The outlier coarsens only its own group: the row's other groups keep their fine steps.
    assert scale[3, 0, 0] > 2 * scale[3, 1:].max()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_load_bit_exact(w, qtype):
    t = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, t)
    want = gguf.quants.dequantize(raw, t).reshape(w.shape)
    q = from_gguf_blocks(qtype, raw, w.shape)
    assert q.nbytes <= raw.nbytes + 4 * 48 * 4  # as compact as the file, give or take f16 vs f32 scales
    np.testing.assert_array_equal(_dequant(q), want)


@pytest.mark.parametrize("make", [quantize_int8, quantize_int4], ids=["int8", "int4"])
def test_linear_and_take_rows_use_the_dequantized_weights(w, make):
    q = make(w)
    x = np.random.default_rng(1).standard_normal((5, 128)).astype(np.float32)
    deq = _dequant(q).astype(np.float64)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), q)), x @ deq.T, atol=1e-4, rtol=0)
    ids = np.array([7, 0, 47, 7], np.int32)
    np.testing.assert_array_equal(np.asarray(take_rows(q, jnp.asarray(ids), jnp.float32)), deq[ids].astype(np.float32))
