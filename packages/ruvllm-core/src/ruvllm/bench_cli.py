"""``ruvllm benchmark``: time prefill, time to first token and decode of one model on one backend.

The benchmark drives the backend hooks directly (``LoadedModel.allocate_cache`` / ``forward``), the way
the engine does, without the scheduler: ``batch`` sequences, each with its own block table, are
prefilled in one forward step; the first token of each is picked by greedy argmax on the host (that is
the time to first token); then ``gen_length`` decode steps run the whole batch, feeding back each
sequence's greedy token. Warm-up iterations (compilation, allocator growth) run the same work untimed.
Figures are the median over iterations with min and max as the spread.
"""

from __future__ import annotations

import csv
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from ruvllm import __version__
from ruvllm.backend import ForwardBatch, ReportsWeightBytes, SequenceChunk
from ruvllm.engine.config import EngineConfig
from ruvllm.errors import RuvllmError
from ruvllm.sampling import argmax_rows

if TYPE_CHECKING:
    from ruvllm.runtime import LoadedModel

#: Prompts are cut from this text (repeated as needed), so the model sees real token ids.
PROMPT_TEXT = (
    "A lighthouse keeper on a small northern island kept a logbook for forty years. Every evening he wrote "
    "down the direction of the wind, the height of the waves, the ships that passed and the birds that rested "
    "on the gallery rail. Storms arrived in autumn and stayed until spring; in the calm weeks of summer he "
    "painted the tower, oiled the clockwork that turned the lens and rowed to the mainland for flour, lamp oil "
    "and letters. When the light was finally automated, the logbooks went to the town library, where they "
    "are still read by sailors, scientists and children who want to know what the sea was like long ago. "
)


class BenchmarkSettingsError(RuvllmError):
    """A benchmark setting is out of range or the output format is unknown."""


@dataclass(frozen=True)
class BenchmarkSettings:
    prompt_length: int = 128
    gen_length: int = 32
    batch: int = 1
    iterations: int = 5
    warmup: int = 1
    #: The engine's block size, so the backend pages its KV cache as it does when serving.
    block_size: int = EngineConfig.block_size
    #: The backend's KV cache options (``--kv-cache-dtype``: ``{"dtype": ...}``).
    kv_cache_options: dict[str, Any] = field(default_factory=dict)
    #: Speculative decoding (``ngram``): the iterations then run through the engine (greedy, its
    #: drafts verified), and the report adds the acceptance rate; None: raw forward steps.
    speculative: str | None = None
    num_speculative_tokens: int = 4
    #: ``speculative="draft"`` or ``"ngram+draft"``: the draft model (``same``: the benchmarked
    #: checkpoint), its quantization and its reduced vocabulary (``EngineConfig.draft_vocab_size``).
    draft_model: str | None = None
    draft_quantization: str | None = None
    draft_vocab_size: int | None = None

    def validate(self) -> None:
        """Check what can be checked before the model is loaded."""
        for name in ("prompt_length", "gen_length", "batch", "iterations"):
            value = getattr(self, name)
            if value < 1:
                raise BenchmarkSettingsError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.warmup < 0:
            raise BenchmarkSettingsError(f"--warmup must be 0 or more, got {self.warmup}")
        if self.speculative is not None:
            try:
                self.engine_config().validate()
            except RuvllmError as exc:
                msg = str(exc).replace("num_speculative_tokens", "--num-speculative-tokens")
                raise BenchmarkSettingsError(msg) from None

    def engine_config(self) -> EngineConfig:
        """The engine of a ``speculative`` run: one seat per sequence, no prefix cache (every
        iteration computes its prompts), a draft for every sequence."""
        blocks = -(-(self.prompt_length + self.gen_length + 1 + self.num_speculative_tokens) // self.block_size)
        return EngineConfig(
            block_size=self.block_size,
            num_blocks=blocks * self.batch,
            max_num_seqs=self.batch,
            max_num_batched_tokens=max(2048, self.batch * self.prompt_length),
            enable_prefix_caching=False,
            kv_cache_options=dict(self.kv_cache_options),
            speculative=self.speculative,
            num_speculative_tokens=self.num_speculative_tokens,
            draft_model=self.draft_model,
            draft_quantization=self.draft_quantization,
            draft_vocab_size=self.draft_vocab_size,
            speculative_step_tokens=self.batch * (1 + self.num_speculative_tokens),
        )

    def check_context(self, context_length: int) -> None:
        """The prompt and the fed-back decode tokens must fit the model's context."""
        need = self.prompt_length + self.gen_length
        if need > context_length:
            raise BenchmarkSettingsError(
                f"--prompt-length {self.prompt_length} + --gen-length {self.gen_length} = {need} tokens "
                f"exceeds the model's context of {context_length}"
            )


@dataclass
class IterationTiming:
    """Raw figures of one timed iteration (seconds, bytes)."""

    prefill_s: float  # the prefill forward step of the whole batch
    ttft_s: float  # prefill forward plus picking every sequence's first token
    decode_s: float  # sum of the decode steps (forward plus argmax each)
    decode_step_s: list[float]
    #: The process's peak resident set size so far (``getrusage``): it includes the model load.
    peak_rss_bytes: int | None


@dataclass
class EngineTiming:
    """One iteration's decode steps run through the engine (the same prompts, greedy): each step's
    seconds, and per step the model's forward and the engine's own work around it (scheduling, step
    inputs, sampling, detokenizing, drafting)."""

    decode_step_s: list[float]
    forward_s_per_step: float
    own_s_per_step: float


@dataclass(frozen=True)
class MetricSummary:
    key: str
    label: str
    unit: str
    median: float
    min: float
    max: float


@dataclass
class BenchmarkReport:
    model: str
    path: str
    backend: str
    quantization: str
    settings: BenchmarkSettings
    timings: list[IterationTiming] = field(default_factory=list)
    #: What the backend reports for its weights and KV cache (``weight_bytes`` / ``nbytes``), if it does.
    weight_bytes: int | None = None
    kv_cache_bytes: int | None = None
    #: The compute dtype as applied (``auto`` resolved).
    dtype: str = "float32"
    #: Speculative runs: draft tokens kept / verified over the timed iterations.
    spec_acceptance_rate: float | None = None
    #: The timed iterations' decode run through the engine (beside the raw forward's ``timings``).
    engine: list[EngineTiming] = field(default_factory=list)

    def metrics(self) -> list[MetricSummary]:
        s = self.settings
        per_iteration: list[tuple[str, str, str, Callable[[IterationTiming], float | None]]] = [
            ("ttft_ms", "time to first token", "ms", lambda t: t.ttft_s * 1e3),
            ("prefill_ms", "prefill latency", "ms", lambda t: t.prefill_s * 1e3),
            ("prefill_tok_s", "prefill throughput", "tok/s", lambda t: s.batch * s.prompt_length / t.prefill_s),
            ("decode_step_ms", "decode step latency (mean)", "ms", lambda t: t.decode_s / s.gen_length * 1e3),
            ("decode_tok_s_per_seq", "decode per sequence", "tok/s", lambda t: s.gen_length / t.decode_s),
            ("decode_tok_s_aggregate", "decode aggregate", "tok/s", lambda t: s.batch * s.gen_length / t.decode_s),
            ("peak_rss_bytes", "peak RSS (process)", "bytes", lambda t: t.peak_rss_bytes),
        ]
        out = []
        for key, label, unit, value_of in per_iteration:
            maybe = [value_of(t) for t in self.timings]
            values = [v for v in maybe if v is not None]
            if len(values) < len(maybe):
                continue  # no getrusage on this platform
            out.append(MetricSummary(key, label, unit, statistics.median(values), min(values), max(values)))
        through_engine: list[tuple[str, str, Callable[[EngineTiming], float]]] = [
            ("engine_decode_step_ms", "engine decode step (mean)", lambda e: statistics.fmean(e.decode_step_s)),
            ("engine_forward_ms", "engine step: the forward", lambda e: e.forward_s_per_step),
            ("engine_own_ms", "engine step: the engine's own", lambda e: e.own_s_per_step),
        ]
        for key, label, engine_value in through_engine:
            if self.engine:
                ms = [engine_value(e) * 1e3 for e in self.engine]
                out.append(MetricSummary(key, label, "ms", statistics.median(ms), min(ms), max(ms)))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "path": self.path,
            "backend": self.backend,
            "quantization": self.quantization,
            "dtype": self.dtype,
            "settings": asdict(self.settings),
            "spread": "min and max over the timed iterations",
            "metrics": {
                m.key: {"unit": m.unit, "median": m.median, "min": m.min, "max": m.max} for m in self.metrics()
            },
            "memory": {
                "peak_rss_scope": "whole process, including the model load",
                "weight_bytes": self.weight_bytes,
                "kv_cache_bytes": self.kv_cache_bytes,
            },
            "spec_acceptance_rate": self.spec_acceptance_rate,
            "iterations": [asdict(t) for t in self.timings],
            "engine_iterations": [asdict(e) for e in self.engine],
            "ruvllm_version": __version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        }


# -- running -------------------------------------------------------------------------------------------------


def _peak_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS says bytes, Linux KiB


def benchmark_prompts(model: LoadedModel, settings: BenchmarkSettings) -> list[np.ndarray]:
    """``batch`` prompts of ``prompt_length`` real token ids; sequence ``i`` starts ``i`` tokens later in
    the text, so the sequences differ."""
    text_ids = model.tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    need = settings.prompt_length + settings.batch - 1
    stream = np.resize(np.asarray(text_ids, np.int32), need)  # repeats the text as often as needed
    return [stream[i : i + settings.prompt_length] for i in range(settings.batch)]


class ProgressBar:
    """One ``\\r``-rewritten line on a terminal; redraws at most ten times a second."""

    def __init__(self, stream: TextIO, total: int, width: int = 30) -> None:
        self.stream, self.total, self.width = stream, total, width
        self._last_draw = 0.0

    def update(self, done: int, label: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        frac = min(1.0, done / self.total)
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\rbenchmark [{bar}] {frac:4.0%} {label:<16}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\r" + " " * (self.width + 35) + "\r")
        self.stream.flush()


def run_benchmark(
    model: LoadedModel, settings: BenchmarkSettings, progress: ProgressBar | None = None
) -> BenchmarkReport:
    """Run ``settings.warmup`` untimed and ``settings.iterations`` timed iterations on ``model``.
    ``progress`` is advanced once per forward step; closing it is the caller's job."""
    settings.validate()
    settings.check_context(model.config.max_position_embeddings)
    if settings.speculative is not None:
        return _run_engine_benchmark(model, settings, progress)
    bs = settings.block_size
    prompts = benchmark_prompts(model, settings)
    blocks_per_seq = -(-(settings.prompt_length + settings.gen_length) // bs)
    try:
        cache = model.allocate_cache(blocks_per_seq * settings.batch, bs, **settings.kv_cache_options)
    except MemoryError:
        raise BenchmarkSettingsError(
            f"not enough memory for the KV cache of {settings.batch} sequences of "
            f"{settings.prompt_length + settings.gen_length} tokens; lower --batch or the lengths"
        ) from None
    tables = [np.arange(i * blocks_per_seq, (i + 1) * blocks_per_seq, dtype=np.int32) for i in range(settings.batch)]
    rounds = settings.warmup + settings.iterations
    steps_per_round = 1 + settings.gen_length

    def one_iteration(round_index: int) -> IterationTiming:
        label = (
            f"warm-up {round_index + 1}/{settings.warmup}"
            if round_index < settings.warmup
            else f"iteration {round_index - settings.warmup + 1}/{settings.iterations}"
        )
        done = round_index * steps_per_round
        if progress is not None:
            progress.update(done, label, force=True)
        chunks = [SequenceChunk(p, 0, tables[i]) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        out = model.forward(ForwardBatch(chunks, bs), cache)
        t_prefill = time.perf_counter()
        last = argmax_rows(out.logits).astype(np.int32)
        t_first = time.perf_counter()
        step_times = []
        for step in range(settings.gen_length):
            if progress is not None:
                progress.update(done + 1 + step, label)
            pos = settings.prompt_length + step
            s0 = time.perf_counter()
            chunks = [SequenceChunk(last[i : i + 1], pos, tables[i]) for i in range(settings.batch)]
            out = model.forward(ForwardBatch(chunks, bs), cache)
            last = argmax_rows(out.logits).astype(np.int32)
            step_times.append(time.perf_counter() - s0)
        return IterationTiming(
            prefill_s=t_prefill - t0,
            ttft_s=t_first - t0,
            decode_s=sum(step_times),
            decode_step_s=step_times,
            peak_rss_bytes=_peak_rss_bytes(),
        )

    report = _report(model, settings, _optional_int(getattr(cache, "nbytes", None)))
    for r in range(rounds):
        timing = one_iteration(r)
        if r >= settings.warmup:
            report.timings.append(timing)
    if progress is not None:
        progress.update(rounds * steps_per_round, "the same through the engine", force=True)
    _engine_iterations(model, settings, report)
    if progress is not None:
        progress.update(rounds * steps_per_round, "done", force=True)
    return report


def _run_engine_benchmark(
    model: LoadedModel, settings: BenchmarkSettings, progress: ProgressBar | None
) -> BenchmarkReport:
    """:func:`run_benchmark` through the engine, for speculative decoding: each iteration generates
    ``gen_length + 1`` greedy tokens per sequence; the prefill time is up to every first token, the
    decode time the steps after it (fewer than ``gen_length`` when drafts are kept)."""
    report = _report(model, settings, None)
    report.timings = _engine_iterations(model, settings, report, progress)
    if progress is not None:
        progress.update((settings.warmup + settings.iterations) * (1 + settings.gen_length), "done", force=True)
    return report


def _report(model: LoadedModel, settings: BenchmarkSettings, kv_cache_bytes: int | None) -> BenchmarkReport:
    return BenchmarkReport(
        model=model.name,
        path=str(model.checkpoint.path),
        backend=model.backend.name,
        quantization=model.options.quantization,
        dtype=model.options.dtype,
        settings=settings,
        weight_bytes=_optional_int(model.model.weight_bytes if isinstance(model.model, ReportsWeightBytes) else None),
        kv_cache_bytes=kv_cache_bytes,
    )


def _engine_iterations(
    model: LoadedModel, settings: BenchmarkSettings, report: BenchmarkReport, progress: ProgressBar | None = None
) -> list[IterationTiming]:
    """The benchmark's prompts through :class:`~ruvllm.engine.LLMEngine` (greedy, ``gen_length + 1``
    tokens each, EOS ignored): fills ``report.engine`` (and the acceptance rate of a speculative run)
    and returns the timed iterations' timings as the engine saw them."""
    from ruvllm.engine import GenerationRequest, LLMEngine
    from ruvllm.sampling import SamplingParams

    engine = LLMEngine(model, settings.engine_config())
    if report.kv_cache_bytes is None:
        report.kv_cache_bytes = _optional_int(getattr(engine.cache, "nbytes", None))
    prompts = [p.tolist() for p in benchmark_prompts(model, settings)]
    sampling = SamplingParams(max_tokens=settings.gen_length + 1, temperature=0.0, ignore_eos=True)
    rounds = settings.warmup + settings.iterations
    timings: list[IterationTiming] = []
    drafted = accepted = 0
    for r in range(rounds):
        if progress is not None:
            progress.update(r * (1 + settings.gen_length), f"round {r + 1}/{rounds}", force=True)
        before = engine.stats()
        for i, p in enumerate(prompts):
            engine.add_request(GenerationRequest(p, SamplingParams(**vars(sampling)), request_id=f"{r}-{i}"))
        t0 = time.perf_counter()
        started: set[str] = set()
        while len(started) < len(prompts):
            started |= {o.request_id for o in engine.step() if any(d.token_ids for d in o.deltas)}
        t_first = time.perf_counter()
        first = engine.stats()
        step_times = []
        while engine.has_unfinished():
            s0 = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - s0)
        if r < settings.warmup:
            continue
        after = engine.stats()
        drafted += after.spec_draft_tokens - before.spec_draft_tokens
        accepted += after.spec_accepted_tokens - before.spec_accepted_tokens
        steps = max(1, after.steps - first.steps)
        forward = (after.forward_seconds - first.forward_seconds) / steps
        report.engine.append(
            EngineTiming(step_times, forward, (after.step_seconds - first.step_seconds) / steps - forward)
        )
        timings.append(IterationTiming(t_first - t0, t_first - t0, sum(step_times), step_times, _peak_rss_bytes()))
    if settings.speculative is not None:
        report.spec_acceptance_rate = accepted / drafted if drafted else None
    return timings


def _optional_int(value: object) -> int | None:
    return int(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else None


# -- output --------------------------------------------------------------------------------------------------


def _mib(n: float) -> float:
    return n / 1024**2


def render_table(report: BenchmarkReport) -> str:
    s = report.settings
    lines = [
        f"model     {report.model} ({report.path})",
        f"backend   {report.backend}, quantization {report.quantization}, dtype {report.dtype}",
        f"workload  batch {s.batch} x prompt {s.prompt_length} tokens, {s.gen_length} decode steps; "
        f"{s.iterations} timed iteration(s) after {s.warmup} warm-up",
        "",
    ]
    rows: list[tuple[str, ...]] = [("metric", "unit", "median", "min", "max")]
    for m in report.metrics():
        scale, unit = (_mib, "MiB") if m.unit == "bytes" else ((lambda v: v), m.unit)
        rows.append((m.label, unit, *(f"{scale(v):,.2f}" for v in (m.median, m.min, m.max))))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        label, unit, *numbers = r
        right = [c.rjust(w) for c, w in zip(numbers, widths[2:], strict=True)]
        lines.append("  ".join([label.ljust(widths[0]), unit.ljust(widths[1]), *right]))
    lines.append("")
    lines.append("spread: min and max over the timed iterations; peak RSS is the whole process's (model load included)")
    known = [
        f"{name} {_mib(value):,.1f} MiB"
        for name, value in (("weights", report.weight_bytes), ("KV cache", report.kv_cache_bytes))
        if value is not None
    ]
    if known:
        lines.append(f"backend reports: {', '.join(known)}")
    if s.speculative is not None:
        rate = "no drafts" if report.spec_acceptance_rate is None else f"{report.spec_acceptance_rate:.1%}"
        lines.append(f"speculative {s.speculative}, k {s.num_speculative_tokens}: acceptance {rate} (engine, greedy)")
    return "\n".join(lines) + "\n"


def render_json(report: BenchmarkReport) -> str:
    return json.dumps(report.to_dict(), indent=2) + "\n"


def render_csv(report: BenchmarkReport) -> str:
    s = report.settings
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    settings_columns = ["model", "backend", "quantization", "batch", "prompt_length", "gen_length", "iterations"]
    w.writerow([*settings_columns, "metric", "unit", "median", "min", "max"])
    lead = [report.model, report.backend, report.quantization, s.batch, s.prompt_length, s.gen_length, s.iterations]
    for m in report.metrics():
        w.writerow([*lead, m.key, m.unit, m.median, m.min, m.max])
    for key, value in (("weight_bytes", report.weight_bytes), ("kv_cache_bytes", report.kv_cache_bytes)):
        if value is not None:
            w.writerow([*lead, key, "bytes", value, value, value])
    return buf.getvalue()


RENDERERS: dict[str, Callable[[BenchmarkReport], str]] = {
    "table": render_table,
    "json": render_json,
    "csv": render_csv,
}
FORMATS = tuple(RENDERERS)


def check_format(fmt: str) -> None:
    if fmt not in RENDERERS:
        raise BenchmarkSettingsError(f"unknown --format {fmt!r} (choose from {', '.join(FORMATS)})")


def render(report: BenchmarkReport, fmt: str) -> str:
    check_format(fmt)
    return RENDERERS[fmt](report)
