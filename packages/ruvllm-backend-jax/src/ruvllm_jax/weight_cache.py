"""A GGUF's ``w4a8`` weights repacked once into the native kernels' form, in a cache file that every
later load memory-maps (llama.cpp repacks for its CPU kernels too; keeping the repack on disk is what
makes the second start quick).

The first load converts the file's blocks layer by layer straight into the cache file's mapping
(:class:`WeightLoader`'s ``alloc``), so no whole-model copy is ever made in anonymous memory; then
the file is closed, renamed into place with its manifest, and mapped read-only. Later loads map it
and hand the arrays to JAX, which on a CPU uses the mapped pages in place (``jax.device_put`` of an
aligned host array aliases it). The weights then live in the page cache: read once from disk, shared
between processes serving the same file, and counted in a process's RSS only as file pages.

A cache entry is named by the GGUF's identity (resolved path, size, modification time, inode), the
load's form (quantization, dtype) and this package's loading code (a digest of the modules that decide
the repacked bytes), so a changed file or a changed ruvllm makes a new entry instead of reading stale
weights. An entry is checked against its manifest (format version, key, every array's offset and
size within the file's length) before it is used; a bad one is rebuilt.

``RUVLLM_WEIGHT_CACHE``: a directory, or ``off``; default ``<ruvllm cache>/weights``. A directory that
cannot be written is logged once and the load goes on without a cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import structlog

from ruvllm.checkpoint import Checkpoint

log = structlog.get_logger("ruvllm_jax.weight_cache")

#: The layout of a cache entry; a change makes every older entry a miss.
FORMAT_VERSION = 1
#: Arrays start on page boundaries: mapped views are then aligned for JAX's zero-copy use and the
#: kernels' vector loads, and each array's pages are its own.
ALIGN = 4096
#: Modules whose code decides the repacked bytes (their digest is part of the key).
_CODE = ("loading.py", "gguf_blocks.py", "quant.py", "repack.py", "split_stack.py", "native/cpu_repack.cc")
_CODE += ("weight_cache.py",)


@dataclasses.dataclass(frozen=True)
class _Ref:
    """Stands for one array in a manifest's skeleton: its place in the cache file."""

    offset: int
    shape: tuple[int, ...]
    dtype: str


def applies(checkpoint: Checkpoint, quantization: str, mmap_experts: bool) -> bool:
    """Whether a load is cached: a GGUF in ``w4a8`` (the kernels' form of its blocks, the CPU default),
    its experts (if any) not left in the file. The caller checks for one CPU device."""
    return checkpoint.format == "gguf" and quantization == "w4a8" and not mmap_experts and cache_root() is not None


def cache_root() -> Path | None:
    """The directory entries go in, or None when ``RUVLLM_WEIGHT_CACHE`` is ``off``."""
    setting = os.environ.get("RUVLLM_WEIGHT_CACHE", "").strip()
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    if setting:
        return Path(setting).expanduser()
    from ruvllm.catalog import cache_dir

    return cache_dir() / "weights"


def _code_digest() -> str:
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in _CODE:
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def entry_key(checkpoint: Checkpoint, form: dict[str, Any]) -> str:
    """The name of ``checkpoint``'s entry for a load of ``form`` (quantization, dtype, ...)."""
    path = Path(checkpoint.path).resolve()
    st = path.stat()
    ident = {
        "version": FORMAT_VERSION,
        "file": str(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "inode": st.st_ino,
        "form": form,
        "code": _code_digest(),
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    return f"{path.stem[:48]}-{digest}"


class _FileRows:
    """A stacked array being written to the cache file: each row (its first axis, a layer) goes to
    the file with ``pwrite`` as the loader assigns it, so the written pages never sit in this
    process's memory. Only assignment of whole rows is supported."""

    def __init__(self, fd: int, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.fd, self.offset, self.shape, self.dtype = fd, offset, tuple(shape), np.dtype(dtype)
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize
        self.row_bytes = self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0

    def __setitem__(self, i: int, value: np.ndarray) -> None:
        row = np.ascontiguousarray(value, dtype=self.dtype)
        if not isinstance(i, int | np.integer) or not 0 <= i < self.shape[0] or row.shape != self.shape[1:]:
            raise ValueError(f"cache rows take whole rows of shape {self.shape[1:]}, got {row.shape} at {i!r}")
        view = memoryview(row.reshape(-1).view(np.uint8))
        at = self.offset + int(i) * self.row_bytes
        while view.nbytes:
            n = os.pwrite(self.fd, view, at)
            view, at = view[n:], at + n


class _Writer:
    """Lays arrays out in one file as they are asked for (``alloc``), each in a page-aligned range."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "w+b")  # noqa: SIM115 - closed in close
        self.size = 0
        self.arrays: dict[int, tuple[int, Any]] = {}  # id(array) -> (offset, array)

    def _place(self, nbytes: int) -> int:
        offset = -(-self.size // ALIGN) * ALIGN
        self.size = offset + nbytes
        return offset

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        rows = _FileRows(self.file.fileno(), 0, shape, dtype)
        rows.offset = self._place(rows.nbytes)
        self.arrays[id(rows)] = (rows.offset, rows)
        return rows

    def ref(self, a: Any) -> _Ref:
        """The array's place in the file: where ``alloc`` put it, else a copy written now (the
        vectors, the embedding and the experts, which are not streamed)."""
        found = self.arrays.get(id(a))
        if found is None:
            src = np.ascontiguousarray(a)
            offset = self._place(src.nbytes)
            view = memoryview(src.reshape(-1).view(np.uint8))
            at = offset
            while view.nbytes:
                n = os.pwrite(self.file.fileno(), view, at)
                view, at = view[n:], at + n
            self.arrays[id(src)] = found = (offset, src)
            self.arrays[id(a)] = found
        offset, arr = found
        return _Ref(offset, tuple(arr.shape), np.dtype(arr.dtype).str)

    def close(self) -> None:
        self.file.truncate(-(-self.size // ALIGN) * ALIGN)
        self.arrays.clear()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def _map(path: Path, skeleton: Any, size: int) -> Any:
    """The skeleton's arrays as read-only views of the mapped file."""
    if size == 0 or path.stat().st_size < size:
        raise ValueError("the cache file is shorter than its manifest says")
    base = np.memmap(path, dtype=np.uint8, mode="r")

    def view(leaf: Any) -> Any:
        if not isinstance(leaf, _Ref):
            return leaf
        dtype = np.dtype(leaf.dtype)
        count = int(np.prod(leaf.shape, dtype=np.int64))
        if leaf.offset % ALIGN or leaf.offset + count * dtype.itemsize > size:
            raise ValueError("an array of the manifest lies outside the cache file")
        return base[leaf.offset : leaf.offset + count * dtype.itemsize].view(dtype).reshape(leaf.shape)

    return jax.tree_util.tree_map(view, skeleton, is_leaf=lambda x: isinstance(x, _Ref))


class WeightCache:
    """One checkpoint's entry: :meth:`load` maps it, or builds it with ``build(alloc)`` first."""

    def __init__(self, root: Path, key: str) -> None:
        self.root, self.key = root, key
        self.data = root / f"{key}.bin"
        self.manifest = root / f"{key}.manifest"

    @classmethod
    def for_checkpoint(cls, checkpoint: Checkpoint, form: dict[str, Any]) -> WeightCache | None:
        """The entry for a load of ``checkpoint`` in ``form``; None when the cache is off."""
        root = cache_root()
        return None if root is None else cls(root, entry_key(checkpoint, form))

    def _read(self) -> Any | None:
        """The mapped weights of a complete, consistent entry; None where there is none or it is bad
        (then removed, to be rebuilt)."""
        if not self.manifest.exists():
            return None
        try:
            with open(self.manifest, "rb") as f:
                meta = pickle.load(f)
            if meta.get("version") != FORMAT_VERSION or meta.get("key") != self.key:
                raise ValueError("the manifest is of another version or entry")
            return _map(self.data, meta["skeleton"], int(meta["size"]))
        except Exception as exc:  # a damaged entry is rebuilt, never used
            log.warning("weight cache entry unusable; rebuilding it", entry=str(self.data), error=str(exc))
            for p in (self.manifest, self.data):
                p.unlink(missing_ok=True)
            return None

    def load(self, build: Callable[[Callable[..., np.ndarray]], Any]) -> tuple[Any, str]:
        """(weights, what happened: ``hit``, ``written`` or why not cached). ``build(alloc)`` loads the
        weights, making its large arrays with ``alloc``."""
        hit = self._read()
        if hit is not None:
            return hit, "hit"
        tmp = self.root / f"{self.key}.{os.getpid()}.tmp"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            writer = _Writer(tmp)
        except OSError as exc:
            log.warning(
                "weight cache directory cannot be written; loading without it", dir=str(self.root), error=str(exc)
            )
            return build(np.empty), f"off ({exc.strerror or exc})"
        try:
            weights = build(writer.alloc)
            skeleton = jax.tree_util.tree_map(writer.ref, weights)
            size = writer.size
            writer.close()
            del weights
            os.replace(tmp, self.data)
            manifest_tmp = self.manifest.with_suffix(".manifest.tmp")
            with open(manifest_tmp, "wb") as f:
                pickle.dump({"version": FORMAT_VERSION, "key": self.key, "size": size, "skeleton": skeleton}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(manifest_tmp, self.manifest)
        except OSError as exc:  # a full disk, say: the cache is dropped, the load goes on from the file
            tmp.unlink(missing_ok=True)
            log.warning("weight cache could not be written; loading without it", dir=str(self.root), error=str(exc))
            return build(np.empty), f"off ({exc.strerror or exc})"
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return _map(self.data, skeleton, size), "written"


def splits_mixed(options: Any, one_cpu_device: bool) -> bool:
    """Whether a load holds a weight's layers of different k-quant types each in its own form
    (:mod:`ruvllm_jax.split_stack`): every step of a native ``w4a8`` model on one CPU runs the
    kernels, which take that form; XLA's steps need the one common form."""
    from ruvllm_jax.options import native_option

    return one_cpu_device and options.quantization == "w4a8" and native_option(options, 1)


def host_weights(
    checkpoint: Checkpoint,
    spec: Any,
    options: Any,
    keep_gguf_blocks: bool,
    mmap_experts: bool,
    one_cpu_device: bool,
) -> tuple[Any, str, str | None]:
    """A model's host weights, through the cache where it applies (one CPU device, see
    :func:`applies`): (weights, what the load log says of the cache, what it says of huge pages when
    the weights came from the cache, else None: the caller then collapses its own buffers)."""
    from ruvllm_jax.host_memory import huge_page_copy
    from ruvllm_jax.loading import Allocator, WeightLoader

    split = splits_mixed(options, one_cpu_device)

    def build(alloc: Allocator | None = None) -> Any:
        loader = WeightLoader(checkpoint, spec, options.quantization, keep_gguf_blocks, mmap_experts, alloc)
        loader.split_mixed = split
        return loader.load()

    if not (one_cpu_device and applies(checkpoint, options.quantization, mmap_experts)):
        return build(), "off", None
    form = {"quantization": options.quantization, "dtype": options.dtype, "split_mixed": split}
    cache = WeightCache.for_checkpoint(checkpoint, form)
    assert cache is not None  # applies() checked the cache is on
    host, said = cache.load(build)
    if said not in ("hit", "written"):
        return host, f"{said}: {cache.data}", None
    # File pages cannot be huge pages on most kernels: copied onto anonymous ones instead (or left
    # mapped in place, with RUVLLM_JAX_HUGE_PAGES=0).
    host, pages = huge_page_copy(host)
    return host, f"{said}: {cache.data}", pages
