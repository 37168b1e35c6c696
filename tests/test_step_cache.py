"""Compiled forward steps kept on disk (ruvllm_jax.step_cache): a later load of the same model runs
the program stored by an earlier one without tracing ``forward_step`` again, and computes the same
logits bit for bit; another step shape is not found under the first's key; a damaged entry is
compiled again and rewritten; a directory that cannot be written leaves the load working; the key
follows what changes a program (XLA's flags)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _gguf_files import write_tiny_llama_gguf
from _jax_fixtures import load_jax
from _kquant_files import requantize_gguf
from structlog.testing import capture_logs

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm_jax import compiled_steps, native, step_cache

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")

PROMPT = np.array([5, 77, 200, 13, 9, 31, 250, 4, 120, 66, 18], np.int32)


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory):
    d = tmp_path_factory.mktemp("step-cache")
    return requantize_gguf(write_tiny_llama_gguf(d / "f32.gguf", hidden=256, layers=2), d / "q4_k_m.gguf")


def _logits(model, prompt=PROMPT) -> np.ndarray:
    chunk = SequenceChunk(prompt, 0, np.arange(-(-len(prompt) // 16), dtype=np.int32), all_logits=True)
    return np.asarray(model.forward(ForwardBatch([chunk], 16), model.allocate_cache(4, 16)).all_logits[0])


def _no_tracing(*args, **kwargs):
    raise AssertionError("forward_step traced: the step was not loaded from the cache")


def test_a_later_load_runs_the_stored_step_without_tracing(tiny_q4_k_m, tmp_path, monkeypatch):
    monkeypatch.setenv("RUVLLM_JAX_STEP_CACHE", str(tmp_path / "steps"))
    want = _logits(load_jax(open_checkpoint(tiny_q4_k_m), quantization="w4a8"))
    entries = list((tmp_path / "steps").glob("*.step"))
    assert entries
    monkeypatch.setattr(compiled_steps, "forward_step", _no_tracing)
    again = load_jax(open_checkpoint(tiny_q4_k_m), quantization="w4a8")
    np.testing.assert_array_equal(_logits(again), want)
    # Another shape (a longer prompt) is another key: it would have to be traced.
    with pytest.raises(AssertionError, match="forward_step traced"):
        _logits(again, np.concatenate([PROMPT, PROMPT, PROMPT]))


def test_a_damaged_entry_is_compiled_again_and_rewritten(tiny_q4_k_m, tmp_path, monkeypatch):
    monkeypatch.setenv("RUVLLM_JAX_STEP_CACHE", str(tmp_path / "steps"))
    want = _logits(load_jax(open_checkpoint(tiny_q4_k_m), quantization="w4a8"))
    sizes = {}
    for entry in (tmp_path / "steps").glob("*.step"):
        sizes[entry.name] = entry.stat().st_size
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 3])
    with capture_logs() as logs:
        got = _logits(load_jax(open_checkpoint(tiny_q4_k_m), quantization="w4a8"))
    np.testing.assert_array_equal(got, want)
    assert any(e["event"].startswith("compiled step entry unreadable") for e in logs)
    assert {e.name: e.stat().st_size for e in (tmp_path / "steps").glob("*.step")} == sizes


def test_an_unwritable_directory_leaves_the_load_working(tiny_q4_k_m, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory would be")
    monkeypatch.setenv("RUVLLM_JAX_STEP_CACHE", str(blocked / "steps"))
    monkeypatch.setattr(step_cache, "_warned", set())
    with capture_logs() as logs:
        got = _logits(load_jax(open_checkpoint(tiny_q4_k_m), quantization="w4a8"))
    assert np.isfinite(got).all()
    assert any(e["event"] == "compiled steps not kept on disk" for e in logs)


def test_the_key_follows_xla_flags_and_the_off_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("RUVLLM_JAX_STEP_CACHE", str(tmp_path))
    args = (np.zeros((4, 8), np.float32),)
    step_cache._host.cache_clear()
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    plain = step_cache.step_key("spec", "plan", args)
    step_cache._host.cache_clear()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")
    flagged = step_cache.step_key("spec", "plan", args)
    step_cache._host.cache_clear()
    assert plain and flagged and plain != flagged
    assert step_cache.step_key("spec", "plan", (np.zeros((4, 9), np.float32),)) != flagged  # another shape
    monkeypatch.setenv("RUVLLM_JAX_STEP_CACHE", "off")
    assert step_cache.step_key("spec", "plan", args) is None
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX2"
