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
from ruvllm.engine.config import (
    DEFAULT_KV_SEQUENCES,
    EngineConfig,
    EngineConfigError,
    default_hybrid_blocks,
    default_kv_memory,
    default_num_blocks,
)
from ruvllm.memory import available_memory

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
    #: The memory budget the blocks were counted under: the config's, or the default rule's
    #: (:func:`ruvllm.engine.config.default_kv_memory`); None when the config gave ``num_blocks``.
    budget_bytes: int | None = None
    #: Whether :attr:`budget_bytes` came from the default rule.
    default_budget: bool = False

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
    budget, default_budget = config.kv_cache_memory_bytes, False
    if budget is None and config.num_blocks is None:
        # The default rule: what DEFAULT_KV_SEQUENCES sequences of the served context take (the
        # same block count the rule below gives them under no cap), within the memory left now.
        few = replace(config, max_num_seqs=min(config.max_num_seqs, DEFAULT_KV_SEQUENCES), kv_cache_memory_bytes=2**62)
        wanted = reserved + _blocks(mc, few, max_model_len, block_bytes, hybrid)[2]
        available = available_memory()
        if config.kv_memory_available is not None:
            available = min(available, config.kv_memory_available)
        budget, default_budget = default_kv_memory(config, wanted, available), True
    sizing = replace(config, kv_cache_memory_bytes=budget)
    if reserved and budget is not None:
        if config.num_blocks is None and reserved >= budget:
            raise EngineConfigError(
                f"the KV cache's memory budget ({budget} bytes) does not cover its fixed part ({reserved} bytes "
                f"for {config.max_num_seqs} sequences: {extra}); give more memory or fewer sequences"
            )
        sizing = replace(config, kv_cache_memory_bytes=budget - reserved)
    if config.num_blocks:
        num_blocks, local_blocks = config.num_blocks, config.num_blocks if hybrid else 0
        kv_bytes = _bytes(mc, block_bytes, num_blocks, local_blocks, hybrid)
    else:
        num_blocks, local_blocks, kv_bytes = _blocks(mc, sizing, max_model_len, block_bytes, hybrid)
    if hybrid:
        cache_options["local_blocks"] = local_blocks
    return KVPlan(
        block_bytes, num_blocks, local_blocks, hybrid, reserved + kv_bytes, cache_options, budget, default_budget
    )


def _bytes(mc: ModelConfig, block_bytes: int, num_blocks: int, local_blocks: int, hybrid: bool) -> int:
    """Bytes of ``num_blocks`` blocks (and a hybrid cache's ``local_blocks`` windowed-layer blocks)."""
    if not hybrid:
        return num_blocks * block_bytes
    per_layer = block_bytes / mc.num_layers
    local_layers = len(mc.local_layers)
    return int(per_layer * ((mc.num_layers - local_layers) * num_blocks + local_layers * local_blocks))


def _blocks(
    mc: ModelConfig, sizing: EngineConfig, max_model_len: int, block_bytes: int, hybrid: bool
) -> tuple[int, int, int]:
    """(global blocks, windowed blocks, their bytes) by the default rules under ``sizing``'s budget."""
    if hybrid:
        num_blocks, local_blocks = default_hybrid_blocks(mc, sizing, max_model_len, block_bytes)
    else:
        num_blocks, local_blocks = default_num_blocks(mc, sizing, max_model_len, block_bytes), 0
    return num_blocks, local_blocks, _bytes(mc, block_bytes, num_blocks, local_blocks, hybrid)
