"""The ISA variants of the native CPU kernels and the compiler flags each is built with.

Plain data, read by the package's ``setup.py`` at build time (it is loaded by path, so it imports
nothing) and by the tests that cross-compile the kernels. ``cpu_kernels_variant.cc`` is compiled once
per variant with these flags and ``-DRUVLLM_VARIANT=<symbol>`` (it includes the one ISA body the flags
choose: ``cpu_kernels_avx512.inc``, ``cpu_kernels_avx2.inc`` or ``cpu_kernels_neon.inc``); the rest of
the library (``cpu_ffi.cc``, ``cpu_isa.cc``, ``cpu_pool.cc``) is compiled for the architecture's
baseline and picks a variant at run time. No variant uses ``-march=native``: a library built on one
machine runs on every machine of its architecture.
"""

from __future__ import annotations

#: Flags common to every object of the library. ``-ffp-contract=off``: the kernels' float operations
#: are written out (explicit FMAs), so every variant rounds the same way.
COMMON_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fno-math-errno", "-ffp-contract=off", "-fopenmp-simd", "-g0"]

_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]

#: symbol -> flags, per architecture (``platform.machine()`` normalised to x86_64 / aarch64).
VARIANTS: dict[str, dict[str, list[str]]] = {
    "x86_64": {
        "scalar": [],
        "avx2": _AVX2,
        "avxvnni": [*_AVX2, "-mavxvnni"],
        # The avxvnni code at 256 bits, EVEX-encoded: runs on AVX-512 VNNI CPUs without AVX-VNNI.
        "avxvnni_evex": [*_AVX512, "-DRUVLLM_WIDTH_256", "-mprefer-vector-width=256"],
        "avx512vnni": _AVX512,
    },
    "aarch64": {
        "scalar": [],
        "neon": ["-march=armv8-a"],
        "neon_dotprod": ["-march=armv8.2-a+dotprod"],
        "neon_i8mm": ["-march=armv8.2-a+dotprod+i8mm"],
    },
}


def normalise_machine(machine: str) -> str | None:
    m = machine.lower()
    if m in ("x86_64", "amd64"):
        return "x86_64"
    if m in ("aarch64", "arm64"):
        return "aarch64"
    return None
