"""The ``mmap_experts`` load option: a mixture of experts' expert matrices left in the GGUF file's
memory map (the checkpoint's raw block views) instead of copied at load, so a model whose experts do
not fit in RAM still runs on CPU. Each step reads only the chosen experts' blocks; the page cache
holds what was read, and the first tokens page each expert in from disk as it is first chosen.

One home for the option's values, its ``auto`` rule and its refusals, read by every backend that
takes it."""

from __future__ import annotations

from typing import Any

from ruvllm.checkpoint import Checkpoint
from ruvllm.errors import BackendError
from ruvllm.memory import available_memory

#: The option's values (a bool is taken as ``true`` / ``false``).
MMAP_EXPERTS_VALUES = ("auto", "true", "false")
#: ``auto`` maps the experts when their float32 copy would take more than this share of the memory
#: available now (the rest of the model, the KV cache and the page cache need the remainder).
AUTO_SHARE = 0.5


def experts_float_bytes(checkpoint: Checkpoint) -> int:
    """Bytes of every expert matrix (gate, up, down of every expert in every layer) as float32."""
    cfg = checkpoint.config
    return cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.expert_intermediate_size * 4


def experts_file_bytes(checkpoint: Checkpoint) -> int:
    """Bytes of every expert matrix as a GGUF file stores them (about what a backend that copies the
    file's blocks into its own quantized form holds)."""
    cfg = checkpoint.config
    return sum(
        checkpoint.raw_tensor(f"model.layers.{layer}.mlp.experts.0.{proj}.weight").data.nbytes * cfg.num_experts
        for layer in range(cfg.num_layers)
        for proj in ("gate_proj", "up_proj", "down_proj")
    )


def mmap_experts_option(value: Any, checkpoint: Checkpoint, backend: str, copy_bytes: int | None = None) -> bool:
    """Whether ``checkpoint``'s experts stay mapped for option value ``value`` (``auto``, ``true``,
    ``false`` or a bool); ``auto``: when the file's blocks can be mapped and the backend's copy of the
    experts (``copy_bytes``; default their float32 size, :func:`experts_float_bytes`) would take more
    than :data:`AUTO_SHARE` of :func:`available_memory`. Raises :class:`BackendError` naming the option
    for a bad value, or ``true`` where nothing can be mapped."""
    text = ("true" if value else "false") if isinstance(value, bool) else str(value).strip().lower()
    if text not in MMAP_EXPERTS_VALUES:
        raise BackendError(f"{backend}: mmap_experts must be one of {', '.join(MMAP_EXPERTS_VALUES)}, got {value!r}")
    if text == "false":
        return False
    mappable = checkpoint.format == "gguf" and bool(checkpoint.config.num_experts)
    if text == "auto":
        if not mappable:
            return False
        need = experts_float_bytes(checkpoint) if copy_bytes is None else copy_bytes
        return need > AUTO_SHARE * available_memory()
    if not checkpoint.config.num_experts:
        raise BackendError(f"{backend}: mmap_experts=true but {checkpoint.path} is not a mixture of experts")
    if not mappable:
        raise BackendError(
            f"{backend}: mmap_experts=true needs a GGUF file (its experts' blocks are what is mapped); "
            f"{checkpoint.path} is {checkpoint.format}"
        )
    return True
