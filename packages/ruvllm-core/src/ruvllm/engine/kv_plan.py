"""KV planning: how many blocks the engine's cache gets, in which pools, and the block manager over them.

The rules for a cache of unknown size live in :mod:`ruvllm.engine.config` (:func:`default_num_blocks`,
:func:`default_hybrid_blocks`); this module applies them to a loaded model: what the backend keeps
besides its blocks comes off the memory budget first, and a model that interleaves windowed and
global layers gets a hybrid cache where its backend keeps such pools.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ruvllm.block_manager import BlockManager, HybridBlockManager
from ruvllm.engine.config import EngineConfig, EngineConfigError, default_hybrid_blocks, default_num_blocks

if TYPE_CHECKING:
    from ruvllm.model_config import ModelConfig
    from ruvllm.runtime import LoadedModel


@dataclass
class KVPlan:
    """The KV cache an engine allocates."""

    #: Bytes of one block across every layer, as the backend stores it.
    block_bytes: int
    #: Global-layer blocks (every layer's, without a hybrid cache).
    num_blocks: int
    #: Windowed-layer blocks of a hybrid cache; 0 without one.
    local_blocks: int
    #: Windowed layers in a pool of their own (see :class:`HybridBlockManager`).
    hybrid: bool
    #: Bytes the cache holds: its blocks plus its fixed part.
    kv_cache_bytes: int
    #: Options for the backend's ``allocate_cache`` (the config's, the fixed part's, the pools').
    cache_options: dict[str, Any]

    def block_manager(self, config: EngineConfig, model: ModelConfig) -> BlockManager | HybridBlockManager:
        """The block manager over these blocks, releasing blocks out of ``model``'s sliding window."""
        if self.hybrid:
            return HybridBlockManager(
                self.num_blocks,
                self.local_blocks,
                config.block_size,
                model.hybrid_window,
                enable_prefix_caching=config.enable_prefix_caching,
                eviction=config.eviction,
            )
        return BlockManager(
            self.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            eviction=config.eviction,
            sliding_window=model.uniform_window,
        )


def plan_kv_cache(model: LoadedModel, config: EngineConfig, max_model_len: int) -> KVPlan:
    """Size ``model``'s KV cache under ``config`` for sequences of up to ``max_model_len`` tokens.

    Raises :class:`EngineConfigError` when the memory budget does not cover the cache's fixed part.
    """
    mc = model.config
    block_bytes = model.kv_block_bytes(config.block_size, **config.kv_cache_options)
    hybrid = bool(mc.hybrid_window) and model.capabilities.hybrid_kv
    cache_options = dict(config.kv_cache_options)
    # What the cache holds besides its blocks (a two-tier cache's float slots) comes off the budget.
    reserved, extra = model.kv_reserve(config.block_size, config.max_num_seqs, **config.kv_cache_options)
    cache_options.update(extra)
    sizing = config
    if reserved:
        if config.num_blocks is None and reserved >= config.kv_cache_memory_bytes:
            raise EngineConfigError(
                f"kv_cache_memory_bytes {config.kv_cache_memory_bytes} does not cover the KV cache's "
                f"fixed part ({reserved} bytes for {config.max_num_seqs} sequences: {extra}); "
                "give more memory or fewer sequences"
            )
        sizing = replace(config, kv_cache_memory_bytes=config.kv_cache_memory_bytes - reserved)
    if hybrid:
        num_blocks, local_blocks = default_hybrid_blocks(mc, sizing, max_model_len, block_bytes)
        cache_options["local_blocks"] = local_blocks
        per_layer = block_bytes / mc.num_layers
        local_layers = len(mc.local_layers)
        kv_cache_bytes = reserved + int(
            per_layer * ((mc.num_layers - local_layers) * num_blocks + local_layers * local_blocks)
        )
    else:
        num_blocks = config.num_blocks or default_num_blocks(mc, sizing, max_model_len, block_bytes)
        local_blocks = 0
        kv_cache_bytes = reserved + num_blocks * block_bytes
    return KVPlan(block_bytes, num_blocks, local_blocks, hybrid, kv_cache_bytes, cache_options)
