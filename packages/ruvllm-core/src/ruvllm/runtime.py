"""Load a model with the chosen backend and run forward steps on it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

import structlog

from ruvllm.backend import (
    BACKEND_MODEL_METHODS,
    DTYPE_CHOICES,
    AdapterLimits,
    Backend,
    BackendModel,
    Capabilities,
    ForwardBatch,
    ForwardOutput,
    LoadOptions,
    PreparedStep,
    PreparesSteps,
    ReportsHealth,
    ReservesKV,
    StepLimits,
)
from ruvllm.checkpoint import Checkpoint, open_checkpoint
from ruvllm.errors import BackendError
from ruvllm.model_config import ModelConfig
from ruvllm.plugins import PluginHost, load_plugins
from ruvllm.resolve import file_form, resolve, select

if TYPE_CHECKING:
    from ruvllm.tokenizer import Tokenizer

log = structlog.get_logger("ruvllm.runtime")


@dataclass
class LoadedModel:
    """A checkpoint loaded by one backend: ``model`` is the backend's :class:`BackendModel`, whose
    methods core calls directly."""

    name: str
    checkpoint: Checkpoint
    backend: Backend
    model: BackendModel
    host: PluginHost
    options: LoadOptions
    #: What plugins will ask of steps beyond logits (``"hidden_states"``), declared in their
    #: ``model_loaded`` hook so the engine's precompile covers those step variants.
    step_needs: set[str] = field(default_factory=set)
    #: Adapters steps will carry, by who declared them (see :meth:`expect_adapters`).
    adapter_needs: dict[str, AdapterLimits] = field(default_factory=dict)
    #: What plugins keep for this model, by plugin name (SONA's learner): state lives with its model,
    #: so several models in one process each have their own.
    plugin_state: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def config(self) -> ModelConfig:
        return self.checkpoint.config

    @property
    def capabilities(self) -> Capabilities:
        return self.model.capabilities

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return self.checkpoint.tokenizer()

    def expect_adapters(self, owner: str, limits: AdapterLimits | None) -> None:
        """Declare the adapters ``owner``'s requests will carry (a plugin's ``model_loaded`` hook,
        the server's ``--lora``), so the engine's precompile covers those steps; None withdraws it."""
        if limits is None:
            self.adapter_needs.pop(owner, None)
        else:
            self.adapter_needs[owner] = limits

    @property
    def adapter_limits(self) -> AdapterLimits | None:
        """Bounds covering every declaration (:meth:`AdapterLimits.merge`); None: no adapters."""
        merged: AdapterLimits | None = None
        for limits in self.adapter_needs.values():
            merged = limits.merge(merged)
        return merged

    def allocate_cache(self, num_blocks: int, block_size: int, **options: Any) -> Any:
        return self.model.kv_cache(num_blocks, block_size, options)

    def kv_block_bytes(self, block_size: int, **options: Any) -> int:
        """Bytes per KV block as the backend stores it."""
        return int(self.model.kv_block_bytes(block_size, options))

    def kv_reserve(self, block_size: int, max_num_seqs: int, **options: Any) -> tuple[int, dict[str, Any]]:
        """Bytes a cache of these options holds besides its blocks for an engine of ``max_num_seqs``
        sequences (a two-tier cache's float slots), and the cache options that size it: the
        backend model's :class:`ruvllm.backend.ReservesKV`; (0, {}) without."""
        if not isinstance(self.model, ReservesKV):
            return 0, {}
        nbytes, extra = self.model.kv_reserve(block_size, options, max_num_seqs)
        return int(nbytes), dict(extra)

    def precompile(
        self, cache: Any, limits: StepLimits, progress: Callable[[int, int, str, float], None] | None = None
    ) -> list[tuple[str, float]]:
        """Have the backend compile its step shapes for ``limits``; [] for backends that compile
        nothing."""
        return list(self.model.precompile(cache, limits, progress or (lambda *_: None)))

    def forward(self, batch: ForwardBatch, cache: Any) -> ForwardOutput:
        return self.model.forward(batch, cache)

    def prepare_step(self, batch: ForwardBatch, cache: Any) -> PreparedStep | None:
        """``batch`` (decoding chunks, tokens not yet known) prepared to launch asynchronously, where
        the backend model can (:class:`ruvllm.backend.PreparesSteps`); None otherwise."""
        if not isinstance(self.model, PreparesSteps):
            return None
        return self.model.prepare_step(batch, cache)

    def health(self) -> str | None:
        """Why the backend model can no longer run steps (a process of its group is gone, say), or
        None. Backends report it through :class:`ruvllm.backend.ReportsHealth`."""
        return self.model.health() if isinstance(self.model, ReportsHealth) else None


def load_model(
    ref: str,
    *,
    backend: str | None = None,
    options: LoadOptions | None = None,
    host: PluginHost | None = None,
    cache_dir: str | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """Resolve ``ref``, open the checkpoint and have the chosen backend load it.

    ``quantization`` is what a user typed after ``--quantization``: the seed CLI's file names
    (``q4k``, ``q8``, ``f16``, ``none``) pick which downloaded file of a Hub model loads, in its own
    form; a load form (``auto``, ``w8a8``, ...) applies to the preferred file. Given, it replaces
    ``options.quantization`` (see :func:`ruvllm.resolve.select`); without it a Hub model loads its
    first downloaded of q4k, q8, f16, none with ``options`` as they are."""
    host = host or load_plugins()
    chosen = host.choose_backend(backend)
    options = options or LoadOptions()
    if options.dtype not in DTYPE_CHOICES:  # before anything loads
        raise BackendError(f"unknown dtype {options.dtype!r} (choose from {', '.join(DTYPE_CHOICES)})")
    if quantization is None:
        path = resolve(ref, cache=cache_dir)
    else:
        path, quantization = select(ref, quantization, cache_dir)
    checkpoint = open_checkpoint(path)
    if checkpoint.config.encoder_only:  # (validates the architecture before a backend spends time on weights)
        what = (
            "bidirectional attention"
            if checkpoint.config.layout == "decoder"
            else f"a {checkpoint.config.layout} encoder"
        )
        raise BackendError(
            f"{ref} is an encoder model ({what}): it embeds and scores, it cannot generate text; "
            "use ruvllm embed, or ruvllm serve for /v1/embeddings, /v1/rerank and /v1/score"
        )
    if quantization is not None:
        options = replace(options, quantization=file_form(checkpoint, quantization))
    t0 = time.perf_counter()
    model = chosen.load(checkpoint, options)
    missing = [m for m in BACKEND_MODEL_METHODS if not callable(getattr(model, m, None))]
    if missing or not isinstance(getattr(model, "capabilities", None), Capabilities):
        what = ", ".join(missing) if missing else "capabilities (a ruvllm.backend.Capabilities)"
        raise BackendError(f"backend {chosen.name!r} loaded {type(model).__name__}, which lacks {what}")
    caps = model.capabilities
    applied = getattr(model, "options", None)
    applied = applied if isinstance(applied, LoadOptions) else options
    if applied.dtype not in caps.dtypes:  # (``auto`` resolved by the backend)
        runs = ", ".join(caps.dtypes)
        raise BackendError(f"backend {chosen.name!r} does not run dtype {applied.dtype!r} (it runs {runs})")
    seconds = round(time.perf_counter() - t0, 2)
    log.debug("model loaded", model=ref, backend=chosen.name, dtype=applied.dtype, seconds=seconds)
    return LoadedModel(ref, checkpoint, chosen, model, host, applied)
