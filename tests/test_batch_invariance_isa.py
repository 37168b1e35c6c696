"""The quantized forms' batch invariance (the conformance kit's ``quantized_batch_invariance``: a
sequence's logits and hidden states bit for bit the same alone and beside others, prompt and decode,
``w8a8`` and ``w4a8``) under every ISA variant of the native kernels this CPU runs and under the XLA
code generation other CPUs get.

An order that follows the CPU shows only on a CPU that takes it: w8a8 once failed the suite on an
Intel Xeon and passed on an AMD EPYC (issue 61). XLA compiles the step's own operations for the host,
so its vector width differs between them (512 bits where the host prefers it, 256 on an AVX2-only
CPU), and an operation whose vector loop and scalar remainder round differently (``rsqrt``) gave a
row a result that depended on where the step's row count put it. Here each XLA setting runs in a
process of its own (XLA reads its flags once), and each supported kernel variant is forced in turn
inside it, with an odd thread count for the kernels' work split.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ruvllm_jax import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")

#: XLA's CPU code generation as the host would pick it, as a CPU preferring 512-bit vectors (Intel
#: Xeons with AVX-512, AMD Zen 4 and 5) and as an AVX2-only CPU (AMD Zen 3) would.
XLA_SETTINGS = {
    "host": "",
    "512-bit vectors": "--xla_cpu_prefer_vector_width=512",
    "AVX2 only": "--xla_cpu_max_isa=AVX2",
}

_CHILD = """
import json, sys, tempfile
from pathlib import Path
from ruvllm.testing import run_backend_conformance
from ruvllm_jax import native

results = {}
for isa in native.supported_isas():
    with native.use_isa(isa):
        try:
            run_backend_conformance("jax", Path(tempfile.mkdtemp()), checks=["quantized_batch_invariance"])
            results[isa] = "ok"
        except AssertionError as exc:
            results[isa] = str(exc)
print("RESULTS " + json.dumps(results))
"""


@pytest.mark.timeout(400)
@pytest.mark.parametrize("setting", list(XLA_SETTINGS))
def test_quantized_forms_are_batch_invariant_under_each_variant_and_xla_setting(setting, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RUVLLM_THREADS": "3", "XLA_FLAGS": XLA_SETTINGS[setting]}
    env["RUVLLM_JAX_COMPILATION_CACHE"] = "off"  # a program compiled under other flags is not reused
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=380)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    results = json.loads(lines[-1].removeprefix("RESULTS "))
    assert set(results) == set(native.supported_isas())
    failed = {isa: why for isa, why in results.items() if why != "ok"}
    assert not failed, f"XLA setting {setting!r}: {failed}"
