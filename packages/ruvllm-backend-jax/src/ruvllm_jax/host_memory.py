"""How the host's C allocator treats the large buffers a CPU step allocates and frees every step.

XLA on a CPU allocates each step's outputs with the C allocator. glibc serves a request above its
mmap threshold (at most 32 MiB) with a fresh mapping and unmaps it when freed, so a buffer that large
costs fresh, zero-filled pages every step: Gemma-3's logits at 32 sequences are 33.5 MB, 8,192 page
faults a step (10% of the CPU time of a batch-32 decode step, measured with ``perf`` on a 2-core
AMD EPYC). With glibc, the backend turns that off once per process when it loads a model onto CPU
devices (``mallopt``: no mmap for the heap's blocks, and free memory at the heap's top kept up to
1 GiB), so a step reuses the pages the step before freed. The process then keeps its peak heap
rather than handing memory back to the system, as jemalloc or tcmalloc would.

``RUVLLM_JAX_KEEP_HOST_BUFFERS=0`` leaves the allocator as it is. The load log says which applies.
"""

from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30

_state: str | None = None


def keep_large_buffers() -> str:
    """Apply the policy (once per process); returns what applies, for the load log."""
    global _state
    if _state is not None:
        return _state
    if os.environ.get("RUVLLM_JAX_KEEP_HOST_BUFFERS", "1").strip().lower() in ("0", "false", "no", "off"):
        _state = "allocator default (RUVLLM_JAX_KEEP_HOST_BUFFERS=0)"
        return _state
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (mallopt's parameters are glibc's)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        _state = "allocator default (not glibc)"
        return _state
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_off = mallopt(_M_MMAP_MAX, 0) == 1
    trim_raised = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if mmap_off and trim_raised:
        _state = "kept for reuse"
    else:  # say exactly what took effect
        _state = f"partly (mmap off: {mmap_off}, trim threshold raised: {trim_raised})"
    return _state
