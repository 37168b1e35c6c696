"""The native repack of GGUF k-quant blocks (``ruvllm_jax.repack``, ``native/cpu_repack.cc``) gives the
bytes of the NumPy conversion it replaces at load (``wxa8_from_gguf_blocks`` -> ``kernel_form``, the
type's own form, or ``sixteen_form`` -> ``common_format``'s widening; then ``to_panels``), every field
bit for bit, and refuses what that refuses: non-finite factors, Q6_K factors whose 32-fold overflows
float16 (16-wide form), data of the wrong size. A model loaded through it holds the same weights as
one loaded the NumPy way, and its own forms hold no more bytes than the file."""

from __future__ import annotations

import dataclasses

import gguf
import jax
import numpy as np
import pytest
from _gguf_files import write_tiny_llama_gguf
from _jax_fixtures import load_jax
from _kquant_files import quantize, requantize_gguf

from ruvllm.checkpoint import open_checkpoint
from ruvllm.errors import BackendError, ModelFormatError
from ruvllm_jax import loading, native
from ruvllm_jax.gguf_blocks import _with_bits, kernel_form, sixteen_form, storage_format, wxa8_from_gguf_blocks
from ruvllm_jax.quant import to_panels
from ruvllm_jax.repack import native_repack_applies, repack_kquant
from ruvllm_jax.split_stack import SplitStack

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")

FIELDS = ("quant", "scale", "offset", "sub_scale", "sub_offset")
#: Byte offsets of each type's float16 factors inside a block.
F16_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _random_blocks(ggml_type: str, out: int, cols: int, seed: int, scale: np.ndarray | None = None) -> np.ndarray:
    """Every bit pattern of codes and sub-scales, with float16 factors from ``scale`` (or small random)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]]
    raw = rng.integers(0, 256, (out, cols // block, size), dtype=np.uint8)
    for at in F16_AT[ggml_type]:
        f = rng.uniform(-0.05, 0.05, raw.shape[:2]) if scale is None else rng.choice(scale, raw.shape[:2])
        raw[..., at : at + 2] = f.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(out, -1)


def _numpy_way(ggml_type: str, raw: np.ndarray, shape: tuple[int, int], bits: int | None):
    w = wxa8_from_gguf_blocks(ggml_type, raw, shape)
    return to_panels(kernel_form(w) if bits is None else _with_bits(sixteen_form(w), bits))


def _assert_same(a, b) -> None:
    assert storage_format(a) == storage_format(b)
    for f in FIELDS:
        if getattr(a, f) is None or getattr(b, f) is None:
            assert getattr(a, f) is None and getattr(b, f) is None, f
            continue
        x, y = np.asarray(getattr(a, f)), np.asarray(getattr(b, f))
        assert x.shape == y.shape and x.dtype == y.dtype, f
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f


#: (type, code width of the 16-wide form, or None: the type's own form).
FORMS = [("Q4_K", None), ("Q5_K", None), ("Q6_K", None), ("Q4_K", 4), ("Q4_K", 5), ("Q4_K", 6)]
FORMS += [("Q5_K", 5), ("Q5_K", 6), ("Q6_K", 6)]


@pytest.mark.parametrize(("ggml_type", "bits"), FORMS)
@pytest.mark.parametrize(("out", "cols"), [(16, 256), (48, 768), (32, 1536)])
def test_random_blocks_repack_to_the_numpy_bytes(ggml_type, bits, out, cols):
    raw = _random_blocks(ggml_type, out, cols, seed=out + cols + (bits or 0))
    _assert_same(repack_kquant(ggml_type, raw, (out, cols), bits), _numpy_way(ggml_type, raw, (out, cols), bits))


@pytest.mark.parametrize("bits", [None, 6])
@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q5_K", "Q6_K"])
def test_quantized_data_repacks_to_the_numpy_bytes(ggml_type, bits):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((64, 512)).astype(np.float32) * rng.uniform(0.01, 0.2, (64, 1)).astype(np.float32)
    raw = quantize(w, ggml_type)
    _assert_same(repack_kquant(ggml_type, raw, (64, 512), bits), _numpy_way(ggml_type, raw, (64, 512), bits))


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_own_form_holds_the_files_bytes(ggml_type):
    # Codes, float16 factors and int8 sub-scales: Q6_K exactly the file's 210 bytes a block, Q4_K / Q5_K
    # the file's plus 4 (their 12 bytes of packed 6-bit scales and mins held as 16 int8).
    raw = _random_blocks(ggml_type, 32, 1024, seed=9)
    w = repack_kquant(ggml_type, raw, (32, 1024))
    held = sum(np.asarray(getattr(w, f)).nbytes for f in FIELDS if getattr(w, f) is not None)
    extra = {"Q4_K": 4, "Q5_K": 4, "Q6_K": 0}[ggml_type]
    assert held == raw.nbytes + extra * raw.nbytes // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]][1]


def test_q6_k_factors_at_the_edges_of_float16():
    # Subnormal factors (their 32-fold stays subnormal or becomes normal), zeros of both signs, and the
    # largest factor whose 32-fold float16 still holds (2047 * 32 = 65504).
    tiny = np.array([1, 3, 31, 33, 1023]) * 2.0**-24
    edge = np.array([0.0, -0.0, *tiny, 2.0**-14, 2047.0])
    edge = np.concatenate([edge, -edge])
    raw = _random_blocks("Q6_K", 32, 1024, seed=3, scale=edge)
    for bits in (None, 6):
        _assert_same(repack_kquant("Q6_K", raw, (32, 1024), bits), _numpy_way("Q6_K", raw, (32, 1024), bits))


def test_a_q6_k_factor_without_an_exact_32_fold_is_refused_as_the_numpy_way_refuses():
    raw = _random_blocks("Q6_K", 16, 256, seed=1)
    raw[5, 208:210] = np.array([2048.0], np.float16).view(np.uint8)
    with pytest.raises(BackendError, match="above 2047") as numpy_err:
        _numpy_way("Q6_K", raw, (16, 256), 6)
    with pytest.raises(BackendError) as native_err:
        repack_kquant("Q6_K", raw, (16, 256), 6)
    assert str(native_err.value) == str(numpy_err.value)
    # Its own form needs no 32-fold: the file's factor as it is.
    _assert_same(repack_kquant("Q6_K", raw, (16, 256)), _numpy_way("Q6_K", raw, (16, 256), None))


@pytest.mark.parametrize(("ggml_type", "at"), [("Q4_K", 0), ("Q4_K", 2), ("Q5_K", 2), ("Q6_K", 208)])
@pytest.mark.parametrize("bad", [np.inf, np.nan])
@pytest.mark.parametrize("bits", [None, 6])
def test_a_non_finite_factor_is_a_format_error_naming_its_block(ggml_type, at, bad, bits):
    raw = _random_blocks(ggml_type, 32, 512, seed=2)
    raw[21, 256 // 256 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]][1] + at :][:2] = np.array(
        [bad], np.float16
    ).view(np.uint8)
    with pytest.raises(ModelFormatError, match=f"{ggml_type} block 1 of row 21 has a non-finite scale"):
        repack_kquant(ggml_type, raw, (32, 512), bits)


def test_data_of_the_wrong_size_is_a_format_error():
    raw = _random_blocks("Q4_K", 16, 512, seed=4)
    with pytest.raises(ModelFormatError, match="does not match its shape"):
        repack_kquant("Q4_K", raw[:, :-1], (16, 512), 4)


def test_what_it_does_not_take_goes_the_numpy_way():
    assert native_repack_applies("Q4_K", (32, 512), 4)
    assert native_repack_applies("Q6_K", (32, 512))  # its own form
    assert not native_repack_applies("Q4_K", (24, 512), 4)  # not whole panels of 16 rows
    assert not native_repack_applies("Q6_K", (32, 512), 5)  # narrower than its own codes
    assert not native_repack_applies("Q8_0", (32, 512), 8)
    with pytest.raises(BackendError, match="no native repack"):
        repack_kquant("Q4_K", _random_blocks("Q4_K", 24, 512, seed=5), (24, 512), 4)


def test_a_model_loads_the_same_weights_through_the_native_repack(tmp_path, monkeypatch):
    path = requantize_gguf(write_tiny_llama_gguf(tmp_path / "f32.gguf", hidden=256, layers=2), tmp_path / "q.gguf")
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", "off")
    calls = []
    monkeypatch.setattr(loading, "repack_kquant", lambda *a: calls.append(a[0]) or repack_kquant(*a))
    native_way = load_jax(open_checkpoint(path), quantization="w4a8").weights
    assert "Q4_K" in calls and "Q6_K" in calls
    monkeypatch.setattr(loading, "native_repack_applies", lambda *a: False)
    numpy_way = load_jax(open_checkpoint(path), quantization="w4a8").weights
    repacked = 0
    for name in ("embed", "lm_head"):
        a, b = getattr(native_way, name), getattr(numpy_way, name)
        if a is not None:
            _assert_same(a, b)
    for f in dataclasses.fields(native_way.layers):
        a, b = getattr(native_way.layers, f.name), getattr(numpy_way.layers, f.name)
        if isinstance(a, SplitStack):  # layers of several types: each in its own form (test_split_stack.py)
            for i in range(len(a.part)):
                want = jax.tree_util.tree_map(lambda x, i=i: x[i], b).dequantize(np.float32)
                np.testing.assert_array_equal(np.asarray(a.layer(i).dequantize(np.float32)), want)
            repacked += 1
        elif hasattr(a, "sub_scale") and a.sub_scale is not None:
            _assert_same(a, b)
            repacked += 1
        elif a is not None:
            assert np.array_equal(np.asarray(a), np.asarray(b)), f.name
    assert repacked >= 4  # the file's k-quant projections went through it
