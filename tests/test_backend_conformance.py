"""Both built-in backends pass the conformance kit third-party backends run (ruvllm.testing), and the
kit catches a backend that gets something wrong."""

from __future__ import annotations

import pytest

import ruvllm.testing as kit
from ruvllm.testing import CHECKS, run_backend_conformance


@pytest.mark.parametrize("backend", ["candle-compat", "jax"])
def test_builtin_backends_conform(backend, tmp_path):
    assert run_backend_conformance(backend, tmp_path) == list(CHECKS)


def test_the_kit_catches_skipped_block_copies(tmp_path, monkeypatch):
    original = kit._Runner.step
    # A backend that ignores the step's block copies computes what this step computes.
    monkeypatch.setattr(kit._Runner, "step", lambda self, cache, chunks, copies=None: original(self, cache, chunks))
    with pytest.raises(AssertionError, match="block_copies"):
        run_backend_conformance("candle-compat", tmp_path, checks=["block_copies"])


def test_the_kit_catches_a_wrong_adapter(tmp_path, monkeypatch):
    # An adapter the backend never applies: the LoRA check must see it.
    monkeypatch.setattr(kit._Lora, "delta", lambda self, layer, proj, x: None)
    with pytest.raises(AssertionError, match="adapters"):
        run_backend_conformance("candle-compat", tmp_path, checks=["adapters"])
