"""Native CPU kernels called from jitted steps through the XLA FFI (``jax.ffi``).

XLA:CPU multiplies a single int8 activation row by an int8 matrix in a generic loop, and inside
``lax.scan`` it copies each layer's weight slice before using it; for one-token decode steps those
two costs are most of the step. ``cpu_kernels.cc`` holds kernels that take the whole stacked weight
array plus a layer index (no copy) and run the integer product with the CPU's dot-product
instructions (AVX-512 VNNI where the CPU has it, a portable loop otherwise).

The library is compiled on first use with the machine's C++ compiler (``$CXX``, else ``c++``/``g++``)
for the running CPU (``-march=native``) and cached under ``$RUVLLM_JAX_NATIVE_CACHE`` (default
``~/.cache/ruvllm/native``), keyed by the source, jaxlib version, compiler and CPU flags. When no
compiler is found or the build fails, :func:`available` is False, the reason is logged once, and the
steps use the XLA path, which computes the same values. ``RUVLLM_JAX_NATIVE=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import structlog

log = structlog.get_logger("ruvllm_jax.native")

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
W8A8_TARGET = "ruvllm_w8a8"
WXA8_TARGET = "ruvllm_wxa8"
WXA8_PANEL_TARGET = "ruvllm_wxa8_panel"
DECODE_TARGET = "ruvllm_paged_decode"

_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    return Path(os.environ.get("RUVLLM_JAX_NATIVE_CACHE") or Path.home() / ".cache" / "ruvllm" / "native")


def _build(cxx: str) -> Path:
    import jaxlib

    src = SOURCE.read_bytes()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        b"\0".join(x.encode() if isinstance(x, str) else x for x in (src, jaxlib.__version__, version, _cpu_flags()))
    ).hexdigest()[:20]
    out = cache_dir() / key / "libruvllm_cpu_kernels.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [
            cxx,
            "-O3",
            "-march=native",
            "-std=c++17",
            "-shared",
            "-fPIC",
            "-w",
            "-fopenmp-simd",
            f"-I{jax.ffi.include_dir()}",
            str(SOURCE),
            "-o",
            str(tmp_out),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders both end with a whole file
    return out


def _load() -> None:
    if os.environ.get("RUVLLM_JAX_NATIVE", "1").lower() in ("0", "false", "no", "off"):
        _state["reason"] = "turned off by RUVLLM_JAX_NATIVE"
        return
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        _state["reason"] = f"unsupported machine {platform.machine()}"
        return
    cxx = _compiler()
    if cxx is None:
        _state["reason"] = "no C++ compiler found (set CXX)"
        return
    try:
        path = _build(cxx)
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(W8A8_TARGET, jax.ffi.pycapsule(lib.RuvllmW8A8), platform="cpu")
        jax.ffi.register_ffi_target(WXA8_TARGET, jax.ffi.pycapsule(lib.RuvllmWxA8), platform="cpu")
        jax.ffi.register_ffi_target(WXA8_PANEL_TARGET, jax.ffi.pycapsule(lib.RuvllmWxA8Panel), platform="cpu")
        jax.ffi.register_ffi_target(DECODE_TARGET, jax.ffi.pycapsule(lib.RuvllmPagedDecode), platform="cpu")
        lib.ruvllm_cpu_kernels_path.restype = ctypes.c_char_p
        _state["lib"] = lib
        _state["path"] = lib.ruvllm_cpu_kernels_path().decode()
        log.info("native cpu kernels loaded", library=str(path), vector_path=_state["path"])
    except Exception as exc:  # the XLA path stays correct; say why the fast one is missing
        _state["reason"] = str(exc)


def available() -> bool:
    """Whether the native kernels are built, loaded and registered with XLA (builds them once)."""
    with _lock:
        if not _state.get("tried"):
            _state["tried"] = True
            _load()
            if "lib" not in _state:
                off = os.environ.get("RUVLLM_JAX_NATIVE", "1").lower() in ("0", "false", "no", "off")
                say = log.info if off else log.warning
                say("native cpu kernels unavailable; using XLA", reason=_state.get("reason"))
    return "lib" in _state


def vector_path() -> str | None:
    """``avx512-vnni`` or ``scalar`` (what the library was compiled to use), None when not loaded."""
    return str(_state["path"]) if available() else None


def unavailable_reason() -> str | None:
    return None if available() else str(_state.get("reason"))


def _require() -> None:
    if not available():
        raise RuntimeError(f"ruvllm native CPU kernels are not available: {unavailable_reason()}")


def w8a8_group(
    x: jax.Array, layer: jax.Array, in_scale: jax.Array | None, weights: list[tuple[jax.Array, jax.Array]]
) -> list[jax.Array]:
    """``x @ W_i.T`` for each ``(quant [L?, N, K] int8, scale [L?, N(, 1)] float32)`` of ``weights``
    at layer ``layer`` (0 for unstacked). ``x`` ``[rows, K]`` float32 is multiplied by ``in_scale``
    (``[L?, K]``, the group's shared smoothing factors) and quantized once for the whole group."""
    _require()
    rows = x.shape[0]
    results = [jax.ShapeDtypeStruct((rows, q.shape[-2]), jnp.float32) for q, _ in weights]
    operands: list[jax.Array] = []
    for q, s in weights:
        operands += [q, s.astype(jnp.float32)]
    scale = jnp.zeros((0,), jnp.float32) if in_scale is None else in_scale.astype(jnp.float32)
    call = jax.ffi.ffi_call(W8A8_TARGET, results)
    return list(call(x.astype(jnp.float32), jnp.asarray(layer, jnp.int32).reshape(()), scale, *operands))


def wxa8_group(
    x: jax.Array, layer: jax.Array, weights: list[tuple[jax.Array, jax.Array, jax.Array]], *, panel: bool = False
) -> list[jax.Array]:
    """``x @ W_i.T`` for group-quantized weights ``(codes uint8 [L?, N, K/2 or K], scale float16
    [L?, N, K/32], offset float16 [L?, N, K/32])`` at ``layer``, with ``x`` ``[rows, K]`` quantized to
    int8 per group of 32 once for the whole group (see ``cpu_kernels.cc``, ``ruvllm_wxa8``). With
    ``panel`` every matrix is in the panel layout of :func:`ruvllm_jax.quant.to_panels`."""
    _require()
    rows = x.shape[0]
    results = [jax.ShapeDtypeStruct((rows, q.shape[-2]), jnp.float32) for q, _, _ in weights]
    operands: list[jax.Array] = []
    for q, d, m in weights:
        operands += [q, d.astype(jnp.float16), m.astype(jnp.float16)]
    call = jax.ffi.ffi_call(WXA8_PANEL_TARGET if panel else WXA8_TARGET, results)
    return list(call(x.astype(jnp.float32), jnp.asarray(layer, jnp.int32).reshape(()), *operands))


def paged_decode(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, tables: jax.Array, context: jax.Array
) -> jax.Array:
    """Attention of one token per sequence, ``q`` ``[S, H, D]`` float32, over the float32 paged caches
    ``[L, NB, BS, KVH, D]`` at ``layer`` (read in place), keys ``0 .. context[s] - 1`` through
    ``tables`` ``[S, Bd]``. Returns ``[S, H, D]``; a sequence with context 0 gets zeros."""
    _require()
    call = jax.ffi.ffi_call(DECODE_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32),
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32).reshape(()),
        tables.astype(jnp.int32),
        context.astype(jnp.int32),
    )
