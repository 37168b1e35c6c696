"""Proof without a GPU that a GPU user's first steps lower (issue 16): the Pallas attention kernels
(float32 and bfloat16, block sizes 8-32, GQA groups 1-8, head dims 64-256) and every step shape of a
tiny Llama and of SmolLM2, with the Pallas kernels and with XLA's attention, and every device-sampling
variant (:mod:`ruvllm_jax.sampling`) for three vocabularies, are lowered for the CUDA
platform on this CPU-only machine (jax-cuda12-plugin of jax's own version provides the GPU lowering
rules; ``nox -s tests`` installs it beside, not into, the test environment). The control: the same
kernel under JAX's default Pallas GPU backend (Mosaic GPU) fails, as it did before the kernels named
the Triton backend, so a check that cannot fail is not what passes here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _jax_fixtures import write_tiny_hf_model

CUDA_PATH = os.environ.get("RUVLLM_CUDA_LOWERING_PATH")
pytestmark = [
    pytest.mark.skipif(
        not CUDA_PATH,
        reason="needs jax-cuda12-plugin (jax's version) on a path of its own: `nox -s tests` installs it into "
        ".nox/cuda-lowering and sets RUVLLM_CUDA_LOWERING_PATH",
    ),
    # Above the lowering subprocess's own limit (1200 s): that limit fails one test alone, with the output.
    pytest.mark.timeout(1500),
]
SCRIPT = Path(__file__).parent / "_cuda_lowering_check.py"


def _run(*args: str) -> list[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (CUDA_PATH, os.environ.get("PYTHONPATH")) if p),
        "JAX_PLATFORMS": "cpu",
        "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
    }
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [ln for ln in proc.stdout.splitlines() if ln.startswith(("ok ", "FAIL "))]


@pytest.mark.slow
def test_the_kernels_and_every_step_shape_lower_for_cuda(tmp_path, smollm2_path):
    tiny = write_tiny_hf_model(tmp_path, "llama")
    lines = _run(str(tiny), str(smollm2_path))
    failed = [ln for ln in lines if ln.startswith("FAIL")]
    assert not failed, "\n".join(failed)
    # every kernel case, both models, the tiny one with decode_splits forced, device sampling at 3 vocabularies
    assert len(lines) == 2 * 3 * 3 + 3 + 3
    assert all(
        "pallas: " in ln and "reference: " in ln
        for ln in lines
        if ln.startswith("ok steps") and "decode_splits" not in ln
    )
    # auto chose split decode steps on a 132-SM GPU's shapes; the forced option split them too
    assert all(", 0 split" not in ln.split("reference:")[0] for ln in lines if ln.startswith("ok steps"))


def test_the_control_fails_under_mosaic_gpu():
    (line,) = _run("--control")
    assert line.startswith("FAIL control") and "shared memory" in line, line
