"""The paged KV cache in MLX arrays, and each step's plan of which cache slots a chunk touches.

Per layer, keys and values are one array each of ``[pool_blocks * block_size, kv_heads, head_dim]``
(slot ``b * block_size + o`` is offset ``o`` of block ``b``), so a step writes every new token of a
layer with one scatter and a chunk reads its positions with one gather. A hybrid cache
(``local_blocks``) gives the windowed layers a pool of their own, read through the chunks'
``local_block_table``. The paging lives here; the model (:mod:`ruvllm_mlx.model`) only attends over
what a plan gathers, as vllm-metal keeps its paged cache apart from the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ruvllm.backend import NO_BLOCK, ForwardBatch, chunk_block_table
from ruvllm.errors import BackendError, RequestError
from ruvllm.model_config import ModelConfig

#: Options :meth:`ruvllm_mlx.model.MLXModel.kv_cache` takes.
KV_CACHE_OPTIONS = ("dtype", "quantization", "local_blocks")
#: KV dtypes by name.
KV_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk of a step: its rows in the step's token matrix, its positions and its slots."""

    rows: slice
    start_pos: int
    end_pos: int
    #: Flat cache slots of positions ``read_from .. end_pos`` (uint32).
    read_slots: mx.array
    adapter: Any
    #: First position any of the chunk's queries reads: where every layer of the pool is windowed,
    #: the first query's window start (a long sequence gathers a window, not its whole context).
    read_from: int = 0


class MLXPagedKVCache:
    """Keys and values of every layer in MLX arrays (see the module doc)."""

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: Any = mx.float32, local_blocks: int = 0
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise BackendError(f"a KV cache needs at least one block of one slot, got {num_blocks} x {block_size}")
        local = set(config.local_layers) if local_blocks else set()
        if local_blocks and not local:
            raise BackendError(
                "local_blocks (a hybrid KV cache) needs a model that interleaves windowed and global layers"
            )
        self.num_blocks, self.block_size, self.local_blocks = num_blocks, block_size, local_blocks
        self.dtype = dtype
        self.layout = (config.num_layers, config.num_kv_heads, config.head_dim)
        self.is_local = [i in local for i in range(config.num_layers)]
        shape = (config.num_kv_heads, config.head_dim)
        sizes = [(local_blocks if loc else num_blocks) * block_size for loc in self.is_local]
        self.k: list[mx.array] = [mx.zeros((n, *shape), dtype) for n in sizes]
        self.v: list[mx.array] = [mx.zeros((n, *shape), dtype) for n in sizes]
        mx.eval(self.k, self.v)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]], local: bool = False) -> None:
        """Copy whole blocks ``(src, dst)`` in order, in every layer of one pool."""
        bs = self.block_size
        for src, dst in pairs:
            src_slots = mx.arange(src * bs, (src + 1) * bs)
            dst_slots = mx.arange(dst * bs, (dst + 1) * bs)
            for li, is_local in enumerate(self.is_local):
                if is_local == local:
                    self.k[li][dst_slots] = self.k[li][src_slots]
                    self.v[li][dst_slots] = self.v[li][src_slots]

    def store(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Write the step's new keys and values ``[T, kv_heads, head_dim]`` at ``slots``; returns the
        layer's arrays as written."""
        self.k[layer][slots] = k.astype(self.dtype)
        self.v[layer][slots] = v.astype(self.dtype)
        return self.k[layer], self.v[layer]


def make_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, options: Mapping[str, Any], model_dtype: str
) -> MLXPagedKVCache:
    """The cache ``options`` ask for; what mlx does not do is refused by name."""
    unknown = sorted(set(options) - set(KV_CACHE_OPTIONS) - {"quantize_old", "recent_blocks"})
    if unknown:
        raise BackendError(
            f"unknown mlx KV cache option {', '.join(map(repr, unknown))} (it takes {', '.join(KV_CACHE_OPTIONS)})"
        )
    quant = options.get("quantize_old", options.get("quantization", "none"))
    if quant != "none" or "recent_blocks" in options:
        raise BackendError(f"mlx has no two-tier KV cache yet (kv cache quantization {quant!r}): use the float cache")
    dtype = options.get("dtype", "auto")
    dtype = model_dtype if dtype == "auto" else dtype
    if dtype not in KV_DTYPES:
        raise BackendError(f"mlx keeps its KV cache in {', '.join(KV_DTYPES)}, not {dtype!r}")
    local = options.get("local_blocks", 0)
    if isinstance(local, bool) or not isinstance(local, int) or local < 0:
        raise BackendError(f"local_blocks must be a whole number of blocks >= 0, got {local!r}")
    return MLXPagedKVCache(config, num_blocks, block_size, KV_DTYPES[dtype], local)


def plan_step(
    config: ModelConfig, batch: ForwardBatch, cache: MLXPagedKVCache, local: bool = False
) -> tuple[list[ChunkPlan], mx.array]:
    """Each chunk's plan in the global pool, or (``local``) in the windowed layers' pool, and the
    step's write slots (every new token's, in row order); everything is checked before the cache is
    touched."""
    bs = cache.block_size
    if batch.block_size != bs:
        raise BackendError(f"batch block_size {batch.block_size} does not match the cache's {bs}")
    pool = cache.local_blocks if local else cache.num_blocks
    for src, dst in batch.local_block_copies if local else batch.block_copies:
        if not (0 <= src < pool and 0 <= dst < pool):
            raise RequestError(f"block copy {src} -> {dst} names a block outside 0..{pool - 1}")
    # Where every layer of this pool is windowed, nothing before the first query's window is read.
    window = config.hybrid_window if local else config.uniform_window
    plans, writes, row = [], [], 0
    for idx, chunk in enumerate(batch.chunks):
        n, start, end = len(chunk.token_ids), chunk.start_pos, chunk.end_pos
        table = chunk_block_table(idx, chunk, local=local, block_size=bs, max_positions=config.max_position_embeddings)
        used = table[: -(-end // bs)]
        # Windowed pools: blocks that fell out of the window (NO_BLOCK) are gathered as block 0 and
        # masked by the window; the new positions' blocks must be real.
        live = used[start // bs :]
        if live.min() < 0 or used.max() >= pool or (used < NO_BLOCK).any() or (not local and used.min() < 0):
            raise RequestError(f"chunk {idx} names a block outside 0..{pool - 1}")
        ids = np.asarray(chunk.token_ids)
        if ids.min() < 0 or ids.max() >= config.vocab_size:
            raise RequestError(f"chunk {idx} has a token id outside 0..{config.vocab_size - 1}")
        pos = np.arange(end)
        slots = np.maximum(used, 0)[pos // bs] * bs + pos % bs
        writes.append(slots[start:])
        read_from = max(0, start - window + 1) if window else 0
        read = mx.array(slots[read_from:].astype(np.uint32))
        plans.append(ChunkPlan(slice(row, row + n), start, end, read, chunk.adapter, read_from))
        row += n
    write_slots = mx.array(np.concatenate(writes).astype(np.uint32)) if writes else mx.zeros((0,), mx.uint32)
    return plans, write_slots
