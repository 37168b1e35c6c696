"""The ruvllm plugin: registers the ``jax`` backend and implements its hooks."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ruvllm import hookimpl
from ruvllm.backend import BackendInfo, ForwardBatch, ForwardOutput, LoadOptions, StepLimits
from ruvllm.checkpoint import Checkpoint

NAME = "jax"


def _jax_importable() -> bool:
    try:
        import jax  # noqa: F401
    except Exception:  # a broken jaxlib install raises more than ImportError
        return False
    return True


@hookimpl
def register_backends(register: Callable[[BackendInfo], None]) -> None:
    register(
        BackendInfo(
            name=NAME,
            description="JAX: one jitted step per shape bucket, paged KV cache on device, int8/int4 weights, "
            "tensor parallelism; Pallas attention kernels on CUDA",
            priority=100,
            available=_jax_importable,
            describe=_describe,
        )
    )


def _describe(checkpoint: Checkpoint) -> list[tuple[str, str]]:
    """What ``ruvllm info`` says of this backend here: the form ``auto`` loads the weights in and the
    CPU kernels (ISA variant, threads) that would multiply them."""
    from ruvllm_jax import native
    from ruvllm_jax.runner import auto_quantization

    rows = [("quantization auto", auto_quantization(checkpoint, LoadOptions(quantization="auto")))]
    if native.available():
        rows.append(("cpu kernels", f"{native.isa()} (this CPU runs: {', '.join(native.supported_isas())})"))
    else:
        rows.append(("cpu kernels", f"none: {native.unavailable_reason()}"))
    return rows


@hookimpl
def load_model(backend: str, checkpoint: Checkpoint, options: LoadOptions) -> Any | None:
    if backend != NAME:
        return None
    from ruvllm_jax.runner import JaxModel

    return JaxModel.load(checkpoint, options)


def _is_ours(model: Any) -> bool:
    # Only a loaded model imports the runner (and jax): other backends' models never pay for it.
    runner = sys.modules.get("ruvllm_jax.runner")
    return runner is not None and isinstance(model, runner.JaxModel)


@hookimpl
def kv_cache(model: Any, num_blocks: int, block_size: int, options: dict[str, Any]) -> Any | None:
    if not _is_ours(model):
        return None
    return model.allocate_cache(num_blocks, block_size, options)


@hookimpl
def kv_block_bytes(model: Any, block_size: int, options: dict[str, Any]) -> int | None:
    if not _is_ours(model):
        return None
    return model.kv_block_bytes(block_size, options)


@hookimpl
def precompile(
    model: Any, cache: Any, limits: StepLimits, progress: Callable[[int, int, str, float], None]
) -> list[tuple[str, float]] | None:
    if not _is_ours(model):
        return None
    return model.precompile(
        cache,
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        max_model_len=limits.max_model_len,
        progress=progress,
    )


@hookimpl
def forward(model: Any, batch: ForwardBatch, cache: Any) -> ForwardOutput | None:
    if not _is_ours(model):
        return None
    return model.forward(batch, cache)
