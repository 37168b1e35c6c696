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

**Huge pages for the weights** (:func:`huge_pages`). A decode step streams every weight byte from
memory once. On 4 KiB pages that is a TLB miss every 4 KiB (62,000 a step for Gemma-3-270M's 253 MB),
and under a hypervisor each miss walks two page tables. On Linux the backend asks for transparent
huge pages over each weight buffer of a CPU model once it is loaded (``madvise``: ``MADV_HUGEPAGE``,
then ``MADV_COLLAPSE``, Linux 6.1 and later, to move the pages there now rather than whenever
khugepaged gets to them). Only the 2 MiB-aligned interior of a buffer can be a huge page; the rest
stays as it was. It changes no value, only where the bytes sit. Collapsing copies the pages: 0.19 s for
Gemma-3-270M's 224 MB, 3.1 s for a 1 GB buffer on a 2-core VM. ``RUVLLM_JAX_HUGE_PAGES=0`` turns it
off; the load log says how many bytes were collapsed and how long it took, or why none were.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

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


MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE = 1 << 21
_OFF = ("0", "false", "no", "off")
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The system's transparent huge page mode (``always``, ``madvise`` or ``never``), None if unknown."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def buffer_ranges(arrays: Iterable[Any]) -> list[tuple[int, int]]:
    """(start, end) addresses of every CPU buffer behind ``arrays`` (jax arrays, each shard's)."""
    out = []
    for a in arrays:
        if hasattr(a, "block_until_ready"):
            a.block_until_ready()  # a transfer still in flight has not written (faulted in) its pages yet
        for shard in getattr(a, "addressable_shards", ()):
            data = shard.data
            if shard.device.platform != "cpu" or data.nbytes == 0:
                continue
            start = data.unsafe_buffer_pointer()
            out.append((start, start + data.nbytes))
    return out


def huge_pages(arrays: Iterable[Any]) -> str:
    """Back the 2 MiB-aligned interior of each CPU buffer of ``arrays`` with transparent huge pages
    (see the module's docstring); returns what happened, for the load log."""
    if os.environ.get("RUVLLM_JAX_HUGE_PAGES", "1").strip().lower() in _OFF:
        return "off (RUVLLM_JAX_HUGE_PAGES=0)"
    if not sys.platform.startswith("linux"):
        return "n/a (not Linux)"
    if thp_mode() == "never":
        return "off (transparent huge pages: never)"
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    ranges = buffer_ranges(arrays)
    t0 = time.perf_counter()
    total = sum(end - start for start, end in ranges)
    advised = collapsed = 0
    refused: set[str] = set()
    for start, end in ranges:
        a = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        b = end & ~(HUGE_PAGE - 1)
        if b <= a:
            continue
        if madvise(a, b - a, MADV_HUGEPAGE) != 0:
            refused.add(f"MADV_HUGEPAGE: {os.strerror(ctypes.get_errno())}")
            continue
        advised += b - a
        if madvise(a, b - a, MADV_COLLAPSE) == 0:
            collapsed += b - a
        else:
            err = ctypes.get_errno()
            why = (
                "a kernel before 6.1, memory that is not anonymous, or huge pages disabled for this process"
                if err == 22  # EINVAL
                else os.strerror(err)
            )
            refused.add(f"MADV_COLLAPSE: {why}")
    mb = 1e6
    said = f"{collapsed / mb:.0f} of {total / mb:.0f} MB collapsed"
    if collapsed:
        said += f" in {time.perf_counter() - t0:.2f} s"
    if advised > collapsed:
        said += f", {(advised - collapsed) / mb:.0f} MB advised for khugepaged"
    return said + (f" (refused: {'; '.join(sorted(refused))})" if refused else "")


MADV_DONTNEED = 4


def drop_file_pages(a: np.ndarray, mapping: np.ndarray) -> bool:
    """Unmap the pages of ``a``, a view into ``mapping`` (a read-only shared file mapping, such as a
    GGUF checkpoint's), from this process: the page cache keeps them and a later read faults them
    back in, but they leave the process's RSS. A load that has converted a tensor calls this on its
    blocks, so reading a file of several GB does not leave all of it mapped. Only the page-aligned
    interior of ``a`` is dropped, and nothing outside ``mapping`` ever is (on anonymous memory
    ``MADV_DONTNEED`` would zero it); returns whether anything was."""
    if not sys.platform.startswith("linux") or a.size == 0:
        return False
    lo, hi = mapping.ctypes.data, mapping.ctypes.data + mapping.nbytes
    start, end = a.ctypes.data, a.ctypes.data + a.nbytes
    if not (lo <= start and end <= hi) or mapping.flags.writeable:
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = -(-start // page) * page, end // page * page
    if last <= first:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return libc.madvise(first, last - first, MADV_DONTNEED) == 0


def _file_source(x: np.ndarray) -> tuple[str, int] | None:
    """(file, byte offset) of ``x`` where it is a contiguous view of a ``np.memmap`` of a file, else
    None."""
    root = x
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not isinstance(root, np.memmap) or not getattr(root, "filename", None) or not x.flags.c_contiguous:
        return None
    return root.filename, int(root.offset) + (x.ctypes.data - root.ctypes.data)


#: Bytes one read of :func:`_read_in_parallel` asks for at most.
_READ_CHUNK = 64 << 20


def _read_in_parallel(reads: list[tuple[str, int, np.ndarray]]) -> None:
    """Fill each destination array with its file's bytes from its offset, in chunks spread over the
    CPUs this process may use. ``pread`` copies from the page cache in the kernel: the file's pages
    are never mapped into this process (a copy through the mapping faulted each 4 KiB page in, then
    dropped it again, and ran on one core: 2.2 s for a 1.26 GB model on a 2-core Zen 4)."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = []
    for path, offset, dst in reads:
        view = memoryview(dst.reshape(-1).view(np.uint8))
        jobs += [(path, offset + i, view[i : i + _READ_CHUNK]) for i in range(0, view.nbytes, _READ_CHUNK)]
    fds = {path: os.open(path, os.O_RDONLY) for path in {r[0] for r in reads}}

    def read(job: tuple[str, int, memoryview]) -> None:
        path, offset, view = job
        while view.nbytes:
            n = os.preadv(fds[path], [view], offset)
            if n <= 0:
                raise OSError(f"{path}: short read at {offset}")
            view, offset = view[n:], offset + n

    try:
        workers = max(1, min(len(jobs), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(read, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)


def huge_page_copy(tree: Any) -> tuple[Any, str]:
    """``tree``'s arrays (views of a read-only file mapping: the weight cache's) copied into one
    anonymous mapping advised for transparent huge pages before it is touched, each array 2 MiB
    aligned: read from the file with ``pread`` on every CPU (:func:`_read_in_parallel`; 0.95 s for
    an 8B file's 5 GB where copying through the mapping on one core took 2.8-11.8 s), or, for an
    array that is not a view of a file, copied with its file pages dropped from the process after
    (so RSS holds the weights once). On a kernel that cannot put file pages on huge pages (no
    ``CONFIG_READ_ONLY_THP_FOR_FS``) this is how mapped weights get them back: a decode step streams
    every weight byte, and huge pages
    made single-stream decode 7-10% faster on the small models (the journal, "Weights on huge pages").
    Returns (the new tree, what happened); the tree
    unchanged where huge pages are off (``RUVLLM_JAX_HUGE_PAGES=0``, THP ``never``, not Linux)."""
    import mmap

    import jax

    if os.environ.get("RUVLLM_JAX_HUGE_PAGES", "1").strip().lower() in _OFF:
        return tree, "off (RUVLLM_JAX_HUGE_PAGES=0): weights mapped from the cache file"
    if not sys.platform.startswith("linux") or thp_mode() in (None, "never"):
        return tree, "off (no transparent huge pages): weights mapped from the cache file"
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, np.ndarray) and x.nbytes]
    total = sum(-(-x.nbytes // HUGE_PAGE) * HUGE_PAGE for x in leaves)
    t0 = time.perf_counter()
    buf = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(buf, np.uint8)
    start = -(-whole.ctypes.data // HUGE_PAGE) * HUGE_PAGE - whole.ctypes.data
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    advised = libc.madvise(whole.ctypes.data + start, total, MADV_HUGEPAGE) == 0
    copies: dict[int, np.ndarray] = {}
    reads: list[tuple[str, int, np.ndarray]] = []  # (file, offset, destination): read, not copied
    at = start
    for x in leaves:
        dst = whole[at : at + x.nbytes].view(x.dtype).reshape(x.shape)
        source = _file_source(x)
        if source is None:
            dst[...] = x
            drop_file_pages(x, x)
        else:
            reads.append((*source, dst))
        copies[id(x)] = dst
        at += -(-x.nbytes // HUGE_PAGE) * HUGE_PAGE
    _read_in_parallel(reads)
    out = jax.tree_util.tree_map(lambda x: copies.get(id(x), x), tree)
    onto = "pages advised for huge pages" if advised else "4 KiB pages (MADV_HUGEPAGE refused)"
    return out, f"{total / 1e6:.0f} MB copied from the cache file onto {onto} in {time.perf_counter() - t0:.2f} s"
