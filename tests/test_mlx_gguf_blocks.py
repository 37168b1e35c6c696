"""GGUF blocks on the mlx backend: the types MLX's affine form holds (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q3_K, Q4_K, Q5_K) are kept as the file's codes and dequantize to exactly what candle-compat's
dequantizer makes of the same blocks; Q6_K and Q2_K go to the nearest form (8-bit codes per 32) with
their error measured; a type ruvllm does not map is refused in one line naming it."""

from __future__ import annotations

import numpy as np
import pytest
from _gguf_files import write_tiny_llama_gguf
from _jax_fixtures import SMOLLM2_PROMPTS, load_jax, mean_kl, prompt_logits
from _kquant_files import requantize_gguf
from _kquant_low_files import PACKERS, random_parts

from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm.plugins import load_plugins

mx = pytest.importorskip("mlx.core")

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    # hidden 256: every row is whole k-quant super-blocks.
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("f32") / "tiny.gguf", hidden=256, layers=1)


def _as(f32_gguf, tmp_path, ggml_type: str):
    return open_checkpoint(requantize_gguf(f32_gguf, tmp_path / f"{ggml_type}.gguf", lambda *_: ggml_type))


def _dequantized(linear) -> np.ndarray:
    from ruvllm_mlx.gguf_blocks import GROUP

    w = mx.dequantize(linear.weight, linear.scales, linear.biases, group_size=GROUP, bits=linear.bits)
    return np.asarray(w)


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q3_K", "Q4_K", "Q5_K"])
def test_exact_types_dequantize_to_candle_compats_values(f32_gguf, tmp_path, ggml_type):
    ckpt = _as(f32_gguf, tmp_path, ggml_type)
    host = load_plugins()
    mlx_model = host.choose_backend("mlx").load(ckpt, LoadOptions(quantization="auto"))
    reference = host.choose_backend("candle-compat").load(ckpt, LoadOptions())
    assert mlx_model.options.quantization == "gguf"
    for proj in PROJECTIONS:
        linear = getattr(mlx_model.layers[0].weights, proj)
        assert linear.form == ggml_type and linear.bits in (4, 5, 8)
        want = getattr(reference.layers[0].weights, proj)
        # Equal values (the sign of a zero aside: -8d + 8d is +0 where d (q - 8) gives -0).
        np.testing.assert_array_equal(_dequantized(linear), want, err_msg=f"{ggml_type} {proj}")
    # Same weights, so the logits differ only by the order of float sums.
    chunk = SequenceChunk(np.arange(3, 20, dtype=np.int32), 0, np.arange(5, dtype=np.int32), all_logits=True)
    got = mlx_model.forward(ForwardBatch([chunk], 4), mlx_model.kv_cache(8, 4, {})).all_logits[0]
    ref = reference.forward(ForwardBatch([chunk], 4), reference.kv_cache(8, 4, {})).all_logits[0]
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_q3_k_random_blocks_are_exact_8_bit_codes():
    """Q3_K's products ``(s - 32) (q - 4)`` span -124 .. 128: 8-bit codes under ``d`` hold every block,
    whatever its sub-blocks' scales (here drawn over their whole range, codes at their extremes)."""
    import gguf
    from ruvllm_mlx.gguf_blocks import GROUP, affine_from_gguf

    rows, cols = 24, 512
    blocks = PACKERS["Q3_K"](random_parts("Q3_K", rows * cols // 256, np.random.default_rng(7)))
    data = blocks.reshape(rows, -1)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q3_K).reshape(rows, cols)
    a = affine_from_gguf("Q3_K", data, (rows, cols))
    got = mx.dequantize(mx.array(a.packed), mx.array(a.scales), mx.array(a.biases), group_size=GROUP, bits=8)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize(("ggml_type", "bound"), [("Q6_K", 6e-3), ("Q2_K", 5e-3)])
def test_16_value_sub_blocks_go_to_8_bit_codes_with_their_error_measured(f32_gguf, tmp_path, ggml_type, bound):
    """Q6_K's and Q2_K's sub-blocks of 16 have no exact MLX form (its smallest group is 32, and their
    products with the codes need more than 8 bits): 8-bit codes rounded per 32 from the file's values.
    The error is at most half an 8-bit step of each group's range, measured: relative RMS error of the
    weights 4.6e-3 (Q6_K) and 3.7e-3 (Q2_K) on random Gaussian rows; the logits stay within 1e-3 of
    candle-compat's (the exact weights) on this model (measured 3.3e-4 and 3.8e-4)."""
    ckpt = _as(f32_gguf, tmp_path, ggml_type)
    model = load_plugins().choose_backend("mlx").load(ckpt, LoadOptions(quantization="auto"))
    for proj in PROJECTIONS:
        linear = getattr(model.layers[0].weights, proj)
        assert (linear.form, linear.bits) == (f"{ggml_type}->8bit", 8)
        want = ckpt.tensor(f"model.layers.0.{'self_attn' if proj[0] in 'qkvo' else 'mlp'}.{proj}.weight")
        got = _dequantized(linear)
        groups = want.reshape(want.shape[0], -1, 32)
        half_step = (groups.max(-1) - groups.min(-1)) / 255 / 2
        err = np.abs(got - want).reshape(groups.shape)
        assert (err <= half_step[..., None] * 1.01 + 1e-7).all(), proj
        rel_rms = float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))
        assert rel_rms < bound, (proj, rel_rms)
    reference = load_plugins().choose_backend("candle-compat").load(ckpt, LoadOptions())
    chunk = SequenceChunk(np.arange(3, 40, dtype=np.int32), 0, np.arange(10, dtype=np.int32), all_logits=True)
    got = model.forward(ForwardBatch([chunk], 4), model.kv_cache(16, 4, {})).all_logits[0]
    ref = reference.forward(ForwardBatch([chunk], 4), reference.kv_cache(16, 4, {})).all_logits[0]
    np.testing.assert_allclose(got, ref, atol=1e-3, rtol=0)


@pytest.mark.parametrize("ggml_type", ["Q2_K", "Q3_K"])
def test_smollm2_ffn_down_in_q2_k_or_q3_k_against_its_exact_weights(smollm2_path, tmp_path, ggml_type):
    """SmolLM2 with its ffn_down (the matrices whose rows are whole super-blocks) in Q2_K or Q3_K and
    the rest in Q8_0: mean KL of the file's blocks on mlx to the same file dequantized to float32 (``-s``
    prints it), no worse than the jax backend's w4a8 of the same file. Q3_K is exact (float order only);
    Q2_K's 8-bit codes measured 0.0015 nats (4-bit codes would cost 0.32, 6-bit 0.028: the bits chosen
    in ruvllm_mlx.gguf_blocks)."""
    from ruvllm.runtime import load_model

    def type_for(name: str, _cols: int, _layers: int) -> str:
        return ggml_type if name.endswith("ffn_down.weight") else "Q8_0"

    path = requantize_gguf(smollm2_path, tmp_path / f"{ggml_type}.gguf", type_for)
    host = load_plugins("mlx")
    exact = load_model(str(path), backend="mlx", host=host, options=LoadOptions(quantization="none"))
    blocks = load_model(str(path), backend="mlx", host=host, options=LoadOptions(quantization="auto"))
    assert blocks.model.options.quantization == "gguf"
    tok = open_checkpoint(path).tokenizer()
    prompts = [tok.encode(p) for p in SMOLLM2_PROMPTS]
    want = [prompt_logits(exact, ids) for ids in prompts]
    kl = float(np.mean([mean_kl(w, prompt_logits(blocks, ids)) for w, ids in zip(want, prompts, strict=True)]))
    print(f"\nSmolLM2, ffn_down {ggml_type}: mean KL to its exact weights in float32, mlx blocks {kl:.3g} nats")
    assert kl < (1e-4 if ggml_type == "Q3_K" else 5e-3)
    from ruvllm_jax import native

    if native.has_vector_path():  # the jax backend's w4a8 on the same file, for comparison
        w4a8 = load_jax(open_checkpoint(path), quantization="w4a8")
        theirs = float(np.mean([mean_kl(w, prompt_logits(w4a8, ids)) for w, ids in zip(want, prompts, strict=True)]))
        print(f"SmolLM2, ffn_down {ggml_type}: jax w4a8 (exact weights, int8 activations) {theirs:.3g} nats")
        assert kl <= theirs


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # gguf-py on the inf
@pytest.mark.parametrize("ggml_type", ["Q2_K", "Q6_K"])
def test_a_non_finite_scale_of_a_nearest_form_type_names_the_tensor(f32_gguf, tmp_path, ggml_type):
    import gguf

    from ruvllm.errors import ModelFormatError

    path = _as(f32_gguf, tmp_path, ggml_type).path
    reader = gguf.GGUFReader(path, "r+")
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    at = {"Q2_K": 80, "Q6_K": 208}[ggml_type]  # the float16 d of the first super-block
    t.data.reshape(-1)[at : at + 2] = np.array([np.inf], np.float16).view(np.uint8)
    reader.data.flush()
    del reader
    with pytest.raises(ModelFormatError, match=r"up_proj.*non-finite") as info:
        load_plugins().choose_backend("mlx").load(open_checkpoint(path), LoadOptions(quantization="auto"))
    assert "\n" not in str(info.value)


def test_a_gguf_type_it_does_not_map_is_refused_in_one_line(f32_gguf, tmp_path):
    import gguf

    from ruvllm.errors import RuvllmError

    path = tmp_path / "iq4_nl.gguf"
    reader = gguf.GGUFReader(f32_gguf)
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if t.name != "blk.0.attn_q.weight":
            writer.add_tensor(t.name, values)
            continue
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
        raw = np.zeros((shape[0], shape[1] // block * size), np.uint8)
        writer.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(RuvllmError, match="IQ4_NL") as info:
        load_plugins().choose_backend("mlx").load(open_checkpoint(path), LoadOptions(quantization="auto"))
    assert "\n" not in str(info.value)
