"""The ``candle-compat`` backend's hooks: it comes in through the same entry-point door as any
third-party backend (``[project.entry-points.ruvllm] candle-compat = "ruvllm_candle_compat.plugin"``).

``LoadOptions.extra["threads"]`` is not applied: NumPy's BLAS takes its thread count from
``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS`` at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ruvllm.backend import BackendInfo, ForwardBatch, ForwardOutput, LoadOptions
from ruvllm.checkpoint import Checkpoint
from ruvllm.errors import BackendError
from ruvllm.hookspecs import hookimpl
from ruvllm_candle_compat.model import CandleCompatModel, PagedKVCache

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
def kv_cache(model: Any, num_blocks: int, block_size: int, options: dict[str, Any]) -> PagedKVCache | None:
    if not isinstance(model, CandleCompatModel):
        return None
    unknown = {k: v for k, v in options.items() if not (k == "dtype" and v == "float32")}
    if unknown:
        raise BackendError(f"candle-compat keeps its KV cache in float32 and takes no other options (got {unknown})")
    return PagedKVCache(model.config, num_blocks, block_size)


@hookimpl
def forward(model: Any, batch: ForwardBatch, cache: Any) -> ForwardOutput | None:
    if not isinstance(model, CandleCompatModel):
        return None
    if not isinstance(cache, PagedKVCache):
        raise BackendError(f"candle-compat needs a cache it allocated, got {type(cache).__name__}")
    if cache.k[0].shape[2:] != (model.config.num_kv_heads, model.config.head_dim) or len(cache.k) != len(model.layers):
        raise BackendError("the KV cache was allocated for a model of another shape")
    return model.forward(batch, cache)
