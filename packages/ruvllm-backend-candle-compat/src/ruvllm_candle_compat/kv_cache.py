"""The backend's KV caches: the plain float32 paged cache and the two-tier cache (RuvLLM's design).

Both speak the engine's block ids. A forward step hands each chunk's new keys and values to
``store_and_read`` layer by layer and gets back what that chunk's queries attend over.

The two-tier cache keeps each block of each layer either at full precision (a float32 array) or
quantized (8 or 4-bit codes with per-block scales), never both, so quantizing a block really frees
its float storage. Which blocks a query reads quantized depends only on its own position: at
position ``p`` the blocks of table index ``i < p // block_size - recent_blocks`` are *old* (full,
with at least ``recent_blocks`` full blocks after them), everything later is read at full
precision. A sequence therefore gets the same logits whether its prompt arrives in one chunk, in
pieces or token by token, which is what makes prefill, decode and recompute after preemption agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ruvllm.errors import BackendError
from ruvllm.model_config import ModelConfig

#: ``quantize_old`` values and the bits of their codes.
QUANTIZED_KV_BITS = {"int8": 8, "int4": 4}
#: Full blocks behind a sequence's tail block that stay float32 when ``recent_blocks`` is not given.
DEFAULT_RECENT_BLOCKS = 2
KV_CACHE_OPTIONS = ("dtype", "quantize_old", "recent_blocks", "quantization", "local_blocks")


@dataclass(frozen=True)
class ChunkPlan:
    """Where one chunk's rows sit in the step's token matrix and which cache slots it touches."""

    rows: slice
    start_pos: int
    end_pos: int
    blocks: np.ndarray  # block ids holding positions 0 .. end_pos
    write_slots: np.ndarray  # flat cache slots of positions start_pos .. end_pos
    read_slots: np.ndarray  # flat cache slots of positions 0 .. end_pos
    adapter: Any
    #: First table index any of the chunk's queries reads (a sliding window's); entries before it
    #: may name blocks the sequence released (block 0), which are never touched.
    live_from: int = 0


@dataclass(frozen=True)
class FloatOverlay:
    """Full-precision keys and values of blocks that a multi-token chunk itself pushed out of the
    recent window: its earlier queries still read them unquantized.

    Query ``i`` of the chunk reads position ``j`` in ``lo .. lo + len(k)`` from here when
    ``j >= quantized_until[i]``, otherwise (like every later step) the quantized values."""

    lo: int
    k: np.ndarray  # [hi - lo, kv_heads, head_dim]
    v: np.ndarray
    quantized_until: np.ndarray  # [n]: per query, the positions below it are read quantized

    def rows(self, i: int, j: int) -> FloatOverlay:
        return FloatOverlay(self.lo, self.k, self.v, self.quantized_until[i:j])


@dataclass(frozen=True)
class SequenceKV:
    """What one chunk's queries attend over: keys and values of positions ``0 .. end_pos`` as its
    last query reads them, plus the overlay for its earlier queries (two-tier cache only)."""

    k: np.ndarray  # [end_pos, kv_heads, head_dim]
    v: np.ndarray
    overlay: FloatOverlay | None = None


def _local_flags(config: ModelConfig, local_blocks: int) -> list[bool]:
    """Per layer, whether it keeps its blocks in the windowed layers' own pool: the windowed layers
    of a hybrid cache (``local_blocks`` > 0, a model interleaving windowed and global layers)."""
    local = set(config.local_layers) if local_blocks else set()
    if local_blocks and not local:
        raise BackendError("local_blocks (a hybrid KV cache) needs a model that interleaves windowed and global layers")
    return [i in local for i in range(config.num_layers)]


class PagedKVCache:
    """Per-layer keys and values, ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32 each;
    with ``local_blocks`` (a hybrid cache) the windowed layers have a pool of that many blocks of
    their own, addressed by the chunks' ``local_block_table``."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, local_blocks: int = 0) -> None:
        _check_size(num_blocks, block_size)
        self.num_blocks = num_blocks
        self.local_blocks = local_blocks
        self.block_size = block_size
        self.layout = (config.num_layers, config.num_kv_heads, config.head_dim)
        self.is_local = _local_flags(config, local_blocks)
        shape = (block_size, config.num_kv_heads, config.head_dim)
        sizes = [local_blocks if loc else num_blocks for loc in self.is_local]
        self.k: list[np.ndarray] = [np.zeros((n, *shape), np.float32) for n in sizes]
        self.v: list[np.ndarray] = [np.zeros((n, *shape), np.float32) for n in sizes]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def copy_block(self, src: int, dst: int, local: bool = False) -> None:
        """Copy a block in the layers of one pool: the global one, or (``local``) the windowed
        layers' own of a hybrid cache (without one, every layer is in the global pool)."""
        for layer_k, layer_v, is_local in zip(self.k, self.v, self.is_local, strict=True):
            if is_local == local:
                layer_k[dst] = layer_k[src]
                layer_v[dst] = layer_v[src]

    def store_and_read(self, layer: int, plan: ChunkPlan, k_new: np.ndarray, v_new: np.ndarray) -> SequenceKV:
        k_slots = self.k[layer].reshape(-1, *self.layout[1:])
        v_slots = self.v[layer].reshape(-1, *self.layout[1:])
        k_slots[plan.write_slots] = k_new
        v_slots[plan.write_slots] = v_new
        return SequenceKV(k_slots[plan.read_slots], v_slots[plan.read_slots])


# -- quantized blocks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedTensor:
    """``codes * scale + low`` approximates a float32 tensor (asymmetric: all ``2**bits`` levels
    are used whatever the offset). 4-bit codes are packed two per byte along the last axis."""

    codes: np.ndarray  # uint8
    scale: np.ndarray  # float16 (float32 where float16 would overflow), broadcasts against the codes
    low: np.ndarray  # same dtype and shape as scale

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.low.nbytes


def quantize(x: np.ndarray, bits: int, axis: int | tuple[int, ...]) -> QuantizedTensor:
    """Quantize ``x`` with one scale and offset per slice along ``axis`` (the axes reduced over)."""
    levels = (1 << bits) - 1
    low = _half_toward(x.min(axis=axis, keepdims=True), -np.inf)
    scale = _half_toward((x.max(axis=axis, keepdims=True) - low) / np.float32(levels), np.inf)
    scale[scale == 0] = 1.0  # a constant slice: every code is 0 and decodes to ``low`` exactly
    with np.errstate(invalid="ignore"):  # NaN keys stay NaN: ``low`` of their slice is NaN
        codes = np.clip(np.rint((x - low) / scale), 0, levels).astype(np.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantizedTensor(codes, scale, low)


def _half_toward(x: np.ndarray, direction: float) -> np.ndarray:
    """``x`` as float16 values rounded toward ``direction`` (so ``low`` stays at or below every
    value and ``scale`` still spans the range: codes never clip), or float32 where float16 overflows.

    Half-precision scales and offsets cut the per-block overhead in half (measured on SmolLM2: the
    same logit error as float32 ones)."""
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    if not np.isfinite(h).all():
        return x
    wrong_side = h.astype(np.float32) > x if direction < 0 else h.astype(np.float32) < x
    h[wrong_side] = np.nextafter(h[wrong_side], np.float16(direction))
    return h


#: Byte -> its two 4-bit codes as floats (low nibble first): unpacking is one table lookup.
_NIBBLE_PAIRS = np.stack([np.arange(256) & 0x0F, np.arange(256) >> 4], axis=-1).astype(np.float32)


def dequantize_stack(tensors: Sequence[QuantizedTensor], bits: int, out: np.ndarray | None = None) -> np.ndarray:
    """float32 ``[len(tensors), ...]``: the tensors decoded together (one vectorised pass), into
    ``out`` when given (C-contiguous, of that shape)."""
    codes = np.stack([t.codes for t in tensors])
    shape = (*codes.shape[:-1], codes.shape[-1] * (2 if bits == 4 else 1))
    values = np.empty(shape, np.float32) if out is None else out
    if bits == 4:
        np.take(_NIBBLE_PAIRS, codes, axis=0, out=values.reshape(*codes.shape, 2))
    else:
        values[...] = codes
    # Scales and offsets to float32 first: mixed float16 broadcasting runs several times slower.
    values *= np.stack([t.scale for t in tensors]).astype(np.float32)
    values += np.stack([t.low for t in tensors]).astype(np.float32)
    return values


@dataclass(frozen=True)
class QuantizedBlock:
    """One layer's keys and values of one full block. Immutable: a full block is never written
    again, so copies and every sequence sharing the block read the same codes."""

    k: QuantizedTensor
    v: QuantizedTensor

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


#: Axes of a block ``[block_size, kv_heads, head_dim]`` that one scale covers. Keys get a scale per
#: (kv head, channel) over the block's tokens, values one per (token, kv head) over the channels:
#: key outliers sit in fixed channels and would flatten every other channel of a shared scale.
KEY_SCALE_AXES = (0,)
VALUE_SCALE_AXES = (2,)


class TwoTierKVCache:
    """Two-tier paged KV cache: recent blocks in float32, old full blocks quantized to ``bits``.

    Storage is per (layer, block): ``None`` (never written), a float32 ``[block_size, kv_heads,
    head_dim]`` pair, or a :class:`QuantizedBlock`. A block becomes quantized the first time a query
    of a sequence holding it finds it old; a write into a quantized block (the engine reusing a
    freed block, or continuing a copy) turns it back into float32 first, so nothing of an earlier
    owner's tier or scales survives reuse. A shared block has one state: when sequences at
    different positions share it, the one furthest ahead quantizes it and with ``recent_blocks > 0``
    the others then read it quantized slightly earlier than they would alone.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        *,
        bits: int,
        recent_blocks: int,
        local_blocks: int = 0,
    ) -> None:
        _check_size(num_blocks, block_size)
        if bits not in QUANTIZED_KV_BITS.values():
            raise BackendError(f"the two-tier KV cache quantizes to 8 or 4 bits, not {bits}")
        if recent_blocks < 0:
            raise BackendError(f"recent_blocks must be at least 0, got {recent_blocks}")
        if bits == 4 and config.head_dim % 2:
            raise BackendError(f"4-bit KV codes pack channel pairs; head_dim {config.head_dim} is odd")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bits = bits
        self.recent_blocks = recent_blocks
        self.layout = (config.num_layers, config.num_kv_heads, config.head_dim)
        self._block_shape = (block_size, config.num_kv_heads, config.head_dim)
        self.local_blocks = local_blocks
        self.is_local = _local_flags(config, local_blocks)
        sizes = [local_blocks if loc else num_blocks for loc in self.is_local]
        self._k: list[list[np.ndarray | None]] = [[None] * n for n in sizes]
        self._v: list[list[np.ndarray | None]] = [[None] * n for n in sizes]
        self._q: list[list[QuantizedBlock | None]] = [[None] * n for n in sizes]

    # -- memory ---------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the key/value storage resident now (float32 arrays plus codes and scales)."""
        total = 0
        for ks, vs, qs in zip(self._k, self._v, self._q, strict=True):
            total += sum(a.nbytes for a in ks if a is not None) + sum(a.nbytes for a in vs if a is not None)
            total += sum(q.nbytes for q in qs if q is not None)
        return total

    @property
    def float_block_nbytes(self) -> int:
        """Bytes of one float32 block, keys and values of every layer."""
        return 2 * self.layout[0] * int(np.prod(self._block_shape)) * np.dtype(np.float32).itemsize

    @property
    def quantized_block_nbytes(self) -> int:
        """Bytes of one quantized block (codes, scales, offsets), keys and values of every layer."""
        zeros = np.zeros(self._block_shape, np.float32)
        return self.layout[0] * self._encode(zeros, zeros).nbytes

    def bytes_per_token(self) -> dict[str, float]:
        """Bytes one cached token takes in each tier: ``{"float32": ..., "int8" | "int4": ...}``."""
        name = next(k for k, b in QUANTIZED_KV_BITS.items() if b == self.bits)
        bs = self.block_size
        return {"float32": self.float_block_nbytes / bs, name: self.quantized_block_nbytes / bs}

    @property
    def num_float_blocks(self) -> int:
        """Blocks held in float32 (counted in layer 0: after a step every layer agrees)."""
        return sum(a is not None for a in self._k[0])

    @property
    def num_quantized_blocks(self) -> int:
        """Blocks held quantized."""
        return sum(q is not None for q in self._q[0])

    # -- the engine's operations ----------------------------------------------------------------
    def copy_block(self, src: int, dst: int, local: bool = False) -> None:
        for ks, vs, qs, is_local in zip(self._k, self._v, self._q, self.is_local, strict=True):
            if is_local != local:
                continue
            k, v = ks[src], vs[src]
            ks[dst] = None if k is None else k.copy()
            vs[dst] = None if v is None else v.copy()
            qs[dst] = qs[src]  # immutable, so the copy may share it

    def store_and_read(self, layer: int, plan: ChunkPlan, k_new: np.ndarray, v_new: np.ndarray) -> SequenceKV:
        bs, start, end, blocks = self.block_size, plan.start_pos, plan.end_pos, plan.blocks
        ks, vs, qs = self._k[layer], self._v[layer], self._q[layer]
        for i in range(start // bs, (end - 1) // bs + 1):
            b = int(blocks[i])
            k_blk, v_blk = self._writable(layer, b)
            lo, hi = max(start, i * bs), min(end, (i + 1) * bs)
            k_blk[lo - i * bs : hi - i * bs] = k_new[lo - start : hi - start]
            v_blk[lo - i * bs : hi - i * bs] = v_new[lo - start : hi - start]

        # Blocks old for the chunk's last query are quantized now; those its first query still
        # reads at full precision keep their float values for the overlay.
        first_old = max(0, start // bs - self.recent_blocks)
        last_old = max(0, (end - 1) // bs - self.recent_blocks)
        still_float: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for i in range(plan.live_from, last_old):  # (entries before live_from: released, never read)
            b = int(blocks[i])
            k, v = ks[b], vs[b]
            if k is None or v is None:
                continue  # quantized already, or never written
            qs[b] = self._encode(k, v)
            ks[b] = vs[b] = None
            if i >= first_old:
                still_float[i] = (k, v)

        k_seq, v_seq = self._gather(layer, blocks[: -(-end // bs)])
        overlay = None
        if still_float:
            lo, hi = first_old * bs, last_old * bs
            k_over, v_over = k_seq[lo:hi].copy(), v_seq[lo:hi].copy()
            for i, (k, v) in still_float.items():
                k_over[(i - first_old) * bs : (i - first_old + 1) * bs] = k
                v_over[(i - first_old) * bs : (i - first_old + 1) * bs] = v
            positions = np.arange(start, end)
            until = np.maximum(0, positions // bs - self.recent_blocks) * bs
            overlay = FloatOverlay(lo, k_over, v_over, until)
        return SequenceKV(k_seq[:end], v_seq[:end], overlay)

    # -- internals ------------------------------------------------------------------------------
    def _encode(self, k: np.ndarray, v: np.ndarray) -> QuantizedBlock:
        return QuantizedBlock(quantize(k, self.bits, KEY_SCALE_AXES), quantize(v, self.bits, VALUE_SCALE_AXES))

    def _writable(self, layer: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``b``'s float32 storage, created (from its codes if it has any) when missing."""
        ks, vs, qs = self._k[layer], self._v[layer], self._q[layer]
        k, v = ks[b], vs[b]
        if k is not None and v is not None:
            return k, v
        quantized = qs[b]
        if quantized is None:
            k, v = np.zeros(self._block_shape, np.float32), np.zeros(self._block_shape, np.float32)
        else:
            k, v = dequantize_stack([quantized.k], self.bits)[0], dequantize_stack([quantized.v], self.bits)[0]
        ks[b], vs[b], qs[b] = k, v, None
        return k, v

    def _gather(self, layer: int, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 ``[len(blocks) * block_size, kv_heads, head_dim]`` keys and values of ``blocks``,
        quantized ones decoded."""
        ks, vs, qs = self._k[layer], self._v[layer], self._q[layer]
        k_out = np.empty((len(blocks), *self._block_shape), np.float32)
        v_out = np.empty_like(k_out)
        quantized: list[int] = []
        for i, b in enumerate(blocks.tolist()):
            k = ks[b]
            if k is not None:
                k_out[i], v_out[i] = k, vs[b]
            elif qs[b] is not None:
                quantized.append(i)
            else:  # never written, like the plain cache's zeros; never read past a chunk's end anyway
                k_out[i] = v_out[i] = 0.0
        if quantized:
            stored = [q for q in (qs[int(blocks[i])] for i in quantized) if q is not None]
            if quantized[-1] == len(quantized) - 1:  # the usual case: the old blocks lead the table
                dequantize_stack([q.k for q in stored], self.bits, out=k_out[: len(stored)])
                dequantize_stack([q.v for q in stored], self.bits, out=v_out[: len(stored)])
            else:
                k_out[quantized] = dequantize_stack([q.k for q in stored], self.bits)
                v_out[quantized] = dequantize_stack([q.v for q in stored], self.bits)
        return k_out.reshape(-1, *self._block_shape[1:]), v_out.reshape(-1, *self._block_shape[1:])


KVCache = PagedKVCache | TwoTierKVCache


def make_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, options: Mapping[str, Any]) -> KVCache:
    """The cache ``options`` ask for (the ``kv_cache`` hook's options, ``EngineConfig.kv_cache_options``).

    ``quantize_old``: ``"int8"`` or ``"int4"`` selects the two-tier cache; absent, the plain float32
    cache (``quantization``, the spelling every backend takes, means the same; ``"none"``: float32).
    ``recent_blocks`` (two-tier only, default 2): full blocks behind a sequence's tail block
    kept in float32. ``dtype`` may only be ``"float32"`` (or ``"auto"``, the same). ``local_blocks``
    (a model interleaving windowed and global layers): the windowed layers' own pool of that many
    blocks (the hybrid KV cache, ``Capabilities.hybrid_kv``).
    """
    if "quantization" in options:  # the backend-neutral spelling (``--kv-cache-quantization``)
        options = dict(options)
        quant = options.pop("quantization")
        if "quantize_old" in options:
            raise BackendError("give quantization or quantize_old, not both")
        if quant != "none":
            options["quantize_old"] = quant
    unknown = sorted(set(options) - set(KV_CACHE_OPTIONS))
    if unknown:
        raise BackendError(
            f"unknown candle-compat KV cache option {', '.join(map(repr, unknown))} "
            f"(it takes {', '.join(KV_CACHE_OPTIONS)})"
        )
    dtype = options.get("dtype", "float32")
    if dtype not in ("float32", "auto"):  # auto: float32, this backend's only KV dtype
        raise BackendError(
            f"candle-compat keeps its KV cache in float32 (got dtype {dtype!r}); "
            "quantize_old='int8' or 'int4' quantizes old blocks"
        )
    local = options.get("local_blocks", 0)
    if isinstance(local, bool) or not isinstance(local, int) or local < 0:
        raise BackendError(f"local_blocks must be a whole number of blocks >= 0, got {local!r}")
    if "quantize_old" not in options:
        if "recent_blocks" in options:
            raise BackendError("recent_blocks only applies to the two-tier cache: give quantize_old='int8' or 'int4'")
        return PagedKVCache(config, num_blocks, block_size, local_blocks=local)
    fmt = options["quantize_old"]
    if fmt not in QUANTIZED_KV_BITS:
        raise BackendError(f"quantize_old must be 'int8' or 'int4', got {fmt!r}")
    recent = options.get("recent_blocks", DEFAULT_RECENT_BLOCKS)
    if isinstance(recent, bool) or not isinstance(recent, int) or recent < 0:
        raise BackendError(f"recent_blocks must be a whole number of blocks >= 0, got {recent!r}")
    return TwoTierKVCache(
        config, num_blocks, block_size, bits=QUANTIZED_KV_BITS[fmt], recent_blocks=recent, local_blocks=local
    )


def _check_size(num_blocks: int, block_size: int) -> None:
    if num_blocks < 1 or block_size < 1:
        raise BackendError(f"a KV cache needs at least one block of one slot, got {num_blocks} x {block_size}")
