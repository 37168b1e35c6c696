"""Every ISA variant of the native CPU kernels against the scalar one, at the kernel level, no XLA.

``tests/native/kernel_check.cc`` links the variant objects of one architecture (``cpu_kernels_variant.cc``
compiled once per variant with the flags of ``ruvllm_jax/native/variants.py``, loaded by path, so this
does not depend on how the package was built), quantizes activations as ``cpu_acts.h`` does and checks
each variant the CPU runs: bit for bit where the kernels promise it, within rounding for the row-major
group kernel and decode attention. It runs natively, which also proves the harness, and for aarch64
cross-compiled (``aarch64-linux-gnu-g++ -static``) under ``qemu-aarch64 -cpu max``, whose CPU has every
NEON variant's instructions (dotprod, i8mm). The VEX-encoded ``avxvnni`` build runs where the CPU has
AVX-VNNI, or under ``qemu-x86_64 -cpu max`` once qemu executes it (Debian 12's qemu 7.2 does not).
"""

from __future__ import annotations

import os
import platform
import runpy
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "packages/ruvllm-backend-jax/src/ruvllm_jax/native"
HARNESS = ROOT / "tests/native/kernel_check.cc"
KERNELS = runpy.run_path(str(NATIVE / "variants.py"))
KERNEL_NAMES = (
    "quantize_groups", "w8a8_rows", "group_rows", "panel_rows", "kpanel_rows", "decode", "prefill", "lora_rows",
)  # fmt: skip
INSTALL = "apt-get install -y g++-aarch64-linux-gnu qemu-user"
MACHINE = KERNELS["normalise_machine"](platform.machine())
pytestmark = pytest.mark.slow  # compiling every variant and running them under qemu: about a minute


def _cc(args: list[str]) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stderr[-4000:]}"


def _build(cxx: str, machine: str, out: Path, link: tuple[str, ...] = ()) -> Path:
    """Every variant of ``machine`` and the harness, compiled in parallel and linked into one program."""
    jobs = [
        [cxx, *KERNELS["COMMON_FLAGS"], *flags, f"-DRUVLLM_VARIANT={sym}", "-c",
         str(NATIVE / "cpu_kernels_variant.cc"), "-o", str(out / f"{sym}.o")]
        for sym, flags in KERNELS["VARIANTS"][machine].items()
    ]
    jobs.append([cxx, "-O2", "-std=c++17", "-ffp-contract=off", f"-I{NATIVE}", "-c", str(HARNESS),
                 "-o", str(out / "kernel_check.o")])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(_cc, jobs))
    exe = out / "kernel_check"
    _cc([cxx, *(job[-1] for job in jobs), *link, "-o", str(exe)])
    return exe


def _run(cmd: list[str]) -> dict[tuple[str, str], str]:
    """(variant, kernel) -> PASS / FAIL / SKIP / MISSING; asserts the harness found no failure."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {(v, k): status for v, k, status, *_ in (line.split() for line in proc.stdout.splitlines())}


def _assert_pass(results: dict[tuple[str, str], str], variants: list[str]) -> None:
    assert results[("scalar", "quantize_groups")] == "PASS"
    for v in variants:
        assert [results.get((v, k)) for k in KERNEL_NAMES] == ["PASS"] * len(KERNEL_NAMES), (v, results)


@pytest.fixture(scope="module")
def native_harness(tmp_path_factory) -> Path:
    if MACHINE is None or shutil.which("g++") is None:
        pytest.skip(f"no g++ or no kernel variants for {platform.machine()}")
    return _build("g++", MACHINE, tmp_path_factory.mktemp("native"))


def test_native_variants_match_scalar(native_harness):
    results = _run([str(native_harness)])
    runs = subprocess.run([str(native_harness), "--list"], capture_output=True, text=True).stdout.split()[0]
    _assert_pass(results, [v for v in runs.split(",") if v != "scalar"])
    assert {v for v, _ in results} == set(KERNELS["VARIANTS"][MACHINE])  # every variant linked and reported


def test_neon_variants_match_scalar_under_qemu(tmp_path):
    missing = [tool for tool in ("aarch64-linux-gnu-g++", "qemu-aarch64") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not found ({INSTALL})")
    exe = _build("aarch64-linux-gnu-g++", "aarch64", tmp_path, ("-static",))
    results = _run(["qemu-aarch64", "-cpu", "max", str(exe)])
    _assert_pass(results, ["neon", "neon_dotprod", "neon_i8mm"])


def test_avxvnni_under_qemu(native_harness):
    if MACHINE != "x86_64" or shutil.which("qemu-x86_64") is None:
        pytest.skip(f"needs an x86-64 host and qemu-x86_64 ({INSTALL})")
    qemu = ["qemu-x86_64", "-cpu", "max", str(native_harness)]
    runs = subprocess.run([*qemu, "--list"], capture_output=True, text=True).stdout.split()[0].split(",")
    if "avxvnni" not in runs:
        version = subprocess.run(["qemu-x86_64", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
        pytest.skip(f"{version}: -cpu max has no AVX-VNNI (it runs {','.join(runs)})")
    _assert_pass(_run(qemu), ["avxvnni"])
