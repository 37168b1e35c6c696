"""Native CPU kernels called from jitted steps through the XLA FFI (``jax.ffi``).

XLA:CPU multiplies a single int8 activation row by an int8 matrix in a generic loop, and inside
``lax.scan`` it copies each layer's weight slice before using it; for one-token decode steps those
two costs are most of the step. The kernels take the whole stacked weight array plus a layer index
(no copy) and run the integer products with the CPU's dot-product instructions.

The library is compiled when the package is installed (``setup.py``), once per ISA variant into one
file: ``scalar``, ``avx2``, ``avxvnni`` and ``avx512vnni`` on x86-64; ``neon``, ``neon-dotprod`` and
``neon-i8mm`` on aarch64. At load it reads the CPU's features and uses the best variant;
``RUVLLM_CPU_ISA`` forces another the CPU supports (an unknown or unsupported one is an error). No
compiler is needed at run time. Without the library (installed where no compiler was found), or with
``RUVLLM_JAX_NATIVE=0``, :func:`available` is False, the reason is logged once, and the steps use the
XLA path, which computes the same values.

The kernels split work over a pool of their own threads: ``RUVLLM_THREADS`` (or the backend's
``threads`` option) when set, else the CPUs this process may run on (its affinity mask, capped by a
cgroup CPU quota).
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import structlog

from ruvllm.errors import BackendError

log = structlog.get_logger("ruvllm_jax.native")

W8A8_TARGET = "ruvllm_w8a8"
WXA8_TARGET = "ruvllm_wxa8"
WXA8_PANEL_TARGET = "ruvllm_wxa8_panel"
KXA8_PANEL_TARGET = "ruvllm_kxa8_panel"
EXPERTS_TARGET = "ruvllm_experts"
EXPERTS_W8A8_TARGET = "ruvllm_experts_w8a8"
EXPERTS_STORED_TARGET = "ruvllm_experts_stored"
#: GGUF types the stored-block experts' kernel reads as stored, by ggml type id (cpu_kernels.h, StoredType).
STORED_TYPES = {"Q8_0": 8, "Q4_K": 12, "Q6_K": 14, "MXFP4": 39}
DECODE_TARGET = "ruvllm_paged_decode"
PREFILL_TARGET = "ruvllm_paged_prefill"
LORA_TARGET = "ruvllm_lora"
MEAN_SQUARE_TARGET = "ruvllm_mean_square"
FLOAT_PRODUCT_TARGET = "ruvllm_float_product"
W8A8_RESCALE_TARGET = "ruvllm_w8a8_rescale"
#: Names ``RUVLLM_CPU_ISA`` accepts (besides ``auto``), per architecture, worst first.
ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni", "neon", "neon-dotprod", "neon-i8mm")

_lock = threading.Lock()
_state: dict[str, object] = {}


def library_path() -> Path | None:
    """The built library inside the installed package, or None when the install built none."""
    found = sorted(Path(__file__).parent.glob("_cpu_kernels*.so")) + sorted(
        Path(__file__).parent.glob("_cpu_kernels*.pyd")
    )
    return found[0] if found else None


def _off() -> bool:
    return os.environ.get("RUVLLM_JAX_NATIVE", "1").lower() in ("0", "false", "no", "off")


def _cgroup_cpu_limit() -> int | None:
    """CPUs allowed by a cgroup v2 (``cpu.max``) or v1 (``cpu.cfs_quota_us``) quota, rounded up."""
    candidates = [
        (Path("/sys/fs/cgroup/cpu.max"), None),
        (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")),
    ]
    for quota_path, period_path in candidates:
        try:
            text = quota_path.read_text().split()
            if period_path is None:
                quota, period = text[0], text[1]
            else:
                quota, period = text[0], period_path.read_text().strip()
        except (OSError, IndexError):
            continue
        if quota in ("max", "-1"):
            return None
        try:
            return max(1, math.ceil(int(quota) / int(period)))
        except (ValueError, ZeroDivisionError):
            return None
    return None


def default_threads() -> int:
    """The CPUs this process may use: its affinity mask, capped by a cgroup CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    limit = _cgroup_cpu_limit()
    return max(1, min(n, limit) if limit else n)


def parse_threads(value: object, what: str) -> int:
    """A thread count from a flag, option or environment variable ``what``: a positive integer."""
    try:
        n = int(str(value))
    except ValueError:
        n = 0
    if n < 1:
        raise BackendError(f"{what} must be a positive integer, got {value!r}")
    return n


def _default_threads_setting() -> int:
    env = os.environ.get("RUVLLM_THREADS")
    return parse_threads(env, "RUVLLM_THREADS") if env else default_threads()


def _load() -> None:
    if _off():
        _state["reason"] = "turned off by RUVLLM_JAX_NATIVE"
        return
    path = library_path()
    if path is None:
        _state["reason"] = (
            "the package was installed without its native library (no C++ compiler at install time); "
            "reinstall ruvllm-backend-jax with a compiler, or from a platform wheel"
        )
        return
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        _state["reason"] = f"cannot load {path}: {exc}"
        return
    for fn, res in (
        (lib.ruvllm_supported_isas, ctypes.c_char_p),
        (lib.ruvllm_isa, ctypes.c_char_p),
        (lib.ruvllm_isa_build, ctypes.c_char_p),
        (lib.ruvllm_select_isa, ctypes.c_int),
        (lib.ruvllm_threads, ctypes.c_int),
        (lib.ruvllm_set_threads, ctypes.c_int),
    ):
        fn.restype = res
    lib.ruvllm_select_isa.argtypes = [ctypes.c_char_p]
    lib.ruvllm_set_threads.argtypes = [ctypes.c_int]
    lib.ruvllm_register_region.restype = ctypes.c_int
    lib.ruvllm_register_region.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    _state["lib"] = lib
    _select(lib, os.environ.get("RUVLLM_CPU_ISA", "auto").strip().lower() or "auto")
    lib.ruvllm_set_threads(_default_threads_setting())
    for target, symbol in (
        (W8A8_TARGET, lib.RuvllmW8A8),
        (WXA8_TARGET, lib.RuvllmWxA8),
        (WXA8_PANEL_TARGET, lib.RuvllmWxA8Panel),
        (KXA8_PANEL_TARGET, lib.RuvllmKxA8Panel),
        (EXPERTS_TARGET, lib.RuvllmExperts),
        (EXPERTS_W8A8_TARGET, lib.RuvllmExpertsW8A8),
        (EXPERTS_STORED_TARGET, lib.RuvllmExpertsStored),
        (DECODE_TARGET, lib.RuvllmPagedDecode),
        (PREFILL_TARGET, lib.RuvllmPagedPrefill),
        (LORA_TARGET, lib.RuvllmLora),
        (MEAN_SQUARE_TARGET, lib.RuvllmMeanSquare),
        (FLOAT_PRODUCT_TARGET, lib.RuvllmFloatProduct),
        (W8A8_RESCALE_TARGET, lib.RuvllmW8A8Rescale),
    ):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    log.info(
        "native cpu kernels loaded",
        library=str(path),
        isa=lib.ruvllm_isa().decode(),
        build=lib.ruvllm_isa_build().decode(),
        supported=lib.ruvllm_supported_isas().decode(),
    )


def _select(lib: ctypes.CDLL, name: str) -> None:
    code = lib.ruvllm_select_isa(name.encode())
    if code == 0:
        return
    supported = lib.ruvllm_supported_isas().decode()
    if code == 1:
        raise BackendError(
            f"RUVLLM_CPU_ISA={name}: unknown or not built for this machine (choose auto or one of: {supported})"
        )
    raise BackendError(f"RUVLLM_CPU_ISA={name}: this CPU lacks its instructions (it supports: {supported})")


def available() -> bool:
    """Whether the native kernels are loaded and registered with XLA (loads them once). Raises
    :class:`BackendError` when ``RUVLLM_CPU_ISA`` names a variant this CPU cannot run."""
    with _lock:
        if not _state.get("tried"):
            _state["tried"] = True
            try:
                _load()
            except BackendError:
                _state.pop("lib", None)
                _state["tried"] = False  # say it again on the next call, never run a wrong variant
                raise
            if "lib" not in _state:
                say = log.info if _off() else log.warning
                say("native cpu kernels unavailable; using XLA", reason=_state.get("reason"))
    return "lib" in _state


def library() -> ctypes.CDLL:
    """The loaded native library (its plain C entry points, such as the load-time repack); raises
    :class:`RuntimeError` when the kernels are not available."""
    return _lib()


def _lib() -> ctypes.CDLL:
    if not available():
        raise RuntimeError(f"ruvllm native CPU kernels are not available: {unavailable_reason()}")
    return _state["lib"]  # type: ignore[return-value]


def isa() -> str | None:
    """The ISA variant the kernels run (``avx2``, ``avx512vnni``, ``neon-dotprod``, ...), None when
    the kernels are not loaded."""
    return _lib().ruvllm_isa().decode() if available() else None


def isa_build() -> str | None:
    """The build of the variant that runs: its symbol in the library (``avxvnni_evex`` where the
    ``avxvnni`` code runs EVEX-encoded, on AVX-512 VNNI CPUs without AVX-VNNI), None when not loaded."""
    return _lib().ruvllm_isa_build().decode() if available() else None


def has_vector_path() -> bool:
    """Whether the kernels run a vector variant (the scalar loops are no faster than XLA's float32)."""
    return available() and isa() != "scalar"


def supported_isas() -> list[str]:
    """Variants this CPU can run with the installed library, worst first (empty when not loaded)."""
    return _lib().ruvllm_supported_isas().decode().split(",") if available() else []


def threads() -> int:
    """Threads the kernels split work over (starts their pool)."""
    return int(_lib().ruvllm_threads())


def set_threads(n: int) -> None:
    """Sets the kernels' thread count; only before their first call (the pool starts once)."""
    n = parse_threads(n, "threads")
    got = _lib().ruvllm_set_threads(n)
    if got != n:
        raise BackendError(f"the native kernels already run on {got} threads; set threads before the first step")


@contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Runs the kernels' ``name`` variant inside the block (tests compare variants in one process)."""
    lib = _lib()
    before = lib.ruvllm_isa().decode()
    _select(lib, name)
    try:
        yield
    finally:
        lib.ruvllm_select_isa(before.encode())


def unavailable_reason() -> str | None:
    return None if available() else str(_state.get("reason"))


def _layer_operand(layer: jax.Array) -> jax.Array:
    """The products' layer operand: a scalar layer index, or ``[layer, live rows]`` (rows of ``x``
    past the live ones are padding: the kernels write zeros there and skip their arithmetic)."""
    layer = jnp.asarray(layer, jnp.int32)
    return layer.reshape(()) if layer.size == 1 else layer.reshape(2)


def w8a8_group(
    x: jax.Array, layer: jax.Array, in_scale: jax.Array | None, weights: list[tuple[jax.Array, jax.Array]]
) -> list[jax.Array]:
    """``x @ W_i.T`` for each ``(quant [L?, N, K] int8, scale [L?, N(, 1)] float32)`` of ``weights``
    at layer ``layer`` (0 for unstacked). ``x`` ``[rows, K]`` float32 is multiplied by ``in_scale``
    (``[L?, K]``, the group's shared smoothing factors) and quantized once for the whole group."""
    _lib()
    rows = x.shape[0]
    results = [jax.ShapeDtypeStruct((rows, q.shape[-2]), jnp.float32) for q, _ in weights]
    operands: list[jax.Array] = []
    for q, s in weights:
        operands += [q, s.astype(jnp.float32)]
    scale = jnp.zeros((0,), jnp.float32) if in_scale is None else in_scale.astype(jnp.float32)
    call = jax.ffi.ffi_call(W8A8_TARGET, results)
    return list(call(x.astype(jnp.float32), _layer_operand(layer), scale, *operands))


def _no_offset() -> jax.Array:
    """The offset operand of a symmetric matrix: empty (``m = -2^(bits-1) d``, cpu_kernels.h)."""
    return jnp.zeros((0,), jnp.float16)


def wxa8_group(
    x: jax.Array, layer: jax.Array, weights: list[tuple[jax.Array, jax.Array, jax.Array]], *, panel: bool = False
) -> list[jax.Array]:
    """``x @ W_i.T`` for group-quantized weights ``(codes uint8 [L?, N, K/2 or K], scale float16
    [L?, N, K/32], offset float16 [L?, N, K/32] or None for a symmetric format)`` at ``layer``, with
    ``x`` ``[rows, K]`` quantized to int8 per group of 32 once for the whole group (see
    ``cpu_kernels.h``). With ``panel`` every matrix is in the panel layout of
    :func:`ruvllm_jax.quant.to_panels`."""
    _lib()
    rows = x.shape[0]
    results = [jax.ShapeDtypeStruct((rows, q.shape[-2]), jnp.float32) for q, _, _ in weights]
    operands: list[jax.Array] = []
    for q, d, m in weights:  # m None: a symmetric format (the kernels form -zero_point * d)
        operands += [q, d.astype(jnp.float16), _no_offset() if m is None else m.astype(jnp.float16)]
    call = jax.ffi.ffi_call(WXA8_PANEL_TARGET if panel else WXA8_TARGET, results)
    return list(call(x.astype(jnp.float32), _layer_operand(layer), *operands))


def kxa8_group(x: jax.Array, layer: jax.Array, weights: list[tuple[jax.Array, ...]]) -> list[jax.Array]:
    """``x @ W_i.T`` for panel-layout matrices given as 5-tuples: k-quants ``(codes, D float16
    [L?, N, K/256], Dm float16 [L?, N, K/256], sc int8 [L?, N, K/sub], mn int8 [L?, N, K/sub])`` with
    ``sub`` 16 or 32, or symmetric ``(codes, D, None, sc, None)`` (see ``cpu_kernels.h``, KMatrix), or
    plain group-quantized ``(codes, d, m)`` (3-tuples), mixed freely; ``x`` is quantized once for all
    of them."""
    _lib()
    rows = x.shape[0]
    results = [jax.ShapeDtypeStruct((rows, w[0].shape[-2]), jnp.float32) for w in weights]
    call = jax.ffi.ffi_call(KXA8_PANEL_TARGET, results)
    return list(call(x.astype(jnp.float32), _layer_operand(layer), *_kxa8_operands(weights)))


def _kxa8_operands(weights: list[tuple[jax.Array, ...]]) -> list[jax.Array]:
    """The 5-tuple operands of ``weights`` as :func:`kxa8_group` takes them (3-tuples: plain matrices;
    a None offset or min: symmetric, passed empty)."""
    operands: list[jax.Array] = []
    for w in weights:
        if len(w) == 3:
            w = (*w, jnp.zeros((0,), jnp.int8), jnp.zeros((0,), jnp.int8))
        q, a, b, sc, mn = w
        b = _no_offset() if b is None else b.astype(jnp.float16)
        mn = jnp.zeros((0,), jnp.int8) if mn is None else mn
        operands += [q, a.astype(jnp.float16), b, sc, mn]  # int8, or the kernel refuses them
    return operands


def experts_group(
    x: jax.Array, layer: jax.Array, sizes: jax.Array, weights: list[tuple[jax.Array, ...]]
) -> list[jax.Array]:
    """A mixture of experts' grouped products: ``x`` ``[rows, K]`` holds the (token, expert) rows sorted
    by expert, ``sizes`` ``[E]`` int32 how many rows each expert has (rows past their sum come out 0),
    and each weight (a tuple as :func:`kxa8_group`'s) is stacked ``[L, E, N, ...]`` in the panel
    layout. Row ``r`` of expert ``e``'s group is multiplied by layer ``layer``'s matrix ``e`` only, so
    a step reads the blocks of the experts it chose. ``x`` is quantized once for all the weights."""
    _lib()
    rows = x.shape[0]
    results = [jax.ShapeDtypeStruct((rows, w[0].shape[-2]), jnp.float32) for w in weights]
    call = jax.ffi.ffi_call(EXPERTS_TARGET, results)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    return list(call(x.astype(jnp.float32), layer, jnp.asarray(sizes, jnp.int32), *_kxa8_operands(weights)))


def experts_w8a8_group(
    x: jax.Array, layer: jax.Array, sizes: jax.Array, weights: list[tuple[jax.Array, jax.Array]]
) -> list[jax.Array]:
    """:func:`experts_group` for w8a8 experts: ``(int8 [L, E, N, K], float32 scale [L, E, N(, 1)])``
    pairs, ``x`` quantized once per row as :func:`w8a8_group` does (without smoothing factors)."""
    _lib()
    rows = x.shape[0]
    results = [jax.ShapeDtypeStruct((rows, q.shape[-2]), jnp.float32) for q, _ in weights]
    operands: list[jax.Array] = []
    for q, s in weights:
        operands += [q, s.astype(jnp.float32)]
    call = jax.ffi.ffi_call(EXPERTS_W8A8_TARGET, results)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    return list(call(x.astype(jnp.float32), layer, jnp.asarray(sizes, jnp.int32), *operands))


def register_region(buffer: np.ndarray) -> int:
    """Registers ``buffer``'s bytes (a GGUF file's memory map) for :func:`experts_stored_group` to read
    and returns its handle. The caller keeps ``buffer`` alive while steps may use the handle."""
    return int(_lib().ruvllm_register_region(buffer.ctypes.data, buffer.nbytes))


def experts_stored_group(
    x: jax.Array, layer: jax.Array, sizes: jax.Array, tables: list[tuple[jax.Array, int]]
) -> list[jax.Array]:
    """:func:`experts_group` for experts left as GGUF blocks in a registered region, read as stored:
    each weight is ``(table int32 [L, 5], out features)``, the table holding each layer's (region
    handle, byte offset low and high 32 bits, ggml type id, bytes per row) of its ``[E, out, row
    bytes]`` stack. ``x`` is quantized per row and block of 32 (Q8_0) or 256 (k-quants)."""
    _lib()
    rows = x.shape[0]
    results = [jax.ShapeDtypeStruct((rows, n), jnp.float32) for _, n in tables]
    call = jax.ffi.ffi_call(EXPERTS_STORED_TARGET, results)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    return list(call(x.astype(jnp.float32), layer, jnp.asarray(sizes, jnp.int32), *[t for t, _ in tables]))


def paged_decode(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    tables: jax.Array,
    context: jax.Array,
    first: jax.Array | None = None,
    *,
    scale: float | None = None,
) -> jax.Array:
    """Attention of one token per sequence, ``q`` ``[S, H, D]`` float32, over the paged caches
    ``[L, NB, BS, KVH, D]`` (float32, float16 or bfloat16; 16-bit rows are widened to float32 as
    they are read, exactly) at ``layer`` (read in place), keys ``first[s] .. context[s] - 1`` (``first``
    defaults to 0; a sliding window raises it) through ``tables`` ``[S, Bd]``, scores multiplied by
    ``scale`` (default ``D ** -0.5``). Returns ``[S, H, D]``; a sequence with no key gets zeros."""
    return _paged_attention(DECODE_TARGET, q, k_cache, v_cache, layer, tables, (), context, first, scale)


def _paged_attention(target, q, k_cache, v_cache, layer, tables, extra, context, first, scale) -> jax.Array:
    """The shared call of the paged attention kernels: ``extra`` int32 operands go after the tables."""
    _lib()
    context = jnp.asarray(context, jnp.int32)
    first = jnp.zeros_like(context) if first is None else jnp.asarray(first, jnp.int32)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32),
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32).reshape(()),
        jnp.asarray(tables, jnp.int32),
        *(jnp.asarray(x, jnp.int32) for x in extra),
        context,
        first,
        scale=np.float32(scale),
    )


def paged_prefill(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    tables: jax.Array,
    seq: jax.Array,
    context: jax.Array,
    first: jax.Array | None = None,
    *,
    scale: float | None = None,
) -> jax.Array:
    """Attention of prompt-chunk queries ``q`` ``[N, H, D]`` float32 over the paged caches
    ``[L, NB, BS, KVH, D]`` (element types as :func:`paged_decode`) at ``layer`` (read in place):
    query ``i`` belongs to sequence ``seq[i]`` (a row of ``tables`` ``[S, Bd]``) and sees keys
    ``first[i] .. context[i] - 1`` (``context[i]``: its position + 1; 0 marks padding, which gets
    zeros and costs nothing). Consecutive queries of a sequence share each key load. Returns
    ``[N, H, D]``."""
    return _paged_attention(PREFILL_TARGET, q, k_cache, v_cache, layer, tables, (seq,), context, first, scale)


def lora_delta(x: jax.Array, layer: jax.Array, a: jax.Array, bt: jax.Array, slot: jax.Array, rank: int) -> jax.Array:
    """LoRA updates ``[T, OUT]`` float32 of ``x`` ``[T, IN]`` where token ``t`` uses adapter slot
    ``slot[t]`` (-1: none, zeros): ``B_s (A_s x[t])`` with the slots' factors side by side along the
    rank, ``a`` ``[L, S * rank, IN]`` and ``bt`` ``[L, S * rank, OUT]`` (B transposed, scaled), at
    ``layer``. Costs ``rank * (IN + OUT)`` per token whatever the number of slots."""
    _lib()
    call = jax.ffi.ffi_call(LORA_TARGET, jax.ShapeDtypeStruct((x.shape[0], bt.shape[2]), jnp.float32))
    return call(
        x.astype(jnp.float32),
        jnp.asarray(layer, jnp.int32).reshape(()),
        a.astype(jnp.float32),
        bt.astype(jnp.float32),
        jnp.asarray(slot, jnp.int32),
        rank=np.int64(rank),
    )


def mean_square(x: jax.Array) -> jax.Array:
    """``mean(x * x, axis=-1, keepdims=True)`` of float32 ``x`` (RMSNorm's), each row summed in one
    fixed order (16 lane sums, folded as a fixed tree) whatever the number of rows: batch invariant."""
    _lib()
    call = jax.ffi.ffi_call(MEAN_SQUARE_TARGET, jax.ShapeDtypeStruct((*x.shape[:-1], 1), jnp.float32))
    return call(x.astype(jnp.float32))


def w8a8_rescale(acc: jax.Array, x_scale: jax.Array, w_scale: jax.Array) -> jax.Array:
    """``(float(acc) * x_scale[:, None]) * w_scale[None, :]`` for int32 ``acc`` ``[T, N]``, each product
    rounded as the w8a8 kernels round theirs (XLA would fuse the multiplies into the next operation and
    contract the last one into an FMA there)."""
    _lib()
    # Under vmap (the XLA formulation of w8a8 experts) one call per batch element.
    call = jax.ffi.ffi_call(W8A8_RESCALE_TARGET, jax.ShapeDtypeStruct(acc.shape, jnp.float32), vmap_method="sequential")
    return call(acc.astype(jnp.int32), x_scale.reshape(-1).astype(jnp.float32), w_scale.reshape(-1).astype(jnp.float32))


def float_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` in float32 for ``x`` ``[T, K]`` and ``w`` ``[N, K]``, every output summed in one fixed
    order (16 lane sums, folded as a fixed tree) whatever ``T``: batch invariant (a router's scores)."""
    _lib()
    call = jax.ffi.ffi_call(FLOAT_PRODUCT_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32))
    return call(x.astype(jnp.float32), w.astype(jnp.float32))
