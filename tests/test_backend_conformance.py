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
    from ruvllm.adapters import LoraWeights

    monkeypatch.setattr(LoraWeights, "delta", lambda self, layer, proj, x: None)
    with pytest.raises(AssertionError, match="adapters"):
        run_backend_conformance("candle-compat", tmp_path, checks=["adapters"])


def test_a_third_party_backend_passes_the_kit_and_serves_chat(tmp_path, smollm2_path):
    """tests/plugins/ruvllm-backend-float64, written from docs/writing-a-backend.md alone, installed
    by the test session: found through its entry point, conformant, and it serves a chat completion
    through ``ruvllm serve --backend float64``."""
    import subprocess
    import sys

    import httpx
    from _server_fixtures import free_port, wait_until_ready

    from ruvllm.plugins import load_plugins

    host = load_plugins()
    assert "float64" in host.backends and host.pm.has_plugin("float64")
    assert run_backend_conformance("float64", tmp_path, atol=1e-5) == list(CHECKS)
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ruvllm", "serve", str(smollm2_path), "--served-model-name", "smollm2",
             "--backend", "float64", "--port", str(port), "--num-kv-blocks", "32"],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_ready(base, proc, log, 300)
        r = httpx.post(
            base + "/v1/chat/completions",
            json={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=60)
