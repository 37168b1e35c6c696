"""What the engine and the server cost over the raw forward, and the server against llama-server, in
one interleaved run (issue 44's must-show): for each model, SmolLM2 (Q4_1) and Gemma-3-270M
(Q4_K_M) by default, on the jax backend's default CPU form (w4a8),

    raw forward     ``bench_backends.py --only jax-w4a8`` in a child process: single-stream decode
                    tok/s and the aggregate at 32 sequences, the prompt and decode lengths of the
                    requests below
    engine          ``ruvllm benchmark`` in a child process: the decode step through ``LLMEngine``
                    beside the raw forward's step in the same process
    server          ``ruvllm serve`` streaming greedy text completions: one stream (the median of
                    ``--stream-repeats`` requests, taking turns with llama-server's), then 32
    llama-server    ``llama_cpp.server`` (llama-cpp-python, built by the ``bench`` nox session for
                    this machine) on the same GGUF with the same threads: one stream

The servers start once per model and stay up (idle between turns); every round measures each row
once, in the order above, so a row's neighbours are seconds away. Every server gets the same text
completion (``/v1/completions``: no chat template, whose handling differs between the servers;
llama_cpp.server falls back to Llama-2's for Gemma-3). A stream's decode rate is its
tokens after the first over the time after the first (TTFT left out, as the raw forward leaves the
prefill out); a level's figure is the median over its requests, and the aggregate at 32 streams
counts the tokens streamed while every stream had its first token and none had ended (the steady
state the raw batch of 32 measures), over that window's time. Medians over rounds, each round's ratios.

    python benchmarks/bench_overhead.py --rounds 3 --json overhead.json
    python benchmarks/bench_overhead.py --models smollm2 --rounds 1 --max-tokens 64

Nothing here is run by the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_server import RequestTiming, _free_port, _wait_ready
from provenance import cpu_summary, llama_cpp_build, native_isa

HERE = Path(__file__).resolve().parent
PROMPT = (
    "The lighthouse keeper had lived alone on the island for eleven years when the storm came. "
    "It lasted three days, and this is the story of those days.\n\nOn the first morning,"
)


async def one_completion(host: str, port: int, model: str, prompt: str, max_tokens: int) -> RequestTiming:
    """Stream one greedy text completion; the time of each event that carries text.

    A lean client (asyncio streams, chunked transfer decoded here, one ``json.loads`` an event): on
    two cores the client shares the CPU with the server's forward, and httpx's streaming took
    0.55-1.1 ms of CPU an event against 0.17-0.2 ms here (measured against ``ruvllm serve``), time
    that was charged to whichever server was measured. Both servers get this client."""
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    stamps: list[float] = []
    try:
        writer.write(head + body)
        status = await reader.readline()
        if status.split(b" ")[1:2] != [b"200"]:
            raise RuntimeError(f"{host}:{port}: {status.decode(errors='replace').strip()}")
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            chunked |= name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower()
        buf = b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                data = (await reader.readexactly(size + 2))[:-2] if size else b""
            else:
                data = await reader.read(65536)
            if not data:
                break
            *lines, buf = (buf + data).split(b"\n")
            for ev in lines:
                if not ev.startswith(b"data: ") or ev.startswith(b"data: [DONE]"):
                    continue
                for choice in json.loads(ev[6:]).get("choices") or []:
                    if choice.get("text"):
                        stamps.append(time.perf_counter())
    finally:
        writer.close()
    end = time.perf_counter()
    if not stamps:
        return RequestTiming(end - start, [], end - start, 0)
    # itls carries the events' times from the request's start (the steady-state window needs them).
    return RequestTiming(stamps[0] - start, [t - start for t in stamps], end - start, len(stamps))


class Server:
    """One server process on 127.0.0.1, up until :meth:`stop`."""

    def __init__(self, name: str, cmd: list[str], ready: str, log_dir: Path, env: dict[str, str]) -> None:
        self.name, self.port = name, _free_port()
        self.log = log_dir / f"{name.replace(' ', '_').replace('/', '_')}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [*cmd, "--port", str(self.port)], stdout=out, stderr=subprocess.STDOUT, env=env
            )
        self.base = f"http://127.0.0.1:{self.port}"
        self.ready = ready

    def wait(self, timeout: float) -> None:
        _wait_ready(self.proc, self.base + self.ready, timeout, self.log)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _streams(base: str, model: str, n: int, max_tokens: int) -> dict[str, float]:
    """``n`` concurrent greedy streams of the same prompt (each numbered, so none shares a cache
    entry past the template): the median per-stream decode rate and the aggregate decode rate."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    t0 = time.perf_counter()
    prompts = [f"{i}. {PROMPT}" for i in range(n)]
    timings = await asyncio.gather(*[one_completion(host, int(port), model, prompts[i], max_tokens) for i in range(n)])
    wall = time.perf_counter() - t0
    rates = [(t.tokens - 1) / (t.e2e - t.ttft) for t in timings if t.tokens > 1 and t.e2e > t.ttft]
    if not rates:
        raise RuntimeError(f"{base}: no stream produced two tokens")
    # The aggregate in the steady state: every stream has its first token (all prompts are in) and
    # none has ended, as in the raw forward's batch of 32 decoding rows.
    lo = max(t.ttft for t in timings)
    hi = min(t.itls[-1] for t in timings if t.itls)
    events = sum(1 for t in timings for stamp in t.itls if lo < stamp <= hi)
    return {
        "stream_tok_s": statistics.median(rates),
        "aggregate_tok_s": events / (hi - lo) if hi > lo and events else float("nan"),
        "tokens": float(sum(t.tokens for t in timings)),
        "wall_s": wall,
    }


def _raw_forward(model: str, prompt_tokens: int, decode_steps: int, tmp: Path) -> dict[str, float]:
    out = tmp / "raw.json"
    cmd = [sys.executable, str(HERE / "bench_backends.py"), "--model", model, "--only", "jax-w4a8",
           "--batches", "1", "32", "--prompt-tokens", str(prompt_tokens), "--decode-steps", str(decode_steps),
           "--iterations", "3", "--json", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    (row,) = json.loads(out.read_text())["results"]
    return {"b1_tok_s": row["decode_tok_s"], "b32_tok_s": row["aggregate_tok_s"]["32"]}


def _engine(model: str, prompt_tokens: int, decode_steps: int, tmp: Path) -> dict[str, float]:
    out = tmp / "engine.json"
    cmd = [sys.executable, "-m", "ruvllm", "benchmark", model, "--backend", "jax", "--quantization", "w4a8",
           "--batch", "1", "--prompt-length", str(prompt_tokens), "--gen-length", str(decode_steps),
           "--iterations", "3", "--format", "json"]  # fmt: skip
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    out.write_text(done.stdout)
    metrics = json.loads(done.stdout)["metrics"]
    return {
        "forward_step_ms": metrics["decode_step_ms"]["median"],
        "engine_step_ms": metrics["engine_decode_step_ms"]["median"],
        "engine_own_ms": metrics["engine_own_ms"]["median"],
    }


def run_model(model: str, args: argparse.Namespace, log_dir: Path) -> dict[str, object]:
    from ruvllm.resolve import resolve

    gguf = str(resolve(model))
    env = {**os.environ, "RUVLLM_LOG": "WARNING", "JAX_PLATFORMS": "cpu"}
    threads = str(args.threads)
    servers = [
        Server("ruvllm", [sys.executable, "-m", "ruvllm", "serve", gguf, "--served-model-name", model,
                          "--backend", "jax", "--quantization", "w4a8", "--max-num-seqs", "64"],
               "/ready", log_dir, env),
    ]  # fmt: skip
    peer = importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("sse_starlette") is not None
    if peer:
        servers.append(
            Server("llama-server", [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", model,
                                    "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", "4096",
                                    "--host", "127.0.0.1", "--interrupt_requests", "False"],
                   "/v1/models", log_dir, env)
        )  # fmt: skip
    else:
        print("llama-cpp-python[server] is not installed: no llama-server rows", file=sys.stderr)
    rounds: list[dict[str, float]] = []
    try:
        for s in servers:
            s.wait(args.startup_timeout)
        ours, llama = servers[0], servers[1] if peer else None
        # Warm-up (compilation at these shapes, allocator growth): not timed.
        asyncio.run(_streams(ours.base, model, 1, 8))
        asyncio.run(_streams(ours.base, model, 32, 8))
        if llama:
            asyncio.run(_streams(llama.base, model, 1, 8))
        prompt_tokens = args.prompt_tokens
        with tempfile.TemporaryDirectory() as t:
            tmp = Path(t)
            for r in range(args.rounds):
                row: dict[str, float] = {}
                print(f"{model}: round {r + 1} of {args.rounds}", file=sys.stderr, flush=True)
                raw = _raw_forward(model, prompt_tokens, args.max_tokens, tmp)
                row.update({f"raw_{k}": v for k, v in raw.items()})
                row.update({f"bench_{k}": v for k, v in _engine(model, prompt_tokens, args.max_tokens, tmp).items()})
                # One stream lasts well under a second, and this VM's speed moves on that scale: each
                # server's single stream is the median of --stream-repeats requests, the two servers
                # taking turns, so both see the same seconds.
                ours_b1: list[float] = []
                peer_b1: list[float] = []
                for _ in range(args.stream_repeats):
                    ours_b1.append(asyncio.run(_streams(ours.base, model, 1, args.max_tokens))["stream_tok_s"])
                    if llama:
                        peer_b1.append(asyncio.run(_streams(llama.base, model, 1, args.max_tokens))["stream_tok_s"])
                row["server_b1_tok_s"] = statistics.median(ours_b1)
                many = asyncio.run(_streams(ours.base, model, 32, args.max_tokens))
                row["server_b32_tok_s"] = many["aggregate_tok_s"]
                if llama:
                    row["llama_server_b1_tok_s"] = statistics.median(peer_b1)
                row["bench_over_raw"] = row["bench_forward_step_ms"] / row["bench_engine_step_ms"]
                row["server_b1_over_raw"] = row["server_b1_tok_s"] / row["raw_b1_tok_s"]
                row["server_b32_over_raw"] = row["server_b32_tok_s"] / row["raw_b32_tok_s"]
                if llama:
                    row["server_b1_over_llama_server"] = row["server_b1_tok_s"] / row["llama_server_b1_tok_s"]
                print("  " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), file=sys.stderr, flush=True)
                rounds.append(row)
    finally:
        for s in servers:
            s.stop()
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    return {"model": model, "gguf": gguf, "rounds": rounds, "medians": medians}


#: (row, what the issue asks) for the report.
TARGETS = [
    ("bench_over_raw", 0.9, "ruvllm benchmark: engine decode over the raw forward (same process)"),
    ("server_b1_over_raw", 0.85, "server stream over the raw forward, batch 1"),
    ("server_b32_over_raw", 0.9, "server aggregate over the raw forward, 32 streams"),
    ("server_b1_over_llama_server", 1.5, "server stream over llama-server, batch 1"),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per stream (decode steps of the raw rows)")
    p.add_argument("--prompt-tokens", type=int, default=48, help="prompt length of the raw rows (~ the chat prompt's)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server's threads")
    p.add_argument("--stream-repeats", type=int, default=5, help="single-stream requests per server and round (median)")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="bench_overhead_"))
    results = []
    for m in args.models:
        try:
            results.append(run_model(m, args, log_dir))
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:  # the others still report
            print(f"{m}: no figures: {exc} (logs: {log_dir})", file=sys.stderr)
    print(f"\ncpu: {cpu_summary()}; kernels: {native_isa()}; load average at the end: {os.getloadavg()}")
    if any("llama_server_b1_tok_s" in r["medians"] for r in results):
        print(f"llama.cpp: {llama_cpp_build()}")
    for r in results:
        med = r["medians"]
        print(f"\n{r['model']} ({r['gguf']}), medians of {len(r['rounds'])} rounds:")
        for key in ("raw_b1_tok_s", "raw_b32_tok_s", "server_b1_tok_s", "server_b32_tok_s", "llama_server_b1_tok_s",
                    "bench_forward_step_ms", "bench_engine_step_ms", "bench_engine_own_ms"):  # fmt: skip
            if key in med:
                print(f"  {key:<28} {med[key]:9.2f}")
        for key, target, label in TARGETS:
            if key in med:
                each = ", ".join(f"{row[key]:.3f}" for row in r["rounds"])
                verdict = "meets" if med[key] >= target else "below"
                print(f"  {label}: {med[key]:.3f} ({verdict} {target}; rounds {each})")
    if args.json:
        meta = {"cpu": cpu_summary(), "isa": native_isa(), "args": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
