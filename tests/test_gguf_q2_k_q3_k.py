"""GGUF Q2_K and Q3_K: ruvllm's reader decodes them exactly, and every backend loads them.

The reader dequantizes through the ``gguf`` library's reference decoders; the blocks here are written
by tests/_kquant_low_files.py from ggml's bit layouts, and the values those fields define (computed
exactly, without any decoder) must come back bit for bit. candle-compat is the float reference: the
Q2_K / Q3_K file gives exactly the logits of an F32 file holding the same values. jax keeps both
exactly in its ``w4a8`` k-quant form (``auto`` picks it as for the other k-quants) and dequantizes them
under ``keep_gguf_blocks``, the load log naming the type; mlx (tests/test_mlx_gguf_blocks.py) keeps
Q3_K exactly and rounds Q2_K to 8-bit codes.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from _gguf_files import write_tiny_llama_gguf
from _jax_fixtures import load_jax, mean_kl
from _kquant_files import requantize_gguf
from _kquant_low_files import PACKERS, PARTS, random_parts
from structlog.testing import capture_logs

from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm.plugins import load_plugins

TYPES = ("Q2_K", "Q3_K")
#: A prompt of the tiny model's byte vocabulary.
PROMPT = list(b"The blocks of sixteen values, their scales and their codes.")


def prompt_logits(model, ids: list[int]) -> np.ndarray:
    """All-position logits of one prompt in one prefill step, through the backend protocol."""
    blocks = -(-len(ids) // 4)
    chunk = SequenceChunk(np.asarray(ids, np.int32), 0, np.arange(blocks, dtype=np.int32), all_logits=True)
    return model.forward(ForwardBatch([chunk], 4), model.kv_cache(blocks, 4, {})).all_logits[0]


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    # hidden 256: every row is whole super-blocks (the embedding and head too).
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("f32") / "tiny.gguf", hidden=256, layers=2)


@pytest.fixture(scope="module", params=TYPES)
def quantized(request, f32_gguf, tmp_path_factory):
    """(type, the tiny model with every matrix in it, an F32 file holding its exact values)."""
    ggml_type = request.param
    folder = tmp_path_factory.mktemp(ggml_type)
    path = requantize_gguf(f32_gguf, folder / f"{ggml_type}.gguf", lambda *_: ggml_type)
    values = requantize_gguf(path, folder / "values.gguf", lambda *_: "F32")
    return ggml_type, path, values


@pytest.mark.parametrize("ggml_type", TYPES)
def test_random_blocks_decode_to_the_values_their_fields_define(ggml_type):
    """Every field over its whole range (Q3_K's scales of both signs, codes at their extremes,
    super-scales from 1e-4 to 1): the reference decoder gives the exact value of each weight, rounded
    once to float32 (bit for bit; Q3_K's products are exact in float32, Q2_K's difference rounds once)."""
    parts = random_parts(ggml_type, 4096, np.random.default_rng(3))
    got = gguf.quants.dequantize(PACKERS[ggml_type](parts), gguf.GGMLQuantizationType[ggml_type])
    np.testing.assert_array_equal(got, parts.values().astype(np.float32))


def test_the_reader_gives_the_exact_values_in_hugging_face_layout(quantized, f32_gguf):
    """Every matrix, Q/K rows put back in Hugging Face order, is the exact value of the blocks the
    test's quantizer made from the float file (rows quantize independently, so quantizing the
    un-permuted rows gives the same blocks)."""
    ggml_type, path, _ = quantized
    ckpt, source = open_checkpoint(path), open_checkpoint(f32_gguf)
    assert ckpt.quantization == ggml_type
    matrices = [n for n in ckpt.tensor_names() if n.endswith("proj.weight") or n.endswith("embed_tokens.weight")]
    assert len(matrices) == 2 * 7 + 1
    for name in matrices:
        w = source.tensor(name)
        want = PARTS[ggml_type](w.reshape(-1, 256)).values().astype(np.float32).reshape(w.shape)
        got = ckpt.tensor(name)
        assert got.dtype == np.float32 and got.shape == w.shape
        np.testing.assert_array_equal(got, want, err_msg=name)
        raw = ckpt.raw_tensor(name)
        assert raw.ggml_type == ggml_type


def test_candle_compat_gives_exactly_the_float_files_logits(quantized):
    _, path, values = quantized
    host = load_plugins()
    ours = host.choose_backend("candle-compat").load(open_checkpoint(path), LoadOptions())
    ref = host.choose_backend("candle-compat").load(open_checkpoint(values), LoadOptions())
    np.testing.assert_array_equal(prompt_logits(ours, PROMPT), prompt_logits(ref, PROMPT))


def test_jax_w4a8_holds_them_exactly(quantized):
    """``w4a8`` holds both in the native kernels' k-quant form (4-bit codes, factors per 16), every
    weight the file's value bit for bit; with int8 activations the logits are within 1e-3 nats (mean
    KL) of candle-compat's (measured 5e-8 on this model), with the native kernel as with XLA's product."""
    import jax

    from ruvllm_jax import native

    ggml_type, path, _ = quantized
    ckpt = open_checkpoint(path)
    want = prompt_logits(load_plugins().choose_backend("candle-compat").load(ckpt, LoadOptions()), PROMPT)
    xla = load_jax(ckpt, quantization="w4a8", extra={"native": False})
    layers = xla.weights.layers
    assert (layers.q_proj.bits, layers.q_proj.sub_group) == (4, 16)
    for i in range(2):
        q_proj = jax.tree_util.tree_map(lambda a, i=i: a[i], layers.q_proj)
        got = np.asarray(q_proj.dequantize(np.float32))
        np.testing.assert_array_equal(got, ckpt.tensor(f"model.layers.{i}.self_attn.q_proj.weight"))
    np.testing.assert_array_equal(
        np.asarray(xla.weights.embed.dequantize(np.float32)), ckpt.tensor("model.embed_tokens.weight")
    )
    ours = prompt_logits(xla, PROMPT)
    kl = mean_kl(want, ours)
    print(f"\n{ggml_type}: jax w4a8 mean KL to the exact weights in float {kl:.3g} nats")
    assert kl < 1e-3
    if native.available():
        fast = load_jax(ckpt, quantization="w4a8")
        assert fast.native
        assert mean_kl(want, prompt_logits(fast, PROMPT)) < 1e-3


@pytest.mark.parametrize("ggml_type", TYPES)
def test_jax_native_kernel_multiplies_them_as_the_xla_formulation(ggml_type):
    """Random blocks (every field over its range) in the kernel form and panel layout: every kernel
    variant this CPU runs gives the XLA formulation's product within float order (the integer sums
    are exact; 2e-6 of the largest output), and the variants agree bit for bit with the scalar one."""
    import jax
    import jax.numpy as jnp

    from ruvllm_jax import native
    from ruvllm_jax.gguf_blocks import wxa8_from_gguf_blocks
    from ruvllm_jax.quant import linear, to_panels

    if not native.available():
        pytest.skip("native kernels not built")
    out, cols = 48, 1024
    data = PACKERS[ggml_type](random_parts(ggml_type, out * cols // 256, np.random.default_rng(5))).reshape(out, -1)
    w = wxa8_from_gguf_blocks(ggml_type, data, (out, cols))
    x = np.random.default_rng(6).standard_normal((5, cols)).astype(np.float32)
    want = np.asarray(jax.jit(lambda x: linear(x, w))(jnp.asarray(x)))
    p = to_panels(w)
    ops = [tuple(jnp.asarray(getattr(p, f)) for f in ("quant", "scale", "offset", "sub_scale", "sub_offset"))]
    with native.use_isa("scalar"):
        ref = np.asarray(native.kxa8_group(jnp.asarray(x), jnp.int32(0), ops)[0])
    np.testing.assert_allclose(ref, want, rtol=0, atol=2e-6 * np.abs(want).max())
    for isa in native.supported_isas():
        with native.use_isa(isa):
            got = np.asarray(native.kxa8_group(jnp.asarray(x), jnp.int32(0), ops)[0])
        np.testing.assert_array_equal(got, ref, err_msg=isa)


def test_jax_auto_and_keep_gguf_blocks(quantized):
    """``auto`` picks ``w4a8`` for such a file where it picks it for the other k-quants (one CPU device
    with a vector kernel variant), else float32; ``keep_gguf_blocks`` (Q8_0 / Q4_0 / Q4_1 only)
    dequantizes them, the load log naming the type; float is candle-compat's logits within 1e-4."""
    from ruvllm_jax import native

    ggml_type, path, _ = quantized
    ckpt = open_checkpoint(path)
    want = prompt_logits(load_plugins().choose_backend("candle-compat").load(ckpt, LoadOptions()), PROMPT)
    auto = load_jax(ckpt, quantization="auto")
    assert auto.options.quantization == ("w4a8" if native.has_vector_path() else "none")
    with capture_logs() as logs:
        kept = load_jax(ckpt, quantization="none", extra={"keep_gguf_blocks": True})
    said = [e for e in logs if e["event"] == "GGUF blocks not kept"]
    assert [(e["ggml_type"], e["loaded_as"]) for e in said] == [(ggml_type, "float32")]
    np.testing.assert_allclose(prompt_logits(kept, PROMPT), want, atol=1e-4, rtol=0)


def _mixed_type(name: str, _cols: int, _layers: int) -> str:
    """llama.cpp's low-bit mixes give a weight different types by layer (Q2_K_S / Q3_K_M: Q2_K or
    Q3_K in most layers, Q4_K to Q6_K in some): layer 0 Q2_K, layer 1 Q3_K, ffn_down Q4_K / Q6_K, the
    embedding Q6_K."""
    if name == "token_embd.weight":
        return "Q6_K"
    layer = int(name.split(".")[1])
    if name.endswith("ffn_down.weight"):
        return ("Q4_K", "Q6_K")[layer]
    return ("Q2_K", "Q3_K")[layer]


def test_a_file_mixing_them_with_other_k_quants_by_layer_loads_on_every_backend(f32_gguf, tmp_path):
    """Layers of one weight in Q2_K and Q3_K (and Q4_K with Q6_K): jax stacks them in one exact
    ``w4a8`` form (every layer the file's weights), mlx keeps each layer in its own form (Q3_K exact,
    Q2_K and Q6_K 8-bit); logits against candle-compat's: jax float within 1e-4, jax ``w4a8`` and mlx
    within 1e-3 nats mean KL."""
    import jax

    path = requantize_gguf(f32_gguf, tmp_path / "mixed.gguf", _mixed_type)
    ckpt = open_checkpoint(path)
    host = load_plugins()
    want = prompt_logits(host.choose_backend("candle-compat").load(ckpt, LoadOptions()), PROMPT)
    np.testing.assert_allclose(prompt_logits(load_jax(ckpt), PROMPT), want, atol=1e-4, rtol=0)
    w4a8 = load_jax(ckpt, quantization="w4a8", extra={"native": False})
    for field, proj in (("q_proj", "self_attn.q_proj"), ("down_proj", "mlp.down_proj")):
        stacked = getattr(w4a8.weights.layers, field)
        for i in range(2):
            layer = jax.tree_util.tree_map(lambda a, i=i: a[i], stacked)
            got = np.asarray(layer.dequantize(np.float32))
            np.testing.assert_array_equal(got, ckpt.tensor(f"model.layers.{i}.{proj}.weight"), err_msg=f"{field} {i}")
    assert mean_kl(want, prompt_logits(w4a8, PROMPT)) < 1e-3
    pytest.importorskip("mlx.core")
    mlx_model = host.choose_backend("mlx").load(ckpt, LoadOptions(quantization="auto"))
    forms = [mlx_model.layers[i].weights.q_proj.form for i in range(2)]
    assert forms == ["Q2_K->8bit", "Q3_K"]
    assert mean_kl(want, prompt_logits(mlx_model, PROMPT)) < 1e-3
