"""What one server instance holds: settings, the loaded model and its engine, limits and metrics."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from ruvllm.backend import ReportsDeviceMemory
from ruvllm.errors import RuvllmError
from ruvllm_server.limits import AdmissionController, TokenBucketLimiter
from ruvllm_server.metrics import ServerMetrics
from ruvllm_server.settings import ServerConfigError, ServerSettings

if TYPE_CHECKING:
    from ruvllm.backend import AdapterLimits
    from ruvllm.engine import AsyncEngine
    from ruvllm.engine.types import EngineStats
    from ruvllm.runtime import LoadedModel
    from ruvllm.tokenizer import Tokenizer
    from ruvllm_server.embeddings import Embedder
    from ruvllm_server.pooling import PoolingService
    from ruvllm_server.reasoning import ReasoningParser
    from ruvllm_server.tools import ToolParser

log = structlog.get_logger("ruvllm.server")


def load_model(settings: ServerSettings) -> LoadedModel:
    """Load ``settings.model`` on the chosen backend (blocking)."""
    from ruvllm.backend import LoadOptions
    from ruvllm.runtime import load_model as runtime_load

    if not settings.model:
        raise ServerConfigError("no model given: pass MODEL to `ruvllm serve` or set RUVLLM_MODEL")
    from ruvllm_server.pooling import load_pooling_model, serves_pooling

    if serves_pooling(settings):  # an embedding or cross-encoder folder: no engine, no KV cache
        return load_pooling_model(settings)  # type: ignore[return-value]
    extra: dict[str, object] = dict(settings.backend_options)
    if settings.threads is not None:
        extra["threads"] = settings.threads
    if settings.device is not None:
        extra["device"] = settings.device
    if settings.tensor_parallel > 1:
        extra["tensor_parallel"] = settings.tensor_parallel
    if (settings.coordinator is None) != (settings.num_processes == 1):
        raise ServerConfigError("a group needs both --coordinator HOST:PORT and --num-processes N (N > 1)")
    if settings.coordinator is not None:  # process 0 of a group (backends that cannot refuse it by name)
        extra.update(coordinator=settings.coordinator, num_processes=settings.num_processes)
    return runtime_load(
        settings.model,
        backend=settings.backend,
        options=LoadOptions(dtype=settings.dtype, extra=extra, max_adapters=settings.max_loras),
        quantization=settings.quantization,
    )


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30}  # fmt: skip


def parse_bytes(text: str | int) -> int:
    """``2GiB``, ``512MiB``, ``1.5G``, ``1000000`` -> bytes."""
    if isinstance(text, int):
        return text
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ServerConfigError(f"kv_cache_memory must be a size such as 2GiB or 512MiB, got {text!r}")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 1:
        raise ServerConfigError(f"kv_cache_memory must be positive, got {text!r}")
    return value


def kv_cache_budget(setting: str | int | None) -> int | None:
    """The KV cache's memory budget: the setting, else None (the engine's default rule,
    :data:`ruvllm.engine.config.DEFAULT_KV_RULE`, sized once the model is loaded)."""
    return None if setting is None else parse_bytes(setting)


def kv_cache_options(settings: ServerSettings) -> dict[str, str]:
    """The backend's KV cache options from the settings (only what differs from its defaults)."""
    out = {}
    if settings.kv_cache_quantization:
        out["quantization"] = settings.kv_cache_quantization
    if settings.kv_cache_dtype != "auto":
        out["dtype"] = settings.kv_cache_dtype
    return out


#: ``gpu_memory_utilization`` where the backend reports device memory and the settings name none.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def device_kv_budget(fraction: float, total: int, used: int) -> int:
    """The KV cache's bytes when weights and cache may use ``fraction`` of a device's ``total`` bytes
    and ``used`` are taken (the weights)."""
    budget = int(fraction * total) - used
    if budget <= 0:
        raise ServerConfigError(
            f"gpu_memory_utilization {fraction}: {int(fraction * total)} of the device's {total} bytes leave nothing "
            f"for the KV cache beside the {used} already in use (raise it, or give kv_cache_memory)"
        )
    return budget


def kv_memory_budget(settings: ServerSettings, model: LoadedModel) -> int | None:
    """The KV cache's memory budget: ``kv_cache_memory``; else, on a device that reports its memory
    (:class:`ruvllm.backend.ReportsDeviceMemory`), ``gpu_memory_utilization`` of it less what is in
    use; else None, the engine's host default (:data:`ruvllm.engine.config.DEFAULT_KV_RULE`)."""
    fraction = settings.gpu_memory_utilization
    if settings.kv_cache_memory is not None:
        if fraction is not None:
            raise ServerConfigError("give kv_cache_memory or gpu_memory_utilization, not both")
        return kv_cache_budget(settings.kv_cache_memory)
    memory = model.model.device_memory() if isinstance(model.model, ReportsDeviceMemory) else None
    if memory is None:
        if fraction is not None:
            raise ServerConfigError(
                f"gpu_memory_utilization needs a device that reports its memory; the {model.backend.name} backend "
                "reports none here (a CPU): size the KV cache with kv_cache_memory"
            )
        return kv_cache_budget(None)
    return device_kv_budget(fraction or DEFAULT_GPU_MEMORY_UTILIZATION, *memory)


def load_adapters(settings: ServerSettings, config: Any) -> dict[str, Any]:
    """The ``--lora name=path`` adapters (PEFT LoRA or X-LoRA), loaded and checked against the base model."""
    from ruvllm.adapters import load_adapter

    out: dict[str, Any] = {}
    for item in settings.lora_modules:
        name, eq, ref = str(item).partition("=")
        name, ref = name.strip(), ref.strip()
        if not eq or not name or not ref:
            raise ServerConfigError(f"--lora {item!r}: give NAME=PATH")
        if name == settings.model_name or name in out:
            raise ServerConfigError(f"--lora {item!r}: the name {name!r} is already taken")
        out[name] = load_adapter(ref, name, config, max_rank=settings.max_lora_rank)
        log.info("lora adapter loaded", name=name, path=ref, rank=out[name].max_rank)
    return out


#: What runtime-loaded adapters are precompiled for when the settings do not bound them: rank (vLLM's
#: default ``max_lora_rank``) and distinct adapters in one step. Steps beyond still run, their shapes
#: compiled when first used (a warning in the log).
RUNTIME_LORA_RANK = 16
RUNTIME_LORAS_PER_STEP = 4


def lora_limits(settings: ServerSettings, adapters: dict[str, Any]) -> AdapterLimits | None:
    """What the ``--lora`` adapters, and with runtime updates the adapters loaded later, ask of steps;
    None when requests can pick no adapter. A step holds at most as many distinct adapters as are
    loaded (with runtime updates: ``max_loras``, else :data:`RUNTIME_LORAS_PER_STEP`)."""
    from ruvllm.backend import LORA_PROJECTIONS, AdapterLimits

    loaded = [a for a in adapters.values() if a.max_rank > 0]
    # An X-LoRA model puts each of its experts in a slot of its own.
    slots = sum(len(getattr(a, "components", (a,))) for a in loaded)
    if settings.enable_lora_runtime_updates:
        rank = settings.max_lora_rank or max([RUNTIME_LORA_RANK, *(a.max_rank for a in loaded)])
        per_step = max(settings.max_loras or RUNTIME_LORAS_PER_STEP, slots)
        return AdapterLimits(rank, LORA_PROJECTIONS, per_step)
    if not loaded:
        return None
    used = {proj for a in loaded for proj in a.projections}
    projections = tuple(p for p in LORA_PROJECTIONS if p in used)
    mixes = max((2 if a.layerwise else 1 for a in loaded if hasattr(a, "layerwise")), default=0)
    return AdapterLimits(max(a.max_rank for a in loaded), projections, slots, mixes)


def check_plugin_options(host: Any, options: dict[str, dict[str, str]]) -> None:
    """Options for a plugin that is not installed are an error, not silently ignored."""
    for name in options:
        if not host.pm.has_plugin(name):
            hint = " (pip install ruvllm-sona)" if name == "sona" else ""
            raise ServerConfigError(f"options given for plugin {name!r}, which is not installed{hint}")


class ServerState:
    def __init__(
        self,
        settings: ServerSettings,
        model: LoadedModel | None = None,
        *,
        start_in_background: bool = False,
        admission: AdmissionController | None = None,
        aliases: tuple[str, ...] = (),
        kv_memory_available: int | None = None,
    ) -> None:
        """``admission``: a server's controller this model shares (several models in one server);
        ``aliases``: other names requests may give it; ``kv_memory_available``: the memory the
        engine's default KV rule sizes within (None: what the machine has left)."""
        self.settings = settings
        self.start_in_background = start_in_background
        self.model_name = settings.model_name
        self.aliases = frozenset(aliases)
        self.kv_memory_available = kv_memory_available
        self.metrics = ServerMetrics()
        self.admission = admission or AdmissionController(settings.max_concurrent, settings.max_queue)
        self.limiter = (
            TokenBucketLimiter(settings.rate_limit, settings.rate_limit_burst) if settings.rate_limit > 0 else None
        )
        self.model: LoadedModel | None = model
        #: An embedding or cross-encoder model's service (then ``model`` and ``engine`` stay None).
        self.pooling: PoolingService | None = None
        self._adopt_pooling()
        self.engine: AsyncEngine | None = None
        self.embedder: Embedder | None = None
        self.max_context = 0
        self.started = int(time.time())
        self._started_monotonic = time.monotonic()
        #: API requests (``/v1/...``, Ollama's ``/api/...``) answered, any status (``/health``'s ``total_requests``).
        self.total_requests = 0
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        #: What start-up is doing once the model is loaded (compiling step shapes), for /ready.
        self.starting: str | None = None
        #: LoRA adapters served by name (``--lora``).
        self.adapters: dict[str, Any] = {}
        #: Whether the plugins' model_loaded hooks ran (model_unloading is owed at stop).
        self.plugins_loaded = False
        #: Finds tool calls in free text (tool_choice auto); set when the engine starts.
        self.tool_parser: ToolParser | None = None
        #: Splits thinking from the answer (``--reasoning-parser``); None: off.
        self.reasoning_parser: type[ReasoningParser] | None = None
        self._loader: asyncio.Task[None] | None = None
        # Every sequence may carry its own adapter: a batch holds up to max_num_seqs of them.
        self.metrics.watch(
            self.engine_stats,
            lambda: (self.admission.running, self.admission.queued),
            settings.max_loras or settings.max_num_seqs,
        )

    # --- lifecycle ------------------------------------------------------------------------------

    def _adopt_pooling(self) -> None:
        from ruvllm.embedding import EmbeddingModel

        if isinstance(self.model, EmbeddingModel):
            from ruvllm_server.pooling import PoolingService

            self.pooling = PoolingService(self.model, self.settings)
            self.model = None

    def _start_pooling(self) -> None:
        assert self.pooling is not None
        self.pooling.start()
        m = self.pooling.model
        self.max_context = m.max_tokens
        self.ready = True
        log.info(
            "model ready", model=self.model_name, kind=m.kind, backend=m.encoder.backend.name,
            max_tokens=m.max_tokens, dimensions=m.dimensions,
        )  # fmt: skip

    async def start(self) -> None:
        """Start the engine; when no model was handed in, load it in the background so /health
        answers at once and /ready turns 200 when loading is done."""
        if self.pooling is not None:
            self._start_pooling()
            return
        if self.model is not None and not self.start_in_background:
            await self._start_engine()
        else:
            self._loader = asyncio.create_task(self._load_then_start())

    async def open(self) -> None:
        """Load the model (unless one was handed in) and start serving it; raises what failed."""
        if self.model is None and self.pooling is None:
            self.model = await anyio.to_thread.run_sync(load_model, self.settings)
            self._adopt_pooling()
        if self.pooling is not None:
            self._start_pooling()
            return
        await self._start_engine()

    def memory_bytes(self) -> int:
        """What the model holds: its weights as the backend reports them (else its files' size) and
        its KV cache (an embedding model: its weights)."""
        from ruvllm.backend import ReportsWeightBytes

        loaded = self.pooling.model.encoder if self.pooling is not None else self.model
        assert loaded is not None
        inner = loaded.model
        weights = inner.weight_bytes if isinstance(inner, ReportsWeightBytes) else loaded.checkpoint.size_bytes
        kv = self.engine.engine.kv_cache_bytes if self.engine is not None else 0
        return int(weights) + int(kv)

    async def _load_then_start(self) -> None:
        try:
            await self.open()
        except Exception as exc:  # any failure to load is reported by /ready, never left at "loading"
            self.load_error = str(exc) if isinstance(exc, RuvllmError) else f"{type(exc).__name__}: {exc}"
            log.error("model failed to load", model=self.settings.model, error=self.load_error)

    async def _start_engine(self) -> None:
        from ruvllm.engine import AsyncEngine, EngineConfig
        from ruvllm_server.embeddings import Embedder

        assert self.model is not None
        s = self.settings
        config = EngineConfig(
            block_size=s.block_size,
            num_blocks=s.num_kv_blocks,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            enable_prefix_caching=s.enable_prefix_caching,
            kv_cache_memory_bytes=kv_memory_budget(s, self.model),
            kv_memory_available=self.kv_memory_available,
            max_step_ms=s.max_step_ms or None,
            max_step_ratio=s.max_step_ratio or None,
            kv_cache_options=kv_cache_options(s),
            sampling=s.sampling,
            precompile_all_logits=s.precompile_prompt_logprobs,
            pipeline_decode=s.pipeline_decode,
            speculative=s.speculative,
            num_speculative_tokens=s.num_speculative_tokens,
            draft_model=s.draft_model,
            draft_quantization=s.draft_quantization,
            draft_vocab_size=s.draft_vocab_size,
        )
        model_context = self.model.config.max_position_embeddings
        if s.max_context is not None and s.max_context > model_context:
            raise ServerConfigError(f"max_context {s.max_context} exceeds the model's context length {model_context}")
        from ruvllm_server.tools import parser_for_template, tool_parsers

        parsers = tool_parsers(self.model.host)
        parser_name = s.tool_call_parser or parser_for_template(self.model.tokenizer.chat_template)
        if parser_name not in parsers:
            raise ServerConfigError(f"unknown tool_call_parser {parser_name!r} (known: {', '.join(sorted(parsers))})")
        self.tool_parser = parsers[parser_name]()
        if s.reasoning_parser is not None:
            from ruvllm_server.reasoning import reasoning_parsers

            found = reasoning_parsers(self.model.host)
            if s.reasoning_parser not in found:
                raise ServerConfigError(
                    f"unknown reasoning_parser {s.reasoning_parser!r} (known: {', '.join(sorted(found))})"
                )
            self.reasoning_parser = found[s.reasoning_parser]
        self.adapters = load_adapters(s, self.model.config)
        # Steps will carry them: the engine's precompile covers those steps.
        self.model.expect_adapters("server.lora", lora_limits(s, self.adapters))
        options = s.effective_plugin_options
        check_plugin_options(self.model.host, options)
        # Plugins set up what they need for the model (SONA attaches its learner here).
        self.model.host.hook.model_loaded(model=self.model, options=options)
        self.plugins_loaded = True
        engine = AsyncEngine(self.model, config)
        if s.precompile:
            await self._precompile(engine)
        engine.start()
        self.engine = engine
        stats = engine.stats()
        # A request must fit in the KV cache on its own, or the engine could never schedule it.
        kv_tokens = stats.blocks_total * s.block_size
        self.max_context = min(s.max_context or model_context, model_context, kv_tokens)
        self.embedder = Embedder(
            self.model, max_tokens=min(s.embedding_max_tokens, model_context), block_size=s.block_size
        )
        self.ready = True
        log.info(
            "model ready",
            model=self.model_name,
            backend=self.model.backend.name,
            max_context=self.max_context,
            kv_blocks=stats.blocks_total,
            kv_block_bytes=engine.engine.block_bytes,
            kv_local_blocks=stats.local_blocks_total or None,
            kv_cache_mib=round(engine.engine.kv_cache_bytes / 2**20, 1),
            kv_cache_budget_mib=(
                None if engine.engine.kv_budget_bytes is None else round(engine.engine.kv_budget_bytes / 2**20, 1)
            ),
        )

    async def _precompile(self, engine: AsyncEngine) -> None:
        """Compile every step shape before /ready turns 200; /ready says how far it got meanwhile."""
        bar = sys.stderr.isatty()

        def progress(done: int, total: int, shape: str, seconds: float) -> None:
            self.starting = f"compiling step shapes: {done}/{total} ({shape})"
            if bar:
                width = 30
                filled = width * done // total
                sys.stderr.write(f"\rcompiling step shapes [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
                if done == total:
                    sys.stderr.write("\n")
                sys.stderr.flush()

        self.starting = "compiling step shapes"
        t0 = time.perf_counter()
        shapes = await anyio.to_thread.run_sync(lambda: engine.engine.precompile(progress))
        self.starting = None
        if shapes:
            log.info(
                "step shapes compiled",
                shapes=len(shapes),
                seconds=round(time.perf_counter() - t0, 1),
                slowest=max(shapes, key=lambda x: x[1])[0],
                set=", ".join(name for name, _ in shapes),
            )

    async def stop(self) -> None:
        """Refuse new work, let running requests finish (up to ``drain_timeout``), stop the engine."""
        self.draining = True
        self.ready = False
        if self._loader is not None and not self._loader.done():
            self._loader.cancel()
        if self.pooling is not None:
            await self.pooling.stop()
        if self.engine is not None:
            try:
                with anyio.fail_after(self.settings.drain_timeout):
                    await self.engine.shutdown(drain=True)
            except TimeoutError:
                log.warning("drain timed out; aborting what is left", seconds=self.settings.drain_timeout)
                await self.engine.shutdown(drain=False)
        if self.plugins_loaded and self.model is not None:
            # Plugins save and release (SONA joins its threads): keep the event loop free meanwhile.
            await anyio.to_thread.run_sync(lambda: self.model.host.hook.model_unloading(model=self.model))
            self.plugins_loaded = False
        if self.model is not None:
            self.model.expect_adapters("server.lora", None)

    # --- accessors ------------------------------------------------------------------------------

    def health_report(self) -> dict[str, float | int]:
        """The RuvLLM MVP's health figures: uptime, API requests answered, the prefix cache's hit rate
        (prompt tokens found / looked up), this process's resident memory, and with speculative
        decoding the draft tokens' acceptance rate."""
        import psutil

        stats = self.engine_stats()
        queried = stats.prefix_cache_queried_tokens if stats is not None else 0
        hits = stats.prefix_cache_hit_tokens if stats is not None else 0
        rate = stats.spec_acceptance_rate if stats is not None else None
        spec = {} if rate is None else {"spec_acceptance_rate": round(rate, 4)}
        return {
            **spec,
            "uptime_seconds": round(time.monotonic() - self._started_monotonic, 3),
            "total_requests": self.total_requests,
            "cache_hit_rate": round(hits / queried, 4) if queried else 0.0,
            "memory_usage_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
        }

    def engine_stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    @property
    def tokenizer(self) -> Tokenizer:
        assert self.model is not None
        return self.model.tokenizer

    @property
    def broken(self) -> str | None:
        """Why the engine stopped working, or None."""
        if self.engine is not None and self.engine.broken:
            return self.engine.broken
        # The backend's own report (e.g. a process of a multi-process group died between steps).
        return self.model.health() if self.model is not None else None

    @property
    def not_ready_reason(self) -> str:
        if self.draining:
            return "the server is shutting down"
        if self.broken:
            return self.broken
        if self.load_error:
            return f"the model failed to load: {self.load_error}"
        if self.starting:
            return self.starting
        return "the model is still loading"
