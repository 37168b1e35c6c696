"""On CI a skip not in tests/_allowed_skips.py fails the run (tests/_skip_check.py): checked on tiny
test files run by a pytest of their own, and the allow-list on the reasons the suite's skips give."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _skip_check import is_allowed

TESTS = Path(__file__).parent

EXPECTED_ONLY = """
import pytest

def test_runs():
    pass

def test_the_cpu_lacks_an_isa():
    pytest.skip("this CPU cannot run avx512_vnni (it runs scalar, avx2)")

@pytest.mark.xfail(reason="an expected failure is not a skip", strict=True)
def test_expected_failure():
    raise AssertionError
"""
UNEXPECTED_IN_A_TEST = """
import pytest

def test_runs():
    pass

def test_quietly_gone():
    pytest.skip("the fixture file was not built")
"""
UNEXPECTED_AT_COLLECTION = """
import pytest

pytest.importorskip("a_module_nobody_installed")

def test_never_collected():
    pass
"""


def run_pytest(tmp_path: Path, files: dict[str, str], ci: str | None) -> subprocess.CompletedProcess[str]:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the repository's configuration
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH")) if p)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "_skip_check", "-p", "no:cacheprovider", "-q", *sorted(files)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_allowed_skips_and_expected_failures_keep_ci_green(tmp_path):
    proc = run_pytest(tmp_path, {"test_expected.py": EXPECTED_ONLY}, ci="true")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 1 skipped, 1 xfailed" in proc.stdout
    assert "unexpected skip" not in proc.stdout


def test_an_unexpected_skip_fails_ci_and_is_named(tmp_path):
    files = {"test_in_a_test.py": UNEXPECTED_IN_A_TEST, "test_at_collection.py": UNEXPECTED_AT_COLLECTION}
    proc = run_pytest(tmp_path, files, ci="true")
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout + proc.stderr
    assert "2 unexpected skip(s) on CI" in proc.stdout
    assert "test_in_a_test.py::test_quietly_gone: the fixture file was not built" in proc.stdout
    assert "test_at_collection.py: could not import 'a_module_nobody_installed'" in proc.stdout


def test_outside_ci_a_skip_is_only_a_skip(tmp_path):
    for ci in (None, "false"):
        proc = run_pytest(tmp_path, {"test_in_a_test.py": UNEXPECTED_IN_A_TEST}, ci=ci)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "unexpected skip" not in proc.stdout


@pytest.mark.parametrize(
    "reason",
    [
        "this CPU cannot run avxvnni (it runs scalar, avx2)",
        "no vector kernel variant on this CPU: auto keeps float32",
        "the native kernels run w8a8 only on a vector path",
        "this CPU runs no vector variant",
        "aarch64-linux-gnu-g++, qemu-aarch64 not found (apt-get install -y g++-aarch64-linux-gnu qemu-user)",
        "qemu-aarch64 not found (apt-get install -y g++-aarch64-linux-gnu qemu-user)",
        "needs an x86-64 host and qemu-x86_64 (apt-get install -y g++-aarch64-linux-gnu qemu-user)",
        "qemu-x86_64 version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3): -cpu max has no AVX-VNNI (it runs scalar,avx2)",
        "this kernel does not collapse huge pages here: MADV_COLLAPSE: EINVAL",
        "transparent huge pages are Linux's",
    ],
)
def test_reasons_the_allow_list_accepts(reason):
    assert is_allowed(reason)


@pytest.mark.parametrize(
    "reason",
    [
        "native kernels not built",  # the nox session builds them (RUVLLM_NATIVE_REQUIRED=1)
        "needs jax-cuda12-plugin (jax's version) on a path of its own",  # the nox session installs it
        "could not import 'peft': No module named 'peft'",
        "the test session installs tests/plugins/ruvllm-example-plugin (nox -s tests)",
        "not a git checkout",  # CI runs in a clone
        "curl is not installed",
        "no g++ or no kernel variants for x86_64",
        "model 'smollm2' not found",
    ],
)
def test_reasons_the_allow_list_refuses(reason):
    assert not is_allowed(reason)
