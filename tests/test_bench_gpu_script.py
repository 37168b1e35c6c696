"""``benchmarks/bench_gpu.py --interpret`` runs every part of the GPU benchmark on this CPU at tiny
sizes (kernels interpreted, a tiny random Llama with device sampling, transformers eager): the script
a GPU lease runs must not first fail there. Its timings mean nothing and are not read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "bench_gpu.py"


@pytest.mark.slow
# Above the subprocess's own limit (900 s): that limit fails this test alone, with the output.
@pytest.mark.timeout(1200)
def test_bench_gpu_runs_every_part_interpreted(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--interpret", "--dtypes", "float32", "--attn-shapes", "llama3-8b", "--json", str(out)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["attention"] and all(r["ok"] for r in doc["attention"])  # the kernels matched jax.numpy
    engines = {(r["engine"], r["batch"]) for r in doc["model"] if not r["skipped"] and r["tok_s"] > 0}
    assert engines == {(e, b) for e in ("ruvllm reference", "transformers") for b in (1, 4)}
    assert "% of floor" in proc.stdout and "/ transformers" in proc.stdout
