"""The ``candle-compat`` backend's hooks: it comes in through the same entry-point door as any
third-party backend (``[project.entry-points.ruvllm] candle-compat = "ruvllm_candle_compat.plugin"``).

It takes no ``LoadOptions.extra`` (``threads`` included, refused by name): NumPy's BLAS takes its
thread count from ``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS`` at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ruvllm.backend import BackendInfo, ForwardBatch, ForwardOutput, LoadOptions
from ruvllm.checkpoint import Checkpoint
from ruvllm.errors import BackendError
from ruvllm.hookspecs import hookimpl
from ruvllm_candle_compat.kv_cache import KVCache, PagedKVCache, TwoTierKVCache, make_kv_cache
from ruvllm_candle_compat.model import CandleCompatModel

BACKEND_NAME = "candle-compat"


@hookimpl
def register_backends(register: Callable[[BackendInfo], None]) -> None:
    register(
        BackendInfo(
            name=BACKEND_NAME,
            description="NumPy float32 reference backend: Llama family from GGUF or safetensors, paged KV cache",
            priority=10,
        )
    )


@hookimpl
def load_model(backend: str, checkpoint: Checkpoint, options: LoadOptions) -> CandleCompatModel | None:
    if backend != BACKEND_NAME:
        return None
    return CandleCompatModel.from_checkpoint(checkpoint, options)


@hookimpl
def kv_cache(model: Any, num_blocks: int, block_size: int, options: dict[str, Any]) -> KVCache | None:
    """Options: ``quantize_old`` (``"int8"`` / ``"int4"``: the two-tier cache), ``recent_blocks``
    (full blocks kept float32 behind each sequence's tail, default 2), ``dtype`` (``"float32"``)."""
    if not isinstance(model, CandleCompatModel):
        return None
    return make_kv_cache(model.config, num_blocks, block_size, options)


@hookimpl
def kv_block_bytes(model: Any, block_size: int, options: dict[str, Any]) -> int | None:
    """float32 keys and values of every layer (a two-tier cache's blocks start float32 too)."""
    if not isinstance(model, CandleCompatModel):
        return None
    from ruvllm.engine.config import kv_block_bytes as float32_block_bytes

    return float32_block_bytes(model.config, block_size)


@hookimpl
def forward(model: Any, batch: ForwardBatch, cache: Any) -> ForwardOutput | None:
    if not isinstance(model, CandleCompatModel):
        return None
    if not isinstance(cache, (PagedKVCache, TwoTierKVCache)):
        raise BackendError(f"candle-compat needs a cache it allocated, got {type(cache).__name__}")
    if cache.layout != (len(model.layers), model.config.num_kv_heads, model.config.head_dim):
        raise BackendError("the KV cache was allocated for a model of another shape")
    return model.forward(batch, cache)
