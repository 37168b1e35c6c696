"""Builds the native CPU kernels at install (metadata lives in pyproject.toml).

One shared library, ``ruvllm_jax/native/_cpu_kernels*.so``: the XLA FFI handlers (``cpu_ffi.cc``), the
choice of variant (``cpu_isa.cc``) and the thread pool (``cpu_pool.cc``) for the architecture's
baseline, plus ``cpu_kernels_variant.cc`` (with the ISA bodies it includes) once per ISA variant with
that variant's flags (see ``native/variants.py``); the library picks a variant at run time. The
extension is optional: where no C++ compiler is found the package installs without it, and the backend
runs its XLA formulations and says why in its load log. A variant the compiler cannot build (too old for
``-mavxvnni``, say) is left out with a warning. ``RUVLLM_NATIVE_REQUIRED=1`` makes a failed build fail
the install (the test suite sets it, so a kernel that stops compiling cannot pass unnoticed).
"""

from __future__ import annotations

import os
import platform
import runpy
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = Path("src/ruvllm_jax/native")
KERNELS = runpy.run_path(str(NATIVE / "variants.py"))
#: Compiled once, for the architecture's baseline.
BASELINE_SOURCES = ("cpu_ffi.cc", "cpu_isa.cc", "cpu_pool.cc", "cpu_repack.cc")


def _ffi_include_dir() -> str:
    # jax.ffi.include_dir() without importing jax (the build environment holds jaxlib only).
    import jaxlib

    return str(Path(jaxlib.__file__).parent / "include")


class BuildNative(build_ext):
    def build_extension(self, ext: Extension) -> None:
        machine = KERNELS["normalise_machine"](os.environ.get("RUVLLM_TARGET_MACHINE") or platform.machine())
        if machine is None:
            self.warn(f"ruvllm native kernels: no variants for machine {platform.machine()}; not built")
            return
        include = [_ffi_include_dir(), str(NATIVE)]
        common = list(KERNELS["COMMON_FLAGS"])
        tmp = Path(self.build_temp) / "ruvllm_native"

        def compile_one(sym: str | None, flags: list[str], src: str = "cpu_kernels_variant.cc") -> list[str]:
            macros = [] if sym is None else [("RUVLLM_VARIANT", sym)]
            return self.compiler.compile(
                [str(NATIVE / src)],
                output_dir=str(tmp / (sym or "baseline")),
                macros=macros,
                include_dirs=include,
                extra_postargs=[*common, *flags],
            )

        variants = KERNELS["VARIANTS"][machine]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            baseline = [pool.submit(compile_one, None, [], src) for src in BASELINE_SOURCES]
            jobs = {sym: pool.submit(compile_one, sym, flags) for sym, flags in variants.items()}
            objects = [obj for job in baseline for obj in job.result()]
            for sym, job in jobs.items():
                try:
                    objects += job.result()
                except Exception as exc:  # an older compiler without this ISA's flags
                    if sym == "scalar":
                        raise
                    self.warn(f"ruvllm native kernels: variant {sym} not built ({exc})")
        self.compiler.link_shared_object(
            objects,
            self.get_ext_fullpath(ext.name),
            extra_postargs=["-s"],
            target_lang="c++",
        )


REQUIRED = os.environ.get("RUVLLM_NATIVE_REQUIRED", "0").lower() in ("1", "true", "yes")

setup(
    ext_modules=[Extension("ruvllm_jax.native._cpu_kernels", sources=[], optional=not REQUIRED)],
    cmdclass={"build_ext": BuildNative},
)
