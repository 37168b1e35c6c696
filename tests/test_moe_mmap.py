"""Experts left in the GGUF file's memory map (``mmap_experts``): on candle-compat each step decodes only
the chosen experts' blocks (the checkpoint's raw views of the mapping, by the same dequantizers as a
load), so the logits equal the copied form's bit for bit, for k-quant, Q8_0, MXFP4 and float experts;
the option's values, its ``auto`` rule and its refusals are checked by name."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
from _moe_checkpoints import mxfp4_representable, write_gpt_oss_gguf, write_moe_checkpoint, write_moe_gguf

from ruvllm import mapped_experts
from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm.errors import BackendError
from ruvllm.plugins import load_plugins

BLOCK = 4
#: Expert sizes that k-quants take (whole super-blocks of 256 inputs).
KQUANT_SHAPE = dict(hidden_size=256, moe_intermediate_size=256, norm_topk_prob=True)


def _load(path: Path, mmap_experts: object = "auto"):
    ckpt = open_checkpoint(path)
    backend = load_plugins().choose_backend("candle-compat")
    return backend.load(ckpt, LoadOptions(extra={"mmap_experts": mmap_experts}))


def _steps(model) -> list[np.ndarray]:
    """All-position logits of a ragged prefill of two sequences, then two decode steps of both."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 101, size=n).tolist() for n in (9, 5)]
    tables = [np.arange(i * 6, i * 6 + 6, dtype=np.int32) for i in range(2)]
    cache = model.kv_cache(12, BLOCK, {})
    chunks = [
        SequenceChunk(np.asarray(p, np.int32), 0, t, all_logits=True) for p, t in zip(prompts, tables, strict=True)
    ]
    out = model.forward(ForwardBatch(chunks, BLOCK), cache)
    logits = [out.all_logits[0], out.all_logits[1]]
    lengths = [len(p) for p in prompts]
    for step in range(2):
        chunks = [
            SequenceChunk(np.asarray([7 + step + i], np.int32), n, t)
            for i, (n, t) in enumerate(zip(lengths, tables, strict=True))
        ]
        logits.append(model.forward(ForwardBatch(chunks, BLOCK), cache).logits)
        lengths = [n + 1 for n in lengths]
    return logits


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    from test_moe_native import _requantize  # the Q4_K_M / Q8_0 expert files jax's native tests use

    d = tmp_path_factory.mktemp("mmap")
    f32 = write_moe_gguf(write_moe_checkpoint(d / "hf", "qwen3_moe", **KQUANT_SHAPE), "qwen3_moe", d / "f32.gguf")
    mixtral = write_moe_checkpoint(d / "mixtral", "mixtral")
    gpt_oss = write_moe_checkpoint(d / "gpt_oss", "gpt_oss", swiglu_limit=7.0)
    mxfp4_representable(gpt_oss)
    return {
        "qwen3_moe_f32": f32,
        "qwen3_moe_q4_k_m": _requantize(f32, d / "q4_k_m.gguf", "q4_k_m"),
        "mixtral_q8_0": write_moe_gguf(mixtral, "mixtral", d / "mixtral.gguf", "Q8_0"),
        "gpt_oss_mxfp4": write_gpt_oss_gguf(gpt_oss, d / "gpt_oss.gguf", "MXFP4"),
    }


@pytest.mark.parametrize("kind", ["qwen3_moe_f32", "qwen3_moe_q4_k_m", "mixtral_q8_0", "gpt_oss_mxfp4"])
def test_mapped_experts_compute_the_copied_forms_logits_bit_for_bit(files, kind) -> None:
    copied, mapped = _load(files[kind], "false"), _load(files[kind], "true")
    assert (copied.options.extra["mmap_experts"], mapped.options.extra["mmap_experts"]) == ("false", "true")
    for a, b in zip(_steps(copied), _steps(mapped), strict=True):
        np.testing.assert_array_equal(a, b)


def _mapping_of(a: np.ndarray) -> object:
    """The object at the bottom of ``a``'s chain of bases (an ``mmap.mmap`` for a view of a file)."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


def test_mapped_experts_are_views_of_the_files_mapping(files) -> None:
    """No float copy of an expert exists after load: each expert's parts are the file's blocks, read
    through the checkpoint's mapping; the other weights are float32 as in the copied form."""
    model = _load(files["qwen3_moe_q4_k_m"], True)
    cfg = model.config
    for layer in model.layers:
        gate_up, down = layer.gate_up, layer.weights.expert_down
        assert gate_up.shape == (cfg.num_experts, 2 * cfg.expert_intermediate_size, cfg.hidden_size)
        assert down.shape == (cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size)
        for part in [*gate_up.parts, *down.parts]:
            for raw in part:
                assert raw.ggml_type in ("Q4_K", "Q6_K") and raw.data.dtype == np.uint8
                assert isinstance(_mapping_of(raw.data), mmap.mmap)
    assert model.embed.dtype == np.float32


def test_auto_maps_experts_when_their_float_copy_would_not_fit(files, monkeypatch) -> None:
    path = files["mixtral_q8_0"]
    need = mapped_experts.experts_float_bytes(open_checkpoint(path))
    monkeypatch.setattr(mapped_experts, "available_memory", lambda: int(need / mapped_experts.AUTO_SHARE) - 1)
    assert _load(path).options.extra["mmap_experts"] == "true"
    monkeypatch.setattr(mapped_experts, "available_memory", lambda: 4 * need)
    assert _load(path).options.extra["mmap_experts"] == "false"


def test_bad_mmap_experts_values_are_refused_by_name(files, tmp_path) -> None:
    with pytest.raises(BackendError, match="mmap_experts must be one of auto, true, false, got 'yes'"):
        _load(files["mixtral_q8_0"], "yes")
    hf_dir = write_moe_checkpoint(tmp_path / "hf", "mixtral")
    with pytest.raises(BackendError, match="mmap_experts=true needs a GGUF file"):
        _load(hf_dir, "true")
    assert _load(hf_dir, "auto").options.extra["mmap_experts"] == "false"
    backend = load_plugins().choose_backend("candle-compat")
    with pytest.raises(BackendError, match=r"no backend options \(got threads\) other than mmap_experts"):
        backend.load(open_checkpoint(hf_dir), LoadOptions(extra={"threads": 2}))


def test_mmap_experts_true_on_a_dense_model_is_refused_by_name(tmp_path) -> None:
    from _family_checkpoints import write_family_checkpoint

    hf_dir = write_family_checkpoint(tmp_path / "dense", "mistral")
    with pytest.raises(BackendError, match=r"mmap_experts=true but .* is not a mixture of experts"):
        _load(hf_dir, "true")
