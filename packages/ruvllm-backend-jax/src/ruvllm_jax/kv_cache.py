"""The host side of the paged KV cache: what a cache's options ask for (:func:`kv_layout`), its bytes
per block, its allocation (one pool, a hybrid cache's two, a two-tier cache's float slots) and
copy-on-write (:class:`BlockCopier`). What the compiled step reads and writes is
:class:`ruvllm_jax.kv_state.KVState`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ruvllm.errors import BackendError, RequestError
from ruvllm_jax.compiled_steps import CompiledCache
from ruvllm_jax.kv_state import KVState, kv_scale_groups
from ruvllm_jax.loading import DTYPES
from ruvllm_jax.model import ModelSpec, bucket
from ruvllm_jax.quant import weight_nbytes
from ruvllm_jax.sharding import empty_cache
from ruvllm_jax.two_tier import HotSlots

#: Full blocks behind a sequence's tail block that an int8 cache keeps in float too (the two tiers).
DEFAULT_RECENT_BLOCKS = 2
#: Sequences a two-tier cache's float slots are sized for when no engine says how many.
DEFAULT_TWO_TIER_SEQS = 64


@dataclass(frozen=True)
class KVLayout:
    """What a cache's options ask for (see :func:`kv_layout`)."""

    quantized: bool
    dtype: str
    #: Two-tier int8 cache: full blocks behind the tail one read from float slots (0: one tier).
    recent: int = 0
    hot_blocks: int | None = None


@dataclass
class JaxKVCache:
    """The paged KV cache of one model. ``state`` is replaced after every step: the step donates the
    old buffers and updates them in place."""

    state: KVState
    num_blocks: int
    block_size: int
    #: Blocks of the windowed layers' pool of a hybrid cache (0: one pool for every layer).
    local_blocks: int = 0
    #: A two-tier cache's float slots of each pool (see :mod:`ruvllm_jax.two_tier`).
    hot: HotSlots | None = None
    local_hot: HotSlots | None = None

    @property
    def nbytes(self) -> int:
        return weight_nbytes(self.state)

    @property
    def compile_key(self) -> tuple:
        """What a compiled step or copy depends on in the cache."""
        hot = self.hot.slots if self.hot is not None else 0
        return self.num_blocks, self.local_blocks, hot, self.block_size, self.state.quantized, self.state.k.dtype


def kv_layout(options: dict[str, Any] | None, model_dtype: str, attention: str) -> KVLayout:
    """What the KV cache ``options`` ask for of a model computing in ``model_dtype`` with
    ``attention``: int8 codes (``quantization``: ``none`` or ``int8``), the float dtype (``dtype``:
    ``auto``, the model's, or one of :data:`DTYPES`), and for int8 the two tiers: ``recent_blocks``
    (default 2; 0: every block int8 only) full blocks behind each sequence's tail block read from
    float slots, ``hot_blocks`` of them (default: sized by the engine through
    :meth:`ruvllm_jax.runner.JaxModel.kv_reserve`, else for 64 sequences)."""
    options = dict(options or {})
    quant = options.pop("quantization", "none")
    dtype = options.pop("dtype", "auto")
    recent = options.pop("recent_blocks", None)
    hot_blocks = options.pop("hot_blocks", None)
    if options:
        raise BackendError(
            f"jax backend: unknown KV cache option(s) {', '.join(sorted(options))} "
            "(it takes quantization, dtype, recent_blocks, hot_blocks)"
        )
    if quant not in ("none", "int8"):
        raise BackendError(f"jax backend: KV cache quantization must be 'none' or 'int8', got {quant!r}")
    if quant == "int8" and attention != "reference":
        raise BackendError("jax backend: an int8 KV cache needs attention='reference' (the Pallas kernels read floats)")
    dtype = model_dtype if dtype == "auto" else dtype
    if dtype not in DTYPES:
        raise BackendError(f"jax backend: KV cache dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    if quant == "int8" and dtype != model_dtype:
        raise BackendError("jax backend: give the KV cache an int8 quantization or a dtype, not both")
    if dtype != model_dtype and attention != "reference":
        raise BackendError(f"jax backend: a {dtype} KV cache under {model_dtype} compute needs attention='reference'")
    if quant != "int8" and (recent is not None or hot_blocks is not None):
        raise BackendError("jax backend: recent_blocks and hot_blocks are for an int8 KV cache (two tiers)")
    recent = DEFAULT_RECENT_BLOCKS if recent is None and quant == "int8" else recent or 0
    if isinstance(recent, bool) or not isinstance(recent, int) or recent < 0:
        raise BackendError(f"jax backend: recent_blocks must be a whole number >= 0, got {recent!r}")
    if hot_blocks is not None and (isinstance(hot_blocks, bool) or not isinstance(hot_blocks, int) or hot_blocks < 1):
        raise BackendError(f"jax backend: hot_blocks must be a whole number >= 1, got {hot_blocks!r}")
    if hot_blocks is not None and not recent:
        raise BackendError("jax backend: hot_blocks needs recent_blocks > 0 (a two-tier cache)")
    return KVLayout(quant == "int8", dtype, recent, hot_blocks)


def block_bytes(spec: ModelSpec, layout: KVLayout, block_size: int) -> int:
    """Keys and values of every layer for ``block_size`` tokens as a cache of ``layout`` stores them:
    its dtype, or int8 codes plus float32 group scales (:class:`ruvllm_jax.kv_state.KVState`)."""
    per_head = spec.head_dim * np.dtype(DTYPES[layout.dtype]).itemsize
    if layout.quantized:
        per_head = spec.head_dim + 4 * kv_scale_groups(spec.head_dim)
    return 2 * spec.num_layers * spec.num_kv_heads * block_size * per_head


def allocate_cache(
    spec: ModelSpec,
    mesh: jax.sharding.Mesh,
    attention: str,
    num_blocks: int,
    block_size: int,
    options: dict[str, Any] | None = None,
) -> JaxKVCache:
    """A zeroed cache (see :meth:`ruvllm_jax.runner.JaxModel.allocate_cache` for the options)."""
    options = dict(options or {})
    local_blocks = options.pop("local_blocks", 0)
    layout = kv_layout(options, spec.dtype, attention)
    quantized, dtype = layout.quantized, layout.dtype
    if num_blocks < 1 or block_size < 1:
        raise BackendError(f"KV cache needs at least one block of one token (got {num_blocks} x {block_size})")
    local_layers = len(spec.local_layers)
    if not isinstance(local_blocks, int) or local_blocks < 0:
        raise BackendError(f"jax backend: local_blocks must be a non-negative integer, got {local_blocks!r}")
    if local_blocks and not local_layers:
        raise BackendError(
            "jax backend: local_blocks (a hybrid KV cache) needs a model that interleaves windowed and global layers"
        )
    if attention == "pallas" and block_size & (block_size - 1):
        raise BackendError(
            f"jax backend: the Pallas attention kernels need a power-of-two block size (got {block_size}); "
            "give another block size or attention='reference'"
        )
    hot = (layout.hot_blocks or DEFAULT_TWO_TIER_SEQS * (layout.recent + 1)) if layout.recent else 0
    kw = dict(quantized=quantized, hot_blocks=hot)

    def slots() -> HotSlots | None:
        return HotSlots(hot, layout.recent, block_size) if hot else None

    if not local_blocks:
        state = empty_cache(spec, mesh, num_blocks, block_size, DTYPES[dtype], **kw)
        return JaxKVCache(state, num_blocks, block_size, hot=slots())
    globals_ = spec.num_layers - local_layers
    state = empty_cache(spec, mesh, num_blocks, block_size, DTYPES[dtype], layers=globals_, **kw)
    local = empty_cache(spec, mesh, local_blocks, block_size, DTYPES[dtype], layers=local_layers, **kw)
    return JaxKVCache(dataclasses.replace(state, local=local), num_blocks, block_size, local_blocks, slots(), slots())


class BlockCopier:
    """Copy-on-write: one compiled copy for every pool of a cache (a hybrid cache's two, a two-tier
    cache's float slots), padded to a power of two of pairs."""

    def __init__(self) -> None:
        self.programs = CompiledCache()

    def copy(self, cache: JaxKVCache, copies: list[tuple[int, int]], local_copies: list[tuple[int, int]] = ()) -> None:
        pools = {"main": (copies, cache.num_blocks)}
        if cache.local_blocks:
            pools["local"] = (local_copies, cache.local_blocks)
        for pairs, blocks in pools.values():  # all checked before any slot moves
            pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
            if pairs.size and (pairs.min() < 0 or pairs.max() >= blocks):
                raise RequestError(f"block copy refers to blocks outside 0..{blocks - 1}")
        for name, (pairs, _) in list(pools.items()):
            slots = cache.hot if name == "main" else cache.local_hot
            if slots is not None:
                hot = [slots.copy(int(a), int(b)) for a, b in pairs]
                pools[f"{name}_hot"] = ([h for h in hot if h is not None], slots.slots)
        n = bucket(max(len(pairs) for pairs, _ in pools.values()))
        idx = {}
        for name, (pairs, blocks) in pools.items():
            pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
            src = np.zeros(n, np.int32)
            dst = np.full(n, blocks, np.int32)  # padding copies land out of range and are dropped
            src[: len(pairs)], dst[: len(pairs)] = pairs[:, 0], pairs[:, 1]
            idx[name] = (src, dst)
        cache.state = self.program(n, cache)(cache.state, idx)

    def program(self, n: int, cache: JaxKVCache) -> Any:
        """The compiled copy of ``n`` pairs per pool of ``cache``."""
        key = (n, *cache.compile_key)
        fn = self.programs.get(key)
        if fn is None:
            pair = (jax.ShapeDtypeStruct((n,), np.int32),) * 2
            names = ["main"] + (["local"] if cache.local_blocks else [])
            names += [f"{p}_hot" for p in names] if cache.hot is not None else []
            jitted = jax.jit(copy_blocks, donate_argnums=(0,))
            fn, _ = self.programs.compile(key, lambda: jitted.lower(cache.state, dict.fromkeys(names, pair)).compile())
        return fn


def copy_blocks(state: KVState, pairs: dict[str, tuple[jax.Array, jax.Array]]) -> KVState:
    """``state`` with whole blocks copied (src -> dst, padding dst past the end is dropped) in each
    pool ``pairs`` names: ``main``, ``local`` (a hybrid cache's windowed layers), ``main_hot`` and
    ``local_hot`` (a two-tier cache's float slots)."""

    def copy(a: jax.Array | None, idx: tuple[jax.Array, jax.Array] | None) -> jax.Array | None:
        if a is None or idx is None:
            return a
        src, dst = idx
        return a.at[:, dst].set(a[:, src], mode="drop")

    def pool(s: KVState, name: str) -> KVState:
        blocks, hot = pairs.get(name), pairs.get(f"{name}_hot")
        return dataclasses.replace(
            s,
            k=copy(s.k, blocks),
            v=copy(s.v, blocks),
            k_scale=copy(s.k_scale, blocks),
            v_scale=copy(s.v_scale, blocks),
            hot_k=copy(s.hot_k, hot),
            hot_v=copy(s.hot_v, hot),
        )

    local = None if state.local is None else pool(state.local, "local")
    return dataclasses.replace(pool(state, "main"), local=local)
