"""Load a model through the plugin hooks and run forward steps on it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import structlog

from ruvllm.backend import BackendInfo, ForwardBatch, ForwardOutput, LoadOptions, StepLimits
from ruvllm.checkpoint import Checkpoint, open_checkpoint
from ruvllm.errors import BackendError
from ruvllm.model_config import ModelConfig
from ruvllm.plugins import PluginHost, load_plugins
from ruvllm.resolve import resolve

if TYPE_CHECKING:
    from ruvllm.tokenizer import Tokenizer

log = structlog.get_logger("ruvllm.runtime")


@dataclass
class LoadedModel:
    """A checkpoint loaded by one backend. ``model`` is the backend's own object; core only passes it
    back to the backend's hooks."""

    name: str
    checkpoint: Checkpoint
    backend: BackendInfo
    model: Any
    host: PluginHost
    options: LoadOptions

    @property
    def config(self) -> ModelConfig:
        return self.checkpoint.config

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return self.checkpoint.tokenizer()

    def allocate_cache(self, num_blocks: int, block_size: int, **options: Any) -> Any:
        cache = self.host.hook.kv_cache(model=self.model, num_blocks=num_blocks, block_size=block_size, options=options)
        if cache is None:
            raise BackendError(f"backend {self.backend.name!r} did not allocate a KV cache")
        return cache

    def kv_block_bytes(self, block_size: int, **options: Any) -> int:
        """Bytes per KV block as the backend stores it (float32 keys and values of every layer when
        the backend does not say)."""
        got = self.host.hook.kv_block_bytes(model=self.model, block_size=block_size, options=options)
        if got is None:
            from ruvllm.engine.config import kv_block_bytes

            return kv_block_bytes(self.config, block_size)
        return int(got)

    def precompile(
        self, cache: Any, limits: StepLimits, progress: Callable[[int, int, str, float], None] | None = None
    ) -> list[tuple[str, float]]:
        """Have the backend compile its step shapes for ``limits``; [] for backends that compile
        nothing."""
        got = self.host.hook.precompile(
            model=self.model, cache=cache, limits=limits, progress=progress or (lambda *_: None)
        )
        return list(got or [])

    def forward(self, batch: ForwardBatch, cache: Any) -> ForwardOutput:
        out = self.host.hook.forward(model=self.model, batch=batch, cache=cache)
        if out is None:
            raise BackendError(f"backend {self.backend.name!r} did not run the forward step")
        return out


def load_model(
    ref: str,
    *,
    backend: str | None = None,
    options: LoadOptions | None = None,
    host: PluginHost | None = None,
    cache_dir: str | None = None,
) -> LoadedModel:
    """Resolve ``ref``, open the checkpoint and have the chosen backend load it."""
    host = host or load_plugins()
    info = host.choose_backend(backend)
    options = options or LoadOptions()
    checkpoint = open_checkpoint(resolve(ref, cache=cache_dir))
    _ = checkpoint.config  # validates the architecture before a backend spends time on weights
    t0 = time.perf_counter()
    model = host.hook.load_model(backend=info.name, checkpoint=checkpoint, options=options)
    if model is None:
        raise BackendError(f"backend {info.name!r} did not load {ref!r}")
    log.debug("model loaded", model=ref, backend=info.name, seconds=round(time.perf_counter() - t0, 2))
    # A backend model may expose the options as it applied them (``quantization="auto"`` resolved).
    applied = getattr(model, "options", None)
    return LoadedModel(ref, checkpoint, info, model, host, applied if isinstance(applied, LoadOptions) else options)
