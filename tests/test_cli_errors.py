"""Bad input on the command line: one line naming the cause on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _gguf_files import write_tiny_llama_gguf


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "RUVLLM_LOG": "ERROR", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ruvllm", *args], capture_output=True, text=True, timeout=300, env=full_env
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle.lower() in lines[0].lower(), lines[0]


def test_missing_model_file(tmp_path: Path) -> None:
    proc = run_cli("generate", str(tmp_path / "nope.gguf"), "hi", "--backend", "candle-compat")
    assert_one_line_error(proc, "not found")


def test_offline_hub_repo_not_cached(tmp_path: Path) -> None:
    proc = run_cli("info", "someorg/some-model", "--cache-dir", str(tmp_path))
    assert_one_line_error(proc, "not in the cache", "ruvllm download someorg/some-model")


def test_truncated_gguf(tmp_path: Path, smollm2_path: Path) -> None:
    bad = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as src:
        bad.write_bytes(src.read(3_000_000))
    proc = run_cli("generate", str(bad), "hi", "--backend", "candle-compat", "--max-tokens", "2")
    assert_one_line_error(proc, str(bad))


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    proc = run_cli("generate", str(bad), "hi", "--backend", "candle-compat")
    assert_one_line_error(proc, "gguf")


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_text("hello, I am a text file")
    proc = run_cli("info", str(bad))
    assert_one_line_error(proc, "not a gguf file")


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_tiny_llama_gguf(tmp_path / "mamba.gguf", arch="mamba")
    proc = run_cli("generate", str(path), "hi", "--backend", "candle-compat")
    assert_one_line_error(proc, "architecture", "mamba")


def test_unknown_quantization_type(tmp_path: Path) -> None:
    path = write_tiny_llama_gguf(tmp_path / "iq2.gguf", weight_type="IQ2_XXS")
    proc = run_cli("generate", str(path), "hi", "--backend", "candle-compat")
    assert_one_line_error(proc, "IQ2_XXS")


def test_unknown_backend(smollm2_path: Path) -> None:
    proc = run_cli("generate", "smollm2", "hi", "--backend", "no-such-backend")
    assert_one_line_error(proc, "unknown backend", "no-such-backend")


@pytest.mark.parametrize("flag,value", [("--temperature", "-1"), ("--top-p", "0"), ("--max-tokens", "0")])
def test_bad_sampling_values(flag: str, value: str, smollm2_path: Path) -> None:
    proc = run_cli("generate", "smollm2", "hi", "--backend", "candle-compat", flag, value)
    assert_one_line_error(proc, flag.lstrip("-").replace("-", "_"))


def test_threads_on_a_backend_that_cannot_apply_them() -> None:
    """candle-compat's BLAS fixes its threads at import: ``--threads`` is refused, not ignored."""
    proc = run_cli("generate", "smollm2", "hi", "--backend", "candle-compat", "--threads", "2", "--max-tokens", "1")
    assert_one_line_error(proc, "candle-compat takes no backend options (got threads)", "OPENBLAS_NUM_THREADS")


def test_dtype_a_backend_cannot_run_or_that_does_not_exist(tmp_path: Path) -> None:
    """``--dtype`` reaches the backend: one it cannot run is refused by name; an unknown one (from
    ``RUVLLM_DTYPE``, which argparse does not check) before anything loads."""
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    proc = run_cli("generate", str(path), "hi", "--backend", "candle-compat", "--dtype", "bfloat16")
    assert_one_line_error(proc, "float32 only", "bfloat16")
    proc = run_cli("generate", str(path), "hi", "--backend", "candle-compat", env={"RUVLLM_DTYPE": "fp8"})
    assert_one_line_error(proc, "unknown dtype 'fp8'")
    proc = run_cli("generate", str(path), "hi", "--dtype", "fp8")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
