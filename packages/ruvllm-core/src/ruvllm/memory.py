"""The host memory a process may still take: what the kernel can give without swapping, within the
memory limit of the cgroup the process runs in (a container's or a systemd unit's limit is not in
``/proc/meminfo``)."""

from __future__ import annotations

import os
from pathlib import Path

#: Where cgroup v2 is mounted.
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


#: cgroup v1's "no limit" is the largest page-aligned signed 64-bit value; anything this large is none.
_NO_LIMIT = 1 << 60
#: (limit file, usage file, reclaimable page cache key in memory.stat) of each cgroup version.
_FILES = {
    2: ("memory.max", "memory.current", "inactive_file"),
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


def _stat(path: Path, key: str) -> int:
    try:
        for line in (path / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_headroom(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes left under the tightest memory limit of this process's cgroup and its parents: the limit
    less the usage, plus the inactive page cache the kernel would reclaim first (as ``MemAvailable``
    counts it). cgroup v2 (``memory.max``) or v1's memory controller (``memory.limit_in_bytes``, under
    ``<root>/memory``); None where no limit is set or neither is there."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[int, Path]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            found.append((2, root / parts[2].lstrip("/")))
        elif "memory" in parts[1].split(","):
            found.append((1, root / "memory" / parts[2].lstrip("/")))
    best: int | None = None
    for version, leaf in found:
        limit_file, usage_file, reclaimable = _FILES[version]
        top = root / "memory" if version == 1 else root
        path = leaf
        while True:
            try:
                text = (path / limit_file).read_text().strip()
                limit = _NO_LIMIT if text == "max" else int(text)
                if limit < _NO_LIMIT:
                    usage = int((path / usage_file).read_text().strip())
                    left = limit - usage + _stat(path, reclaimable)
                    best = left if best is None else min(best, left)
            except (OSError, ValueError):
                pass
            if path == top or top not in path.parents:
                break
            path = path.parent
    return None if best is None else max(0, best)


def available_memory() -> int:
    """Bytes this process may still allocate without swapping: ``MemAvailable`` (free memory plus
    reclaimable page cache), or less where the process's cgroup limits it; 8 GiB where neither can
    be read."""
    found = [m for m in (_meminfo_available(), cgroup_headroom()) if m is not None]
    return min(found) if found else 8 * 2**30


def release_free_memory() -> bool:
    """Hand the C allocator's free memory back to the system (glibc's ``malloc_trim(0)``, which also
    releases free pages inside the heap, not only at its top); False where the allocator has no such
    call. For a process that just dropped a large object (a server unloading a model): a backend may
    have told the allocator to keep freed buffers for reuse, and the freed model's gigabytes would
    otherwise stay resident."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
