"""A weight whose layers a GGUF stores in different k-quant types (llama.cpp's Q4_K_M: ``attn_v`` and
``ffn_down`` Q6_K in some layers, Q4_K / Q5_K in others) is held per type in each type's own form
(``ruvllm_jax.split_stack``) when the native kernels run the model: the file's bytes instead of one
6-bit, 16-wide form for every layer, and the same logits to float32 rounding (the Q4_K / Q5_K layers'
groups are summed at once in their own form), bit for bit the scalar loop's on every kernel variant."""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest
from _gguf_files import write_tiny_llama_gguf
from _jax_fixtures import load_jax
from _kquant_files import requantize_gguf

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm_jax import native, weight_cache
from ruvllm_jax.quant import QuantArray
from ruvllm_jax.split_stack import SplitStack

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")

PROMPTS = [[1, 7, 42, 9, 100, 3, 17, 250, 8, 64, 5, 77, 31, 2, 90, 11, 12, 200, 6], [5, 9, 13]]


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory):
    d = tmp_path_factory.mktemp("split-stack")
    return requantize_gguf(write_tiny_llama_gguf(d / "f32.gguf", hidden=256, layers=4), d / "q4_k_m.gguf")


def _logits(model) -> list[np.ndarray]:
    """Every position's logits of a ragged prefill of both prompts, then one decode step each."""
    cache = model.allocate_cache(8, 16)
    chunks = [
        SequenceChunk(np.asarray(p, np.int32), 0, np.arange(2 * i, 2 * i + 2, dtype=np.int32), all_logits=True)
        for i, p in enumerate(PROMPTS)
    ]
    out = [np.asarray(a) for a in model.forward(ForwardBatch(chunks, 16), cache).all_logits]
    step = [
        SequenceChunk(np.asarray([3 + i], np.int32), len(p), np.arange(2 * i, 2 * i + 2, dtype=np.int32))
        for i, p in enumerate(PROMPTS)
    ]
    out.append(np.asarray(model.forward(ForwardBatch(step, 16), cache).logits))
    return out


def test_mixed_layers_are_held_per_type_with_the_same_logits(tiny_q4_k_m, monkeypatch):
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", "off")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tiny_q4_k_m).tensors}
    downs = [types[f"blk.{i}.ffn_down.weight"] for i in range(4)]
    assert len(set(downs)) == 3  # Q4_K / Q5_K / Q6_K by layer
    split = load_jax(open_checkpoint(tiny_q4_k_m), quantization="w4a8")
    assert split.native
    monkeypatch.setattr(weight_cache, "splits_mixed", lambda *a: False)
    common = load_jax(open_checkpoint(tiny_q4_k_m), quantization="w4a8")
    down = split.weights.layers.down_proj
    assert isinstance(down, SplitStack) and isinstance(common.weights.layers.down_proj, QuantArray)
    bits, sub = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}, {"Q4_K": 32, "Q5_K": 32, "Q6_K": 16}
    assert [p.bits for p in down.parts] == [bits[t] for t in dict.fromkeys(downs)]
    assert [downs[i] for i in range(4)] == [list(dict.fromkeys(downs))[p] for p in down.part]
    # Each layer the file's values, in its own type's form: no wider than the file.
    for i in range(4):
        layer = down.layer(i)
        want = jax.tree_util.tree_map(lambda a, i=i: a[i], common.weights.layers.down_proj)
        assert layer.sub_group == sub[downs[i]]
        np.testing.assert_array_equal(np.asarray(layer.dequantize(np.float32)), np.asarray(want.dequantize(np.float32)))
    assert down.nbytes < common.weights.layers.down_proj.nbytes
    assert split.weight_bytes < common.weight_bytes
    with native.use_isa("scalar"):
        ref = _logits(split)
    for isa in native.supported_isas():
        with native.use_isa(isa):
            for a, b, r in zip(_logits(split), _logits(common), ref, strict=True):
                np.testing.assert_array_equal(a, r, err_msg=isa)  # every variant the scalar loop's bits
                # The Q4_K / Q5_K layers' groups in one sum (cpu_kernels.h): float32 rounding apart, which
                # the next layers' activation quantization amplifies (measured 3.3e-3 of the largest).
                assert np.abs(a - b).max() <= 1e-2 * np.abs(b).max(), isa


def test_the_weight_cache_keeps_a_split_stack(tiny_q4_k_m, tmp_path, monkeypatch):
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", str(tmp_path / "weights"))
    written = load_jax(open_checkpoint(tiny_q4_k_m), quantization="w4a8")
    mapped = load_jax(open_checkpoint(tiny_q4_k_m), quantization="w4a8")
    assert isinstance(mapped.weights.layers.down_proj, SplitStack)
    for a, b in zip(_logits(written), _logits(mapped), strict=True):
        np.testing.assert_array_equal(a, b)


def test_xla_steps_keep_the_common_form(tiny_q4_k_m, monkeypatch):
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", "off")
    model = load_jax(open_checkpoint(tiny_q4_k_m), quantization="w4a8", extra={"native": False})
    assert isinstance(model.weights.layers.down_proj, QuantArray)
    assert (model.weights.layers.down_proj.bits, model.weights.layers.down_proj.sub_group) == (6, 16)
