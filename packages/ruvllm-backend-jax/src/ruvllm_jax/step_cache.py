"""Compiled forward steps kept on disk, so a later start loads each step shape's program instead of
tracing and lowering it again.

JAX's persistent compilation cache (``jax_compilation_cache_dir``) saves XLA's compile, but finds its
entry by the lowered program's hash: every start still traces ``forward_step`` and lowers it to
StableHLO for every shape, which was 22 of the 25 seconds a warm server spent precompiling 74 step
shapes of an 8B-shaped model on a 2-core Zen 4 (``ruvllm serve``'s ``/ready`` waits for them). Here a
step's executable (``jax.experimental.serialize_executable``) is stored under a key made of everything
the program depends on, so a hit needs no tracing at all:

* the model's :class:`~ruvllm_jax.step_types.ModelSpec` and the step's :class:`StepPlan` (their reprs);
* the arguments' tree structure (with every static field: quantized forms, panel layouts) and each
  leaf's shape, dtype and placement;
* the code that traces it: a digest of every module of ``ruvllm`` and ``ruvllm_jax`` and the native
  library's identity (size, modification time), jax's and jaxlib's versions, JAX's configuration
  values, ``XLA_FLAGS``, the device kind and the host CPU's feature flags (XLA compiles for them: a
  program built with AVX-512 must never run on a CPU without it).

Only single-device steps are kept. ``RUVLLM_JAX_STEP_CACHE``: a directory, or ``off``; default
``<ruvllm cache>/jax-steps``. An entry that cannot be read back (truncated, from another version) is
compiled again and rewritten; a directory that cannot be written is logged once and ignored.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import platform
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import structlog

log = structlog.get_logger("ruvllm_jax.step_cache")

#: The layout of an entry; a change makes every older one a miss.
FORMAT_VERSION = 1
_OFF = ("off", "0", "false", "no")
_warned: set[str] = set()
_fresh_lock = threading.Lock()


def cache_dir() -> Path | None:
    """Where entries go, or None when ``RUVLLM_JAX_STEP_CACHE`` is ``off``."""
    setting = os.environ.get("RUVLLM_JAX_STEP_CACHE", "").strip()
    if setting.lower() in _OFF:
        return None
    if setting:
        return Path(setting).expanduser()
    from ruvllm.catalog import cache_dir as ruvllm_cache

    return ruvllm_cache() / "jax-steps"


@functools.cache
def _code_digest() -> str:
    """Every module that can change what ``forward_step`` traces: all of ``ruvllm`` and ``ruvllm_jax``,
    and the native library the steps call (by size and modification time)."""
    import ruvllm
    import ruvllm_jax
    from ruvllm_jax import native

    h = hashlib.sha256()
    for pkg in (ruvllm, ruvllm_jax):
        root = Path(pkg.__file__).parent
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    lib = native.library_path()
    if lib is not None and Path(lib).exists():
        st = Path(lib).stat()
        h.update(f"{lib}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


@functools.cache
def _host() -> str:
    """The CPU features XLA compiles for, and the environment that changes how it compiles."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    except OSError:
        flags = platform.processor()
    import jaxlib

    config = sorted(
        (k, v) for k, v in jax.config.values.items() if isinstance(v, bool | int | float | str) or v is None
    )
    config = [(k, v) for k, v in config if "cache" not in k]  # where caches live does not change a program
    from ruvllm_jax import native

    env = {k: os.environ.get(k) for k in ("XLA_FLAGS", "RUVLLM_JAX_NATIVE")}
    return repr((platform.machine(), flags, jax.__version__, jaxlib.__version__, env, native.available(), config))


def step_key(spec: Any, plan: Any, args: tuple[Any, ...]) -> str | None:
    """The entry name of a step compiled for ``spec``, ``plan`` and ``args``; None where steps are not
    kept (the setting is off; arguments on more than one device)."""
    if cache_dir() is None:
        return None
    leaves, tree = jax.tree_util.tree_flatten(args)
    described = []
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        if sharding is not None and len(sharding.device_set) != 1:
            return None
        described.append((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)), str(sharding)))
    device = jax.devices()[0]
    h = hashlib.sha256()
    for part in (FORMAT_VERSION, _code_digest(), _host(), device.platform, device.device_kind, spec, plan, tree):
        h.update(repr(part).encode())
        h.update(b"\0")
    h.update(repr(described).encode())
    return h.hexdigest()[:40]


@contextlib.contextmanager
def fresh_compile() -> Iterator[bool]:
    """A compile that does not read JAX's persistent compilation cache; yields whether that could be
    arranged. An executable XLA:CPU loaded from that cache serializes without all of its code (a step
    stored that way failed with ``Function transpose_copy_fusion.1 not found`` when loaded back), so
    only a program compiled in this process is stored. JAX has no public switch for one compile: its
    check (``compilation_cache.is_cache_used``) is answered False meanwhile, under a lock."""
    try:
        from jax._src import compilation_cache
    except ImportError:
        yield False
        return
    if not callable(getattr(compilation_cache, "is_cache_used", None)):
        yield False
        return
    with _fresh_lock:
        used = compilation_cache.is_cache_used
        compilation_cache.is_cache_used = lambda backend: False
        try:
            yield True
        finally:
            compilation_cache.is_cache_used = used


def load(key: str) -> Any | None:
    """The step stored under ``key``, loaded onto the device, or None (not there, or unreadable: then
    it is compiled again and the entry rewritten)."""
    from jax.experimental import serialize_executable

    root = cache_dir()
    if root is None:
        return None
    path = root / f"{key}.step"
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    try:
        version, payload, in_tree, out_tree = pickle.loads(blob)
        if version != FORMAT_VERSION:
            return None
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception as exc:  # a damaged or foreign entry: compiled again, never trusted
        log.warning("compiled step entry unreadable; compiling again", entry=str(path), error=repr(exc)[:200])
        return None


def store(key: str, compiled: Any) -> None:
    """Keep ``compiled`` under ``key`` (written to a temporary name, then renamed into place)."""
    from jax.experimental import serialize_executable

    root = cache_dir()
    if root is None:
        return
    try:
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        blob = pickle.dumps((FORMAT_VERSION, payload, in_tree, out_tree))
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{key}.{os.getpid()}.tmp"
        tmp.write_bytes(blob)
        os.replace(tmp, root / f"{key}.step")
    except Exception as exc:  # an unwritable directory, or a program that cannot be serialized
        where = str(root)
        if where not in _warned:
            _warned.add(where)
            log.warning("compiled steps not kept on disk", directory=where, error=repr(exc)[:200])
