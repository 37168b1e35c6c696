"""``ruvllm benchmark`` on the real SmolLM2 model with tiny sizes: every output format parses and its
figures agree with the raw per-iteration timings; it runs on each installed backend; bad settings end
in one line on stderr and a non-zero exit."""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ruvllm.bench_cli import ProgressBar

TINY = ["--prompt-length", "8", "--gen-length", "4", "--iterations", "2", "--warmup", "1", "--batch", "2"]
METRICS = {
    "ttft_ms",
    "prefill_ms",
    "prefill_tok_s",
    "decode_step_ms",
    "decode_tok_s_per_seq",
    "decode_tok_s_aggregate",
    "peak_rss_bytes",
    # The same decode through the engine: its step, and the step's forward and engine's own work.
    "engine_decode_step_ms",
    "engine_forward_ms",
    "engine_own_ms",
}


def run_benchmark_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RUVLLM_LOG": "ERROR"}
    return subprocess.run(
        [sys.executable, "-m", "ruvllm", "benchmark", *args], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.fixture(scope="module")
def candle_json(smollm2_path: Path) -> dict[str, Any]:
    proc = run_benchmark_cli("smollm2", "--backend", "candle-compat", *TINY, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # the progress bar is drawn on terminals only
    return json.loads(proc.stdout)


def test_json_reports_settings_and_positive_metrics(candle_json: dict[str, Any]) -> None:
    r = candle_json
    assert (r["model"], r["backend"], r["quantization"], r["dtype"]) == ("smollm2", "candle-compat", "none", "float32")
    s = r["settings"]
    assert (s["prompt_length"], s["gen_length"], s["iterations"], s["warmup"], s["batch"]) == (8, 4, 2, 1, 2)
    assert set(r["metrics"]) == METRICS
    for key, m in r["metrics"].items():
        assert 0 < m["min"] <= m["median"] <= m["max"], key
    assert r["memory"]["kv_cache_bytes"] > 0
    assert "process" in r["memory"]["peak_rss_scope"]


def test_json_raw_iterations_match_the_summary(candle_json: dict[str, Any]) -> None:
    r = candle_json
    batch, gen = r["settings"]["batch"], r["settings"]["gen_length"]
    its = r["iterations"]
    assert len(its) == r["settings"]["iterations"]  # warm-up iterations are not reported
    for it in its:
        assert len(it["decode_step_s"]) == gen
        assert it["decode_s"] == pytest.approx(sum(it["decode_step_s"]), rel=1e-9)
        assert 0 < it["prefill_s"] <= it["ttft_s"]  # TTFT = prefill forward + picking the first tokens
        assert it["peak_rss_bytes"] > 0
    m = r["metrics"]
    assert m["ttft_ms"]["median"] == pytest.approx(statistics.median(it["ttft_s"] * 1e3 for it in its), rel=1e-9)
    per_seq = [gen / it["decode_s"] for it in its]
    assert m["decode_tok_s_per_seq"]["median"] == pytest.approx(statistics.median(per_seq), rel=1e-9)
    assert (m["decode_tok_s_per_seq"]["min"], m["decode_tok_s_per_seq"]["max"]) == pytest.approx(
        (min(per_seq), max(per_seq)), rel=1e-9
    )
    # Every decode step yields one token for each of the batch's sequences.
    for stat in ("median", "min", "max"):
        assert m["decode_tok_s_aggregate"][stat] == pytest.approx(batch * m["decode_tok_s_per_seq"][stat], rel=1e-9)
    prefill = statistics.median(batch * r["settings"]["prompt_length"] / it["prefill_s"] for it in its)
    assert m["prefill_tok_s"]["median"] == pytest.approx(prefill, rel=1e-9)
    # Through the engine: one step per generated token after the first, and a step's time splits into
    # the forward and the engine's own work (measured inside the step, so at most the step's time).
    engine = r["engine_iterations"]
    assert len(engine) == len(its)
    for e in engine:
        assert len(e["decode_step_s"]) == gen
        assert e["forward_s_per_step"] > 0 and e["own_s_per_step"] > 0
        assert e["forward_s_per_step"] + e["own_s_per_step"] <= statistics.fmean(e["decode_step_s"]) * 1.001
    assert m["engine_own_ms"]["median"] == pytest.approx(
        statistics.median(e["own_s_per_step"] * 1e3 for e in engine), rel=1e-9
    )


def test_csv_has_one_row_per_metric(smollm2_path: Path) -> None:
    short = ["--prompt-length", "8", "--gen-length", "2", "--iterations", "2", "--warmup", "0", "--batch", "2"]
    proc = run_benchmark_cli("smollm2", "--backend", "candle-compat", *short, "--format", "csv")
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(io.StringIO(proc.stdout)))
    by_metric = {row["metric"]: row for row in rows}
    assert len(by_metric) == len(rows)
    assert set(by_metric) == METRICS | {"kv_cache_bytes"}  # candle-compat reports no weight_bytes
    for row in rows:
        assert (row["backend"], row["batch"], row["gen_length"], row["iterations"]) == ("candle-compat", "2", "2", "2")
        assert 0 < float(row["min"]) <= float(row["median"]) <= float(row["max"]), row
    agg, per_seq = by_metric["decode_tok_s_aggregate"], by_metric["decode_tok_s_per_seq"]
    assert float(agg["median"]) == pytest.approx(2 * float(per_seq["median"]), rel=1e-9)


def test_table_on_the_jax_backend(smollm2_path: Path) -> None:
    pytest.importorskip("ruvllm_jax")
    proc = run_benchmark_cli("smollm2", "--backend", "jax", *TINY)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # The default quantization is auto, which the backend resolves (Q4_1 GGUF on CPU: w4a8 when the
    # native kernels build with their vector path) and the report names.
    from ruvllm_jax import native

    want = f"backend   jax, quantization {'w4a8' if native.has_vector_path() else 'none'}, dtype float32"
    assert want in out  # (--dtype auto resolves to float32 on a CPU)
    rows = {}
    for line in out.splitlines():
        label, sep, rest = line.partition("  ")
        if sep and rest.split() and rest.split()[0] in ("ms", "tok/s", "MiB"):
            rows[label.strip()] = [float(v.replace(",", "")) for v in rest.split()[1:]]
    assert set(rows) == {
        "time to first token",
        "prefill latency",
        "prefill throughput",
        "decode step latency (mean)",
        "decode per sequence",
        "decode aggregate",
        "peak RSS (process)",
        "engine decode step (mean)",
        "engine step: the forward",
        "engine step: the engine's own",
    }
    for label, (median, low, high) in rows.items():
        assert 0 < low <= median <= high, label
    assert "backend reports: weights" in out  # the jax model exposes weight_bytes


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--backend", "candle-compat", "--batch", "0"], "--batch must be at least 1"),
        (["--backend", "candle-compat", "--gen-length", "0"], "--gen-length must be at least 1"),
        (["--backend", "no-such-backend"], "unknown backend 'no-such-backend'"),
        (["--backend", "candle-compat", "--format", "xml"], "unknown --format 'xml'"),
        (["--backend", "candle-compat", "--prompt-length", "8190", "--gen-length", "8"], "exceeds the model's context"),
    ],
)
def test_bad_settings_give_one_line(args: list[str], needle: str, smollm2_path: Path) -> None:
    proc = run_benchmark_cli("smollm2", *args)
    assert proc.returncode == 1, proc.stdout
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0]
    assert proc.stdout == ""


def test_progress_bar_rewrites_one_line() -> None:
    out = io.StringIO()
    bar = ProgressBar(out, total=4)
    for done in range(5):
        bar.update(done, f"step {done}", force=True)
    bar.close()
    text = out.getvalue()
    assert "\n" not in text
    assert text.count("\r") == 5 + 2  # one per draw; the clearing line starts and ends with one
    assert "100%" in text and "step 4" in text
    assert text.endswith("\r")


def test_kv_cache_dtype_reaches_the_jax_backend(smollm2_path: Path) -> None:
    """``--kv-cache-dtype bfloat16`` under float32 compute: the report's KV cache is half the float32
    one's bytes, and the settings say what was asked."""
    pytest.importorskip("ruvllm_jax")
    reports = {}
    for kv in ("auto", "bfloat16"):
        proc = run_benchmark_cli("smollm2", "--backend", "jax", *TINY, "--kv-cache-dtype", kv, "--format", "json")
        assert proc.returncode == 0, proc.stderr
        reports[kv] = json.loads(proc.stdout)
    half, full = reports["bfloat16"], reports["auto"]
    assert half["dtype"] == full["dtype"] == "float32"
    assert half["settings"]["kv_cache_options"] == {"dtype": "bfloat16"} and full["settings"]["kv_cache_options"] == {}
    assert half["memory"]["kv_cache_bytes"] * 2 == full["memory"]["kv_cache_bytes"]


def test_benchmark_of_an_embedding_model_and_a_cross_encoder(tmp_path: Path) -> None:
    """An embedding folder is benchmarked as texts/s through its whole pipeline; a cross-encoder as
    pairs/s; the generative settings are refused by name."""
    from _embedding_fixtures import write_bert_embedder, write_cross_encoder

    from ruvllm.embed_bench import PASSAGE
    from ruvllm.embedding import load_embedding_model

    embedder = write_bert_embedder(tmp_path / "bert")
    scorer = write_cross_encoder(tmp_path / "cross")
    for path, kind in ((embedder, "embedding"), (scorer, "cross-encoder")):
        args = [str(path), "--backend", "candle-compat", "--batch", "4", "--prompt-length", "6", "--iterations", "3"]
        done = run_benchmark_cli(*args, "--format", "json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["kind"] == kind and report["settings"]["batch"] == 4 and report["quantization"] == "none"
        seconds = report["seconds"]
        assert len(seconds) == 3
        texts = report["metrics"]["texts_per_s"]
        assert texts["median"] == pytest.approx(statistics.median(4 / s for s in seconds))
        tokens = report["tokens_per_batch"]
        model = load_embedding_model(str(path), backend="candle-compat")
        texts = model.pieces(PASSAGE, 6, 4)
        pairs = [(texts[0], t) for t in texts]
        assert tokens == (model.tokenize(texts) if kind == "embedding" else model.tokenize_pairs(pairs)).tokens
        assert report["metrics"]["tokens_per_s"]["max"] == pytest.approx(tokens / min(seconds))
    done = run_benchmark_cli(str(embedder), "--backend", "candle-compat", "--gen-length", "8")
    assert done.returncode != 0 and "--gen-length: not for an embedding" in done.stderr
    done = run_benchmark_cli(str(embedder), "--backend", "candle-compat", "--quantization", "w8a8")
    assert done.returncode != 0 and "quantization 'w8a8'" in done.stderr
    done = run_benchmark_cli(str(embedder), "--backend", "candle-compat", "--prompt-length", "100")
    assert done.returncode != 0 and "more than the model takes" in done.stderr
