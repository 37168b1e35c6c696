"""GGUF Q2_K and Q3_K: ruvllm's reader decodes them exactly, and every backend loads them.

The reader dequantizes through the ``gguf`` library's reference decoders; the blocks here are written
by tests/_kquant_low_files.py from ggml's bit layouts, and the values those fields define (computed
exactly, without any decoder) must come back bit for bit. candle-compat is the float reference: the
Q2_K / Q3_K file gives exactly the logits of an F32 file holding the same values. jax holds them in
float (``auto`` and ``keep_gguf_blocks`` alike, the load log naming the type) or rounds them to its
``w4a8`` groups when asked; mlx (tests/test_mlx_gguf_blocks.py) keeps Q3_K exactly and rounds Q2_K to
8-bit codes.
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


def test_jax_holds_them_in_float_under_auto_and_keep_gguf_blocks(quantized):
    """No form of the jax backend holds 16-value sub-blocks as they are: ``auto`` resolves to float32
    (``none``) for such a file, and ``keep_gguf_blocks`` dequantizes them, saying so in the load log;
    either way the logits are candle-compat's within float order (1e-4)."""
    ggml_type, path, _ = quantized
    ckpt = open_checkpoint(path)
    want = prompt_logits(load_plugins().choose_backend("candle-compat").load(ckpt, LoadOptions()), PROMPT)
    auto = load_jax(ckpt, quantization="auto")
    assert auto.options.quantization == "none"
    np.testing.assert_allclose(prompt_logits(auto, PROMPT), want, atol=1e-4, rtol=0)
    with capture_logs() as logs:
        kept = load_jax(ckpt, quantization="none", extra={"keep_gguf_blocks": True})
    said = [e for e in logs if e["event"] == "GGUF blocks not kept"]
    assert [(e["ggml_type"], e["loaded_as"]) for e in said] == [(ggml_type, "float32")]
    np.testing.assert_allclose(prompt_logits(kept, PROMPT), want, atol=1e-4, rtol=0)


def test_jax_w4a8_rounds_them_to_its_groups_and_says_so(quantized):
    """Asked for ``w4a8``, the exact values are rounded to its 4-bit groups of 32 (8-bit for the
    embedding), as float weights are: measured mean KL to candle-compat's logits below 1e-4 nats on
    this model (8e-7 for Q2_K, 1e-6 for Q3_K), logged by type."""
    ggml_type, path, _ = quantized
    ckpt = open_checkpoint(path)
    want = prompt_logits(load_plugins().choose_backend("candle-compat").load(ckpt, LoadOptions()), PROMPT)
    with capture_logs() as logs:
        model = load_jax(ckpt, quantization="w4a8")
    said = [e for e in logs if e["event"] == "GGUF blocks not kept"]
    assert [e["ggml_type"] for e in said] == [ggml_type]
    assert "w4a8" in said[0]["loaded_as"]
    kl = mean_kl(want, prompt_logits(model, PROMPT))
    print(f"\n{ggml_type}: jax w4a8 mean KL to the exact weights {kl:.3g} nats")
    assert kl < 1e-4
