"""The serving engine: continuous batching over a paged KV cache.

``LLMEngine`` is synchronous and step-driven; ``AsyncEngine`` runs its steps on a background thread
for asyncio callers. Both take a :class:`~ruvllm.runtime.LoadedModel` and an :class:`EngineConfig`.
"""

from ruvllm.engine.async_engine import AsyncEngine, EngineDeadError
from ruvllm.engine.config import EngineConfig, EngineConfigError, default_num_blocks
from ruvllm.engine.llm_engine import LLMEngine
from ruvllm.engine.types import (
    ChoiceDelta,
    EngineStats,
    GenerationRequest,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)

__all__ = [
    "AsyncEngine",
    "ChoiceDelta",
    "EngineConfig",
    "EngineConfigError",
    "EngineDeadError",
    "EngineStats",
    "GenerationRequest",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "TokenLogprob",
    "default_num_blocks",
]
