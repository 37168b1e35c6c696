"""GGUF blocks on the mlx backend: the types MLX's affine form holds (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K) are kept as the file's codes and dequantize to exactly what candle-compat's dequantizer
makes of the same blocks; Q6_K goes to the nearest form (8-bit codes per 32) with its error measured;
a type ruvllm does not map is refused in one line naming it."""

from __future__ import annotations

import numpy as np
import pytest
from _gguf_files import write_tiny_llama_gguf
from _kquant_files import requantize_gguf

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


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"])
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


def test_q6_k_goes_to_8_bit_codes_with_its_error_measured(f32_gguf, tmp_path):
    """Q6_K's sub-blocks of 16 have no exact MLX form (its smallest group is 32): 8-bit codes rounded
    per 32 from the file's values. The error is at most half an 8-bit step of each group's range,
    measured: relative RMS error 4.6e-3 of the weights (random Gaussian rows)."""
    ckpt = _as(f32_gguf, tmp_path, "Q6_K")
    model = load_plugins().choose_backend("mlx").load(ckpt, LoadOptions(quantization="auto"))
    for proj in PROJECTIONS:
        linear = getattr(model.layers[0].weights, proj)
        assert (linear.form, linear.bits) == ("Q6_K->8bit", 8)
        want = ckpt.tensor(f"model.layers.0.{'self_attn' if proj[0] in 'qkvo' else 'mlp'}.{proj}.weight")
        got = _dequantized(linear)
        groups = want.reshape(want.shape[0], -1, 32)
        half_step = (groups.max(-1) - groups.min(-1)) / 255 / 2
        err = np.abs(got - want).reshape(groups.shape)
        assert (err <= half_step[..., None] * 1.01 + 1e-7).all(), proj
        rel_rms = float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))
        assert rel_rms < 6e-3, (proj, rel_rms)


def test_a_gguf_type_it_does_not_map_is_refused_in_one_line(f32_gguf, tmp_path):
    import gguf

    from ruvllm.errors import RuvllmError

    path = tmp_path / "q2k.gguf"
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
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q2_K]
        raw = np.zeros((shape[0], shape[1] // block * size), np.uint8)
        writer.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(RuvllmError, match="Q2_K") as info:
        load_plugins().choose_backend("mlx").load(open_checkpoint(path), LoadOptions(quantization="auto"))
    assert "\n" not in str(info.value)
