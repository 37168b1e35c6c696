"""ruvllm's MLX backend: every family of ruvllm.architectures on the Apple GPU (Metal) or the CPU.

Nothing here imports MLX at import time, so the plugin registers (and says it is unavailable) on a
machine without it."""

from typing import Any

__all__ = ["MLXModel", "MLXPagedKVCache"]


def __getattr__(name: str) -> Any:
    if name == "MLXModel":
        from ruvllm_mlx.model import MLXModel

        return MLXModel
    if name == "MLXPagedKVCache":
        from ruvllm_mlx.kv_cache import MLXPagedKVCache

        return MLXPagedKVCache
    raise AttributeError(name)
