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


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bench_gpu_runs_the_weight_forms_and_forced_decode_splits_interpreted(tmp_path):
    """The lease's splits and forms parts at tiny sizes: bf16, q8 and fp8 weights made and rounded on
    the device, a run with the Pallas decode kernel's parts forced (interpreted) and speculation's
    5-token verification steps, each row with its own weight bytes and the parts its decode steps
    ran with."""
    out = tmp_path / "bench.json"
    args = ["--interpret", "--dtypes", "float32", "--attn-shapes", "--no-peer", "--attentions", "pallas"]
    args += ["--quantizations", "none", "q8", "fp8", "q8-channel", "--model-decode-splits", "auto", "2"]
    args += ["--verify-tokens", "5"]
    args += ["--json", str(out)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["engine"], r["batch"]): r for r in json.loads(out.read_text())["model"]}
    forms = ("", " q8", " fp8", " q8-channel", " splits 2", " verify 5")  # verification: the first form
    assert set(rows) == {(f"ruvllm pallas_interpret{f}", b) for f in forms for b in (1, 4)}
    assert all(not r["skipped"] and r["tok_s"] > 0 and r["floor_ms"] > 0 for r in rows.values())
    # auto keeps one part on a CPU; the forced run split every decode step
    assert {r["decode_splits"] for (e, _), r in rows.items() if "splits" not in e and "verify" not in e} == {1}
    assert {r["decode_splits"] for (e, _), r in rows.items() if "splits" in e} == {2}
    full, q8, fp8 = (rows[(f"ruvllm pallas_interpret{f}", 1)]["weight_bytes"] for f in ("", " q8", " fp8"))
    channel = rows[("ruvllm pallas_interpret q8-channel", 1)]["weight_bytes"]
    assert fp8 == channel < q8 < 0.6 * full  # 1 byte a weight (+ scales) against bfloat16's 2


def test_gpu_lease_parts_pass_bench_gpu_valid_arguments(tmp_path):
    """gpu_lease.sh's default parts on a machine without a GPU: every bench_gpu.py call it makes parses
    its arguments (a typo would cost a lease's run) and says it measured nothing; a log per part."""
    lease = SCRIPT.parent / "gpu_lease.sh"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "OUT": str(tmp_path),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    proc = subprocess.run(
        ["bash", str(lease)], capture_output=True, text=True, timeout=600, env=env, cwd=SCRIPT.parents[1]
    )
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("done"), proc.stdout[-3000:]
    logs = {p.name: p.read_text() for p in tmp_path.glob("*.log")}
    assert set(logs) == {"splits.log", "forms_b1.log", "forms_b256.log"}
    assert all("no CUDA device found" in text and "error:" not in text for text in logs.values()), logs


def test_gpu_lease_invariant_part_runs_on_the_cpu(tmp_path, smollm2_path):
    """The lease's invariant part (not default) at tiny sizes on this CPU's XLA path: both processes
    (without and with --batch-invariant) report, and no answer changed with the option."""
    lease = SCRIPT.parent / "gpu_lease.sh"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "OUT": str(tmp_path),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PARTS": "invariant",
        "INV_MODEL": str(smollm2_path),
        "INV_PROMPTS": "3",
        "INV_TOKENS": "4",
        "INV_BATCHES": "2",
        "INV_SEQS": "2",
        "INV_STEP_TOKENS": "16",
        "INV_DECODE_TOKENS": "4",
    }
    proc = subprocess.run(
        ["bash", str(lease)], capture_output=True, text=True, timeout=600, env=env, cwd=SCRIPT.parents[1]
    )
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("done"), proc.stdout[-3000:]
    off, on = (json.loads((tmp_path / f"invariant_{m}.json").read_text()) for m in ("off", "on"))
    assert (off["batch_invariant"], on["batch_invariant"]) == (False, True)
    assert on["extra"] == {"batch_invariant": "true"} and on["changed"] == [] and on["prompts"] == 3
    assert all(r["decode_tok_s"]["2"] > 0 for r in (off, on))
