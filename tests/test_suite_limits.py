"""The suite's configuration (pytest.ini) does what it says: a hung test stops the run with every
thread's stack, `-m "not slow"` leaves the slow tests out, and a misspelt marker is an error rather
than a test that silently never gets selected. Checked on tiny test files under the real ini."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_pytest(tmp_path: Path, text: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_tiny.py").write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    config = ["-c", str(ROOT / "pytest.ini"), "--rootdir", str(tmp_path), "-p", "no:cacheprovider"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", *config, "-q", "test_tiny.py", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_hung_test_stops_the_run_with_the_stacks(tmp_path):
    hangs = "import threading\n\ndef test_hangs():\n    threading.Event().wait()\n"
    start = time.monotonic()
    proc = run_pytest(tmp_path, hangs, "-o", "timeout=2")  # the ini's method, a shorter limit
    assert time.monotonic() - start < 60
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "Timeout" in out and "test_hangs" in out, out  # the stack of the hung test is shown


def test_not_slow_leaves_out_the_slow_tests(tmp_path):
    tests = "import pytest\n\n@pytest.mark.slow\ndef test_slow():\n    pass\n\ndef test_quick():\n    pass\n"
    proc = run_pytest(tmp_path, tests, "-m", "not slow")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 1 deselected" in proc.stdout


def test_a_misspelt_marker_is_an_error(tmp_path):
    proc = run_pytest(tmp_path, "import pytest\n\n@pytest.mark.slwo\ndef test_x():\n    pass\n")
    assert proc.returncode != 0
    assert "'slwo' not found in `markers`" in proc.stdout + proc.stderr
