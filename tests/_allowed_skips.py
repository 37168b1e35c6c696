"""The skips CI accepts, each with why: everything else a CI run skips turns the session red
(tests/_skip_check.py). A skip belongs here only when CI cannot remove its cause: the machine's
CPU, kernel or tools, never a package the test session installs or a file it builds.

Each pattern is searched (``re.search``) in the reason pytest reports, without its "Skipped: " prefix.
"""

from __future__ import annotations

ALLOWED_SKIPS: dict[str, str] = {
    # tests/test_cpu_kernel_variants.py: a variant runs only where the CPU has its instructions
    # (on an AVX2-only runner the AVX-512 and AVX-VNNI variants skip).
    r"^this CPU cannot run \S+ \(it runs ": "the runner's CPU lacks that ISA",
    # tests/test_gemma3_model.py, test_hybrid_kv.py, test_bench_kernels_script.py: a CPU with no
    # vector variant at all runs the scalar kernels only.
    r"^no vector kernel variant on this CPU": "the runner's CPU has no vector ISA the kernels use",
    r"^the native kernels run w8a8 only on a vector path$": "the runner's CPU has no vector ISA the kernels use",
    r"^this CPU runs no vector variant$": "the runner's CPU has no vector ISA the kernels use",
    # tests/test_cpu_kernels_cross.py: .ci/run installs g++-aarch64-linux-gnu and qemu-user where it
    # can (apt-get); where it cannot, it says so and these skip. qemu's `-cpu max` gained AVX-VNNI
    # only in recent releases (7.2 lacks it).
    r"^(aarch64-linux-gnu-g\+\+|qemu-aarch64)(, qemu-aarch64)? not found": "the cross tools could not be installed",
    r"^needs an x86-64 host and qemu-x86_64": "qemu-user could not be installed (or the host is not x86-64)",
    r"^qemu-x86_64 version .*: -cpu max has no AVX-VNNI": "the runner's qemu predates AVX-VNNI",
    # tests/test_host_memory.py: collapsing pages into huge pages is up to the kernel (Linux 6.1+,
    # transparent huge pages enabled, MADV_COLLAPSE allowed in the runner's container).
    r"^this kernel does not collapse huge pages here": "the runner's kernel refuses MADV_COLLAPSE",
    r"^transparent huge pages are Linux's$": "a runner that is not Linux",
}
