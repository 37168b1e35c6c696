"""``ruvllm benchmark`` of an embedding or cross-encoder model: texts per second at a batch.

``batch`` texts of ``text_tokens`` tokens each (cut from one passage at different offsets, so each
text is another; the model's special tokens and prompt come on top; a cut that the tokenizer
decodes into text it then encodes otherwise may be a few tokens off, and the report gives the tokens
a batch really had) go through the model's whole
pipeline (:meth:`EmbeddingModel.embed`: tokenization, the encoder, pooling, Dense, normalization; a
cross-encoder scores ``batch`` pairs instead), ``warmup`` times untimed (compilation, allocator
growth), then ``iterations`` times timed. Figures are the median over the timed iterations with min
and max as the spread.
"""

from __future__ import annotations

import csv
import io
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ruvllm import __version__
from ruvllm.backend import ReportsWeightBytes
from ruvllm.bench_cli import PROMPT_TEXT, BenchmarkSettingsError
from ruvllm.errors import RuvllmError

if TYPE_CHECKING:
    from ruvllm.embedding import EmbeddingModel

#: The passage texts are cut from (repeated as needed): the one generative benchmarks cut prompts from.
PASSAGE = PROMPT_TEXT


#: A setting of an embedding benchmark out of range, or one that means nothing for an encoder.
EmbedBenchmarkError = BenchmarkSettingsError


@dataclass(frozen=True)
class EmbedBenchmarkSettings:
    batch: int = 32
    #: Tokens of each text (before the model's special tokens and prompt).
    text_tokens: int = 128
    iterations: int = 5
    warmup: int = 1

    def validate(self, max_tokens: int | None = None) -> None:
        for name in ("batch", "text_tokens", "iterations"):
            if getattr(self, name) < 1:
                raise EmbedBenchmarkError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise EmbedBenchmarkError(f"warmup must be 0 or more, got {self.warmup}")
        if max_tokens is not None and self.text_tokens > max_tokens:
            raise EmbedBenchmarkError(
                f"--prompt-length {self.text_tokens} is more than the model takes ({max_tokens} tokens with its own)"
            )


@dataclass
class EmbedReport:
    model: str
    path: str
    kind: str
    backend: str
    settings: EmbedBenchmarkSettings
    #: The weights' form as loaded (``LoadOptions.quantization``: none, w8a8).
    quantization: str = "none"
    #: Seconds of each timed iteration, and the tokens one iteration ran (special tokens included).
    seconds: list[float] = field(default_factory=list)
    tokens: int = 0
    weight_bytes: int | None = None
    peak_rss_bytes: int | None = None

    def metrics(self) -> dict[str, dict[str, float | str]]:
        b = self.settings.batch
        rows = {
            "texts_per_s": ("texts/s", [b / s for s in self.seconds]),
            "tokens_per_s": ("tok/s", [self.tokens / s for s in self.seconds]),
            "batch_ms": ("ms", [s * 1e3 for s in self.seconds]),
        }
        return {
            key: {"unit": unit, "median": statistics.median(v), "min": min(v), "max": max(v)}
            for key, (unit, v) in rows.items()
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "path": self.path,
            "kind": self.kind,
            "backend": self.backend,
            "quantization": self.quantization,
            "settings": asdict(self.settings),
            "tokens_per_batch": self.tokens,
            "spread": "min and max over the timed iterations",
            "metrics": self.metrics(),
            "memory": {"weight_bytes": self.weight_bytes, "peak_rss_bytes": self.peak_rss_bytes},
            "seconds": self.seconds,
            "ruvllm_version": __version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        }


def is_embedding_ref(ref: str, cache_dir: str | None = None) -> bool:
    """Whether ``ref`` resolves to an embedding or cross-encoder folder (else: a generative model,
    or nothing, which the generative path reports)."""
    from pathlib import Path

    from ruvllm.embedding import is_encoder_folder
    from ruvllm.resolve import resolve

    try:
        return is_encoder_folder(Path(resolve(ref, cache=cache_dir)))
    except RuvllmError:
        return False


def _peak_rss() -> int | None:
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_embed_benchmark(model: EmbeddingModel, settings: EmbedBenchmarkSettings) -> EmbedReport:
    settings.validate()
    texts = model.pieces(PASSAGE, settings.text_tokens, settings.batch)
    if model.kind == "cross-encoder":
        pairs = [(texts[0], t) for t in texts]
        tokens = model.tokenize_pairs(pairs).tokens

        def one() -> None:
            model.score_pairs(pairs)
    else:
        tokens = model.tokenize(texts).tokens

        def one() -> None:
            model.embed(texts)

    for _ in range(settings.warmup):
        one()
    seconds = []
    for _ in range(settings.iterations):
        t0 = time.perf_counter()
        one()
        seconds.append(time.perf_counter() - t0)
    inner = model.encoder.model
    return EmbedReport(
        model=model.name,
        path=str(model.root),
        kind=model.kind,
        backend=model.encoder.backend.name,
        settings=settings,
        quantization=inner.options.quantization,
        seconds=seconds,
        tokens=tokens,
        weight_bytes=int(inner.weight_bytes) if isinstance(inner, ReportsWeightBytes) else None,
        peak_rss_bytes=_peak_rss(),
    )


def render_embed(report: EmbedReport, fmt: str) -> str:
    s = report.settings
    metrics = report.metrics()
    if fmt == "json":
        return json.dumps(report.to_dict(), indent=2) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["model", "kind", "backend", "batch", "text_tokens", "iterations", "metric", "unit", "median",
                    "min", "max"])  # fmt: skip
        lead = [report.model, report.kind, report.backend, s.batch, s.text_tokens, s.iterations]
        for key, m in metrics.items():
            w.writerow([*lead, key, m["unit"], m["median"], m["min"], m["max"]])
        return buf.getvalue()
    lines = [
        f"model     {report.model} ({report.path}), {report.kind}",
        f"backend   {report.backend}, weights {report.quantization}",
        f"workload  batch {s.batch} x {s.text_tokens} tokens a text ({report.tokens} tokens a batch with the "
        f"model's own); {s.iterations} timed iteration(s) after {s.warmup} warm-up",
        "",
    ]
    rows = [("metric", "unit", "median", "min", "max")]
    rows += [
        (k, str(m["unit"]), *(f"{float(m[c]):,.2f}" for c in ("median", "min", "max"))) for k, m in metrics.items()
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        lines.append("  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1]),
                                *(c.rjust(w) for c, w in zip(r[2:], widths[2:], strict=True))]))  # fmt: skip
    lines.append("")
    memory = [
        f"{name} {value / 2**20:,.1f} MiB"
        for name, value in (("weights", report.weight_bytes), ("peak RSS (process)", report.peak_rss_bytes))
        if value is not None
    ]
    if memory:
        lines.append(", ".join(memory))
    return "\n".join(lines) + "\n"
