"""``benchmarks/bench_kernels.py`` builds this tree's kernels and another commit's (``--base HEAD``:
the committed sources) into one harness and times every shape; its timings are not read here, only
that each build ran each shape and the before/after ratios were formed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_kernels.py"


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("git") is None, reason="needs g++ and git")
def test_bench_kernels_builds_both_trees_and_times_every_shape(tmp_path):
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_kernels
    finally:
        sys.path.pop(0)
    isa = bench_kernels.default_builds()[:1]
    if not isa:
        pytest.skip("this CPU runs no vector variant")
    out = tmp_path / "k.json"
    args = ["--isa", isa[0], "--base", "HEAD", "--rows", "1", "3", "--rounds", "1", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    # Every shape at every row count asked for, up to its own limit (the 168 MB LM head: one row).
    want = {(s[0], m) for s in bench_kernels.SHAPES for m in (1, 3) if s[5] is None or m <= s[5]}
    assert {(r["shape"], r["rows"]) for r in rows} == want
    assert ("q8_0 lm_head 262144x640", 1) in want and ("q8_0 lm_head 262144x640", 3) not in want
    assert all(set(r["us"]) == {isa[0], isa[0] + "_base"} and min(r["us"].values()) > 0 for r in rows)
    assert f"{isa[0]}: median speed-up over HEAD" in proc.stdout

    bad = subprocess.run([sys.executable, str(SCRIPT), "--isa", "mmx"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--isa: mmx" in bad.stderr
