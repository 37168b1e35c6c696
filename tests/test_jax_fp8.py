"""The jax backend's ``fp8`` form: float8 e4m3 weights with a float32 scale per output channel,
weight-only (upcast to the compute dtype inside the product). Its product is checked against float64
NumPy of the same dequantized weights; the rounding against e4m3's own precision; SmolLM2 in the
form loads at about a quarter of float32's bytes, keeps its perplexity on a fixed text within 5% and
decodes; a CUDA GPU without float8 is refused by name (the device is faked: no GPU here)."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest
from _jax_fixtures import GreedyDecoder, jax_model_at, perplexity, prompt_logits
from test_jax_quantized_smollm2 import TEXT

from ruvllm.errors import BackendError
from ruvllm_jax import options as jax_options
from ruvllm_jax.quant import FP8_MAX, QUANTIZATIONS, QuantArray, linear, quantize, quantize_fp8, take_rows


def _dequantized64(w: QuantArray) -> np.ndarray:
    return np.asarray(w.quant).astype(np.float64) * np.asarray(w.scale, np.float64)


def test_fp8_is_a_named_form_with_e4m3_codes_and_a_scale_per_row():
    assert "fp8" in QUANTIZATIONS
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 96)).astype(np.float32) * np.linspace(0.01, 3, 48, dtype=np.float32)[:, None]
    w[5] = 0.0  # an all-zero row keeps a finite scale and zero codes
    q = quantize(w, "fp8")
    assert q.quant.dtype == jnp.float8_e4m3fn and q.quant.shape == (48, 96)
    assert q.scale.dtype == np.float32 and q.scale.shape == (48, 1)
    assert q.nbytes == 48 * 96 + 48 * 4
    deq = _dequantized64(q)
    assert np.all(np.isfinite(deq)) and not deq[5].any()
    # Each row's largest magnitude maps to 448 and comes back exactly (up to the scale's float32).
    np.testing.assert_allclose(np.abs(deq).max(-1), np.abs(w).max(-1), rtol=1e-6)
    # Round to nearest with 3 mantissa bits: relative error at most 2^-4 for the normal range.
    normal = (np.abs(w) >= np.abs(w).max(-1, keepdims=True) / FP8_MAX * 2.0**-6) & (w != 0)
    err = np.abs(deq - w)[normal] / np.abs(w)[normal]
    assert err.max() <= 2.0**-4 + 1e-6
    # The embedding path (only the chosen rows) gives the same values.
    np.testing.assert_allclose(np.asarray(take_rows(q, jnp.asarray([1, 7]), jnp.float32)), deq[[1, 7]], rtol=1e-6)


@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
def test_fp8_product_matches_float64_of_the_dequantized_weights(dtype, rtol):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    q = quantize_fp8(w)
    xd = jnp.asarray(x, dtype)
    got = np.asarray(linear(xd, q).astype(jnp.float32), np.float64)
    want = np.asarray(xd.astype(jnp.float32), np.float64) @ _dequantized64(q).T
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= rtol * scale
    # Stacked on a layer axis as the model holds them: the same product per layer.
    stacked = QuantArray(jnp.stack([q.quant, q.quant]), jnp.stack([q.scale, q.scale]), bits=8, group_size=128)
    layer = QuantArray(stacked.quant[1], stacked.scale[1], bits=8, group_size=128)
    np.testing.assert_array_equal(np.asarray(linear(xd, layer)), np.asarray(linear(xd, q)))


def test_smollm2_in_fp8_is_smaller_keeps_its_perplexity_and_decodes(smollm2_path, smollm2_checkpoint):
    ids = smollm2_checkpoint.tokenizer().encode(TEXT)
    base = jax_model_at(str(smollm2_path))
    fp8 = jax_model_at(str(smollm2_path), "fp8")
    assert fp8.options.quantization == "fp8"
    # e4m3 layers (1 byte a weight) and the int8 embedding (the tied output projection, as q8's).
    assert fp8.weight_bytes <= 0.27 * base.weight_bytes
    want, got = prompt_logits(base, ids), prompt_logits(fp8, ids)
    ppl_base, ppl_fp8 = perplexity(want, ids), perplexity(got, ids)
    # e4m3 keeps 3 mantissa bits (a weight's relative error up to 1/16, where q8's groups of 32 give
    # about 1/250 of a typical weight): measured +3.1% on this 135M model (docs/performance-journal.md).
    assert abs(ppl_fp8 / ppl_base - 1) <= 0.05, (ppl_base, ppl_fp8)
    assert float(np.mean(got.argmax(-1) == want.argmax(-1))) >= 0.9  # measured 0.935
    tok = smollm2_checkpoint.tokenizer()
    (out,) = GreedyDecoder(fp8).run([tok.encode("The capital of France is")], 4)
    assert len(out) == 4 and "Paris" in tok.decode(out)


def test_fp8_is_refused_by_name_on_a_cuda_gpu_without_float8(monkeypatch):
    ampere = types.SimpleNamespace(compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(jax_options, "on_cuda", lambda: True)
    monkeypatch.setattr(jax_options.jax, "devices", lambda: [ampere])
    with pytest.raises(BackendError, match=r"quantization='fp8' needs a GPU with float8.*A100.*8\.0"):
        jax_options.check_fp8_device()
    hopper = types.SimpleNamespace(compute_capability="9.0", device_kind="NVIDIA H200")
    monkeypatch.setattr(jax_options.jax, "devices", lambda: [hopper])
    jax_options.check_fp8_device()


def test_quantizing_on_the_device_gives_the_host_forms():
    """bench_gpu.py rounds 8B-shaped weights where they are made (jnp, stacked on a layer axis): the
    loader's NumPy codes and scales, layer by layer (float rounding aside)."""
    import jax

    from ruvllm_jax.quant import quantize_int8

    rng = np.random.default_rng(2)
    w = rng.standard_normal((3, 32, 64)).astype(np.float32)
    for form in (quantize_fp8, quantize_int8):
        dev = jax.jit(form)(jnp.asarray(w))
        for layer in range(3):
            host = form(w[layer])
            assert dev.group_size == host.group_size and dev.quant.dtype == host.quant.dtype
            # XLA may divide by the maximum as a product with its reciprocal: a scale 1 ulp apart,
            # and a code at a rounding boundary may land on its neighbour.
            np.testing.assert_allclose(np.asarray(dev.scale[layer]).astype(np.float32), host.scale, rtol=1e-6)
            same = np.asarray(dev.quant[layer]).view(np.uint8) == host.quant.view(np.uint8)
            assert same.mean() >= 0.99
