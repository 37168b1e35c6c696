"""First light: the bundled SmolLM2 answers through the CLI, and requests never share state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruvllm", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RUVLLM_LOG": "ERROR"},
    )


def test_generate_knows_the_capital_of_france(smollm2_path: Path) -> None:
    proc = run_cli(
        "generate", "smollm2", "The capital of France is", "--max-tokens", "8", "--temperature", "0",
        "--backend", "candle-compat",
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_chat_template_answer_to_two_plus_two(smollm2_path: Path) -> None:
    proc = run_cli(
        "chat", "smollm2", "--temperature", "0", "--max-tokens", "24", "--backend", "candle-compat",
        stdin="What is 2+2?\n/quit\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert "4" in proc.stdout


def test_chat_commands(smollm2_path: Path) -> None:
    proc = run_cli(
        "chat", "smollm2", "--backend", "candle-compat",
        stdin="/help\n/temp 5\n/temp 0\n/system Answer briefly.\n/clear\n/bogus\n/quit\n",
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "/system TEXT" in out
    assert "usage: /temp VALUE" in out
    assert "temperature = 0.0" in out
    assert "system prompt set" in out
    assert "conversation cleared" in out
    assert "unknown command /bogus" in out


@pytest.fixture(scope="module")
def smollm2_numpy(smollm2_path: Path):
    from ruvllm.runtime import load_model

    return load_model("smollm2", backend="candle-compat")


def _greedy(engine, model, prompt: str, n: int = 12) -> list[int]:
    from ruvllm.engine import GenerationRequest
    from ruvllm.sampling import SamplingParams

    req = GenerationRequest(model.tokenizer.encode(prompt), SamplingParams(max_tokens=n, temperature=0.0))
    ids: list[int] = []
    for out in engine.stream(req):
        for d in out.deltas:
            ids.extend(d.token_ids)
    return ids


def test_requests_back_to_back_equal_each_alone(smollm2_numpy) -> None:
    """RuvLLM's engine leaked KV state from one request into the next; here reused blocks must not."""
    from ruvllm.engine import EngineConfig, LLMEngine

    a, b = "Once upon a time, in a small village,", "def fibonacci(n):"
    # A tiny cache forces the second request onto the very blocks the first one wrote.
    shared = LLMEngine(smollm2_numpy, EngineConfig(num_blocks=8, block_size=16, enable_prefix_caching=False))
    a_then = _greedy(shared, smollm2_numpy, a)
    b_after_a = _greedy(shared, smollm2_numpy, b)
    b_alone = _greedy(LLMEngine(smollm2_numpy, EngineConfig(num_blocks=8, block_size=16)), smollm2_numpy, b)
    a_alone = _greedy(LLMEngine(smollm2_numpy, EngineConfig(num_blocks=8, block_size=16)), smollm2_numpy, a)
    assert b_after_a == b_alone
    assert a_then == a_alone
    assert a_alone != b_alone
