"""Several models in one server: loaded when a request names them, unloaded least recently used
(which models, and their settings: :mod:`ruvllm_server.pool_config`).

``ruvllm serve A B C``, ``--models-dir DIR`` or ``--models-config FILE`` make the app's state a
:class:`ModelPool` instead of one :class:`~ruvllm_server.state.ServerState`. The guard middleware
reads the request's ``model`` (its JSON body's ``model``, Ollama's ``name``), asks the pool for
that model's state (:meth:`ModelPool.acquire`: loading it first if needed, waiting at most
``model_load_timeout``) and hands it to the route, which runs exactly as it does with one model.
The lease ends when the response has been sent (a stream: when it ends or the client leaves).

Each model has a :class:`~ruvllm_server.state.ServerState` of its own (engine, KV cache, prefix
cache, compiled steps, LoRA adapters, plugin state such as SONA's): nothing of one reaches another.

Room: a model is charged its weights as the backend holds them (else its files' size) plus its KV
cache, measured once loaded; before its first load it is estimated from its files (x1.25) and its
KV budget. Loading one unloads the least recently used idle models while the charges would exceed
``models_memory`` or the count ``models_max``; a model in use is never unloaded (the load waits
for it, bounded). A model without a KV budget of its own gets the engine's default rule within an
equal share of the budget (``models_memory / models_max`` less its weights), so ``models_max``
such models always fit together.
"""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ruvllm.errors import RuvllmError
from ruvllm_server.errors import APIError, model_not_found
from ruvllm_server.limits import AdmissionController, TokenBucketLimiter
from ruvllm_server.pool_config import ModelSpec
from ruvllm_server.settings import ServerConfigError, ServerSettings

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ruvllm_server.state import ServerState

log = structlog.get_logger("ruvllm.server.models")

#: The first load's estimate of a model's weights, from its files' size.
FILE_ESTIMATE = 1.25
#: ``models_memory``'s default: this share of the memory available at start.
DEFAULT_MEMORY_SHARE = 0.8


@dataclass
class Entry:
    """A model's place in the pool: its state while loaded, and what the pool tracks of it."""

    spec: ModelSpec
    state: ServerState | None = None
    status: str = "unloaded"  # loading, loaded, unloading, failed
    error: str | None = None
    #: Requests holding it (it is never unloaded while any does).
    users: int = 0
    last_used: float = 0.0
    #: When it unloads if still idle (monotonic; None: not while the server runs).
    deadline: float | None = None
    #: Bytes charged against the budget: measured once loaded (kept for the next load's estimate).
    charge: int = 0
    measured: int | None = None
    load_seconds: float | None = None
    #: The keep_alive the last request asked for (None: the model's own).
    keep_alive: float | None = field(default=None)
    keep_alive_given: bool = False


class _ModelMetrics(Collector):
    """Each loaded model's own metrics, with a ``model_name`` label added (as vLLM labels them)."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for entry in self.pool.entries.values():
            state = entry.state
            if state is None or entry.status != "loaded":
                continue
            for family in state.metrics.registry.collect():
                if family.name == "ruvllm_http_requests":
                    continue  # the server counts requests itself (a model's own counter stays at zero)
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                for s in family.samples:
                    merged.add_sample(s.name, {**s.labels, "model_name": entry.spec.name}, s.value, s.timestamp)
        yield from families.values()
        loaded = GaugeMetricFamily("ruvllm_models_loaded", "Models loaded, by model", labels=["model_name"])
        charged = GaugeMetricFamily(
            "ruvllm_model_memory_bytes", "Bytes a loaded model is charged (weights + KV cache)", labels=["model_name"]
        )
        for name, entry in self.pool.entries.items():
            loaded.add_metric([name], 1.0 if entry.status == "loaded" else 0.0)
            if entry.status == "loaded":
                charged.add_metric([name], float(entry.charge))
        yield loaded
        yield charged


class PoolMetrics:
    """The server's own metrics with several models: requests by route, loads and unloads by model,
    and every loaded model's engine metrics labelled with its name."""

    def __init__(self, pool: ModelPool) -> None:
        self.registry = r = CollectorRegistry()  # the models' families are known only at scrape time
        self.http_requests = Counter(
            "ruvllm_http_requests", "HTTP requests by route, method and status", ["route", "method", "status"],
            registry=r,
        )  # fmt: skip
        self.loads = Counter(
            "ruvllm_model_loads", "Model loads by model and outcome", ["model_name", "outcome"], registry=r
        )
        self.unloads = Counter(
            "ruvllm_model_unloads", "Model unloads by model and reason", ["model_name", "reason"], registry=r
        )
        self.load_seconds = Histogram(
            "ruvllm_model_load_seconds", "Seconds from load start to serving", ["model_name"], registry=r,
            buckets=(0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320),
        )  # fmt: skip
        r.register(_ModelMetrics(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _free() -> None:
    """Drop an unloaded model's arrays now (not at some later collection) and give their memory back
    to the system (a backend may have told the allocator to keep freed buffers)."""
    from ruvllm.memory import release_free_memory

    gc.collect()
    release_free_memory()


def _files_bytes(ref: str) -> int:
    from ruvllm.resolve import resolve

    try:
        p = Path(resolve(ref))
    except RuvllmError:
        return 0
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return p.stat().st_size if p.exists() else 0


class ModelPool:
    """The app's state with several models (duck-typed where the middleware and the operations
    routes read a :class:`ServerState`)."""

    def __init__(self, settings: ServerSettings, specs: list[ModelSpec]) -> None:
        from ruvllm.memory import available_memory
        from ruvllm_server.state import parse_bytes

        self.settings = settings
        self.metrics = PoolMetrics(self)
        self.admission = AdmissionController(settings.max_concurrent, settings.max_queue)
        self.limiter = (
            TokenBucketLimiter(settings.rate_limit, settings.rate_limit_burst) if settings.rate_limit > 0 else None
        )
        self.entries: dict[str, Entry] = {s.name: Entry(s) for s in specs}
        self._names: dict[str, Entry] = {}
        for entry in self.entries.values():
            for name in (entry.spec.name, *entry.spec.aliases):
                self._names[name] = entry
        self.default = specs[0].name
        self.budget = (
            parse_bytes(settings.models_memory)
            if settings.models_memory is not None
            else int(DEFAULT_MEMORY_SHARE * available_memory())
        )
        self.models_max = settings.models_max
        self.model_name = self.default
        self.pooling = None
        self.started = int(time.time())
        self._started_monotonic = time.monotonic()
        self.total_requests = 0
        self.ready = False
        self.draining = False
        self.broken: str | None = None
        self._changed: asyncio.Condition | None = None
        self._load_lock: asyncio.Lock | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- names ----------------------------------------------------------------------------------

    def resolve(self, name: str | None) -> Entry:
        """The model ``name`` means (None: the first listed): a name, an alias, Ollama's ``name:latest``,
        or a LoRA adapter a model serves (``--lora`` in its settings); else the dialect's not-found."""
        if name is None or name == "":
            return self.entries[self.default]
        entry = self._names.get(name)
        if entry is None and name.endswith(":latest"):
            entry = self._names.get(name[: -len(":latest")])
        if entry is None:
            for e in self.entries.values():
                adapters = {str(m).partition("=")[0].strip() for m in e.spec.settings.lora_modules}
                if name in adapters or name.removesuffix(":latest") in adapters:
                    entry = e
                    break
        if entry is None:
            raise model_not_found(name)
        return entry

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._changed = asyncio.Condition()
        self._load_lock = asyncio.Lock()
        self._reaper = asyncio.create_task(self._reap())
        self.ready = True
        log.info(
            "serving several models", models=list(self.entries), budget_mib=round(self.budget / 2**20),
            models_max=self.models_max, default=self.default,
        )  # fmt: skip
        for entry in self.entries.values():
            if entry.spec.preload:
                await self.release(entry, await self.acquire(entry))

    async def stop(self) -> None:
        self.draining = True
        self.ready = False
        if self._reaper is not None:
            self._reaper.cancel()
        for entry in self.entries.values():
            if entry.state is not None:
                await entry.state.stop()
                entry.state = None
                entry.status = "unloaded"

    # --- acquire and release --------------------------------------------------------------------

    async def acquire(self, entry: Entry) -> ServerState:
        """``entry``'s state, loaded first if it is not, held until :meth:`release`. Waits at most
        ``model_load_timeout`` seconds (then a 503); a model that failed to load is tried again."""
        assert self._changed is not None
        timeout = self.settings.model_load_timeout
        deadline = time.monotonic() + timeout
        async with self._changed:
            while True:
                if entry.status == "loaded" and entry.state is not None:
                    if entry.state.broken:
                        raise APIError(503, f"the model {entry.spec.name!r} stopped working: {entry.state.broken}",
                                       code="model_failed")  # fmt: skip
                    entry.users += 1
                    entry.last_used = time.monotonic()
                    entry.deadline = None
                    return entry.state
                if entry.status in ("unloaded", "failed"):
                    entry.status, entry.error = "loading", None
                    self._spawn(self._load(entry))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise APIError(
                        503, f"the model {entry.spec.name!r} did not load within {timeout:g}s ({entry.status})",
                        code="model_loading", headers={"Retry-After": "5"},
                    )  # fmt: skip
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    continue
                if entry.status == "failed" and entry.error is not None:
                    raise APIError(500, f"the model {entry.spec.name!r} failed to load: {entry.error}",
                                   code="model_load_failed")  # fmt: skip

    async def release(self, entry: Entry, state: ServerState, keep_alive: float | None = None,
                      keep_alive_given: bool = False) -> None:  # fmt: skip
        """A request is done with ``entry``: it stays loaded for its keep_alive (the request's if it
        gave one, else the model's), then unloads if no request came meanwhile."""
        assert self._changed is not None
        async with self._changed:
            entry.users -= 1
            entry.last_used = time.monotonic()
            if keep_alive_given:
                entry.keep_alive, entry.keep_alive_given = keep_alive, True
            keep = entry.keep_alive if entry.keep_alive_given else entry.spec.keep_alive
            if entry.users == 0:
                entry.deadline = None if keep is None else entry.last_used + keep
            self._changed.notify_all()
        if entry.users == 0 and keep == 0:
            self._spawn(self.unload(entry, "keep_alive"))

    def expires_at(self, entry: Entry) -> float | None:
        """When ``entry`` unloads if no request comes (epoch seconds), or None."""
        if entry.deadline is None:
            return None
        return time.time() + (entry.deadline - time.monotonic())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reap(self) -> None:
        """Unload idle models whose keep_alive has passed."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for entry in list(self.entries.values()):
                due = entry.deadline is not None and now >= entry.deadline
                if due and entry.status == "loaded" and entry.users == 0:
                    await self.unload(entry, "keep_alive")

    # --- loading and unloading ------------------------------------------------------------------

    def _weights_estimate(self, entry: Entry) -> int:
        s = entry.spec.settings
        weights = int(FILE_ESTIMATE * _files_bytes(s.model))
        if s.draft_model and s.draft_model != "same":
            weights += int(FILE_ESTIMATE * _files_bytes(s.draft_model))
        return weights

    def _kv_share(self, entry: Entry, weights: int) -> int | None:
        """The memory the engine's default KV rule sizes within for ``entry`` (None: it has its own)."""
        s = entry.spec.settings
        if s.kv_cache_memory is not None or s.num_kv_blocks is not None:
            return None
        return max(1, self.budget // self.models_max - weights)

    def _estimate(self, entry: Entry) -> tuple[int, int | None]:
        """``(bytes entry will be charged, the memory its default KV rule sizes within)``."""
        from ruvllm.engine.config import DEFAULT_KV_MEMORY_SHARE
        from ruvllm_server.state import kv_cache_budget

        weights = self._weights_estimate(entry)
        share = self._kv_share(entry, weights)
        if entry.measured is not None:
            return entry.measured, share
        s = entry.spec.settings
        if share is not None:
            kv = int(DEFAULT_KV_MEMORY_SHARE * share)
        elif s.kv_cache_memory is not None:
            kv = kv_cache_budget(s.kv_cache_memory) or 0
        else:
            kv = 0  # num_kv_blocks: measured once loaded
        return weights + kv, share

    def _charged(self, but: Entry | None = None) -> tuple[int, int]:
        """``(bytes charged, models counted)`` of the models loaded or loading, other than ``but``."""
        held = [e for e in self.entries.values() if e is not but and e.status in ("loaded", "loading", "unloading")]
        return sum(e.charge for e in held), len(held)

    async def _make_room(self, entry: Entry, need: int) -> None:
        """Unload idle models, least recently used first, until ``need`` more bytes and one more model
        fit; wait (bounded by the caller) while the models that would have to go are in use."""
        assert self._changed is not None
        while True:
            used, count = self._charged(but=entry)
            if used + need <= self.budget and count < self.models_max:
                return
            idle = sorted(
                (e for e in self.entries.values() if e is not entry and e.status == "loaded" and e.users == 0),
                key=lambda e: e.last_used,
            )
            if idle:
                await self.unload(idle[0], "room")
                continue
            if count == 0:
                return  # nothing else is held: it loads alone (its size was checked against the budget)
            async with self._changed:
                await self._changed.wait()

    async def _load(self, entry: Entry) -> None:
        from ruvllm_server.state import ServerState

        assert self._changed is not None and self._load_lock is not None
        name = entry.spec.name
        started = time.monotonic()
        try:
            async with self._load_lock:  # one load at a time: each sees the memory the last one left
                need, share = self._estimate(entry)
                if need > self.budget:
                    raise ServerConfigError(
                        f"it needs about {need / 2**20:.0f} MiB (weights and KV cache), more than models_memory "
                        f"({self.budget / 2**20:.0f} MiB)"
                    )
                entry.charge = need
                await self._make_room(entry, need)
                log.info("model loading", model=name, estimate_mib=round(need / 2**20))
                state = ServerState(entry.spec.settings, admission=self.admission, aliases=entry.spec.aliases,
                                    kv_memory_available=share)  # fmt: skip
                try:
                    await state.open()
                except BaseException:
                    await state.stop()
                    raise
                entry.state = state
                entry.charge = entry.measured = state.memory_bytes()
                entry.load_seconds = time.monotonic() - started
        except Exception as exc:
            entry.error = str(exc) if isinstance(exc, RuvllmError) else f"{type(exc).__name__}: {exc}"
            entry.status, entry.charge = "failed", 0
            self.metrics.loads.labels(name, "failed").inc()
            log.error("model failed to load", model=name, error=entry.error)
        else:
            entry.status = "loaded"
            entry.last_used = time.monotonic()
            self.metrics.loads.labels(name, "loaded").inc()
            self.metrics.load_seconds.labels(name).observe(entry.load_seconds or 0.0)
            log.info("model loaded", model=name, seconds=round(entry.load_seconds or 0.0, 2),
                     memory_mib=round(entry.charge / 2**20, 1))  # fmt: skip
        finally:
            async with self._changed:
                self._changed.notify_all()
        if entry.status == "loaded":
            await self._over_budget(entry)

    async def _over_budget(self, entry: Entry) -> None:
        """After a load measured more than its estimate: unload idle others until the charges fit."""
        used, _ = self._charged()
        for other in sorted(self.entries.values(), key=lambda e: e.last_used):
            if used <= self.budget:
                return
            if other is not entry and other.status == "loaded" and other.users == 0:
                used -= other.charge
                await self.unload(other, "room")

    async def unload(self, entry: Entry, reason: str) -> None:
        """Stop ``entry``'s engine and drop its state (now, or when its last request is done)."""
        assert self._changed is not None
        async with self._changed:
            if entry.status != "loaded" or entry.users > 0:
                return
            entry.status = "unloading"
            state, entry.state = entry.state, None
        try:
            if state is not None:
                await state.stop()
        finally:
            del state
            await anyio.to_thread.run_sync(_free)
            async with self._changed:
                entry.status, entry.charge, entry.deadline = "unloaded", 0, None
                entry.keep_alive_given = False
                self._changed.notify_all()
            self.metrics.unloads.labels(entry.spec.name, reason).inc()
            log.info("model unloaded", model=entry.spec.name, reason=reason)

    # --- reports --------------------------------------------------------------------------------

    def health_report(self) -> dict[str, float | int]:
        import psutil

        queried = hits = 0
        for entry in self.entries.values():
            stats = entry.state.engine_stats() if entry.state is not None else None
            if stats is not None:
                queried += stats.prefix_cache_queried_tokens
                hits += stats.prefix_cache_hit_tokens
        return {
            "uptime_seconds": round(time.monotonic() - self._started_monotonic, 3),
            "total_requests": self.total_requests,
            # The loaded models' prefix caches together (an unloaded model's counts went with it).
            "cache_hit_rate": round(hits / queried, 4) if queried else 0.0,
            "memory_usage_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
        }

    @property
    def not_ready_reason(self) -> str:
        return "the server is shutting down" if self.draining else "the server is starting"
