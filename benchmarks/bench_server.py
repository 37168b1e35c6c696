"""Serving benchmark: throughput and TTFT / inter-token-latency percentiles at 1, 8, 32 and 64
concurrent streams, for ``ruvllm serve`` (JAX backend when installed, else candle-compat) and, in
the same run when ``llama-cpp-python[server]`` is installed, ``llama_cpp.server`` on the same GGUF
with 2 threads.

Each server runs as its own process on 127.0.0.1; the client streams OpenAI chat completions over
raw SSE (httpx) and times every event. Run: ``python benchmarks/bench_server.py [--json out.json]``.

``--workload mixed`` is the serving-stall check: right after the server reports ready (no warm-up),
8 and 32 streams send prompts of 10 to 1,500 tokens (a fixed spread) with max_tokens from 8 to 128;
it reports TTFT and inter-token-latency percentiles and counts the step compilations our server
logged while serving (``step compiled while serving``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from provenance import cpu_summary, gguf_weights, llama_cpp_build, llama_cpp_summary, native_isa

TOPICS = ["a dragon", "the sea", "a robot", "a lost key", "winter", "a lighthouse", "a train", "a garden"]


@dataclass
class RequestTiming:
    ttft: float
    itls: list[float]
    e2e: float
    tokens: int


@dataclass
class LevelResult:
    server: str
    concurrency: int
    requests: int
    wall_s: float
    completion_tokens: int
    tokens_per_s: float
    requests_per_s: float
    ttft_ms: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)
    e2e_ms: dict[str, float] = field(default_factory=dict)
    errors: int = 0
    #: Step compilations the server logged while serving, counted after this level (ours only).
    compiles: int | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values) * 1000.0
    return {f"p{q}": round(float(np.percentile(a, q)), 1) for q in (50, 90, 99)}


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout}s:\n{log.read_text()[-3000:]}")


async def one_request(
    client: httpx.AsyncClient, model: str, i: int, max_tokens: int, messages: list[dict] | None = None
) -> RequestTiming:
    """Stream one chat completion; ``messages`` default to a short story prompt."""
    body = {
        "model": model,
        "messages": messages or [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    stamps: list[float] = []
    usage_tokens = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter())
    end = time.perf_counter()
    if not stamps:
        return RequestTiming(end - start, [], end - start, usage_tokens or 0)
    itls = [b - a for a, b in itertools.pairwise(stamps)]
    return RequestTiming(
        stamps[0] - start, itls, end - start, usage_tokens if usage_tokens is not None else len(stamps)
    )


async def run_level(
    base: str,
    model: str,
    name: str,
    concurrency: int,
    n_requests: int,
    max_tokens: int,
    mixed: list[tuple[str, int]] | None = None,
) -> LevelResult:
    """``n_requests`` at ``concurrency`` streams; ``mixed``: request ``i`` sends ``mixed[i]``'s prompt
    text and max_tokens instead of a story prompt."""
    limits = httpx.Limits(max_connections=concurrency + 4)
    sem = asyncio.Semaphore(concurrency)
    timings: list[RequestTiming] = []
    errors = 0

    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=600) as client:

        async def worker(i: int) -> None:
            nonlocal errors
            async with sem:
                try:
                    if mixed:
                        text, mt = mixed[i % len(mixed)]
                        msgs = [{"role": "user", "content": text}]
                        timings.append(await one_request(client, model, i, mt, msgs))
                    else:
                        timings.append(await one_request(client, model, i, max_tokens))
                except httpx.HTTPError as exc:
                    errors += 1
                    print(f"  request {i} failed: {exc!r}", file=sys.stderr)

        t0 = time.perf_counter()
        await asyncio.gather(*[worker(i) for i in range(n_requests)])
        wall = time.perf_counter() - t0
    tokens = sum(t.tokens for t in timings)
    return LevelResult(
        server=name,
        concurrency=concurrency,
        requests=len(timings),
        wall_s=round(wall, 2),
        completion_tokens=tokens,
        tokens_per_s=round(tokens / wall, 1),
        requests_per_s=round(len(timings) / wall, 2),
        ttft_ms=_percentiles([t.ttft for t in timings]),
        itl_ms=_percentiles([gap for t in timings for gap in t.itls]),
        e2e_ms=_percentiles([t.e2e for t in timings]),
        errors=errors,
    )


#: About 500 tokens of shared context for the prefix-cache measurement (made unique per round).
DOCUMENT = (
    "The harbour town of Kessel lies at the mouth of a slow river, and for three centuries its people lived "
    "from herring, salt and the repair of other people's ships. The old quay, built of grey granite in 1712, "
    "still carries the iron rings where the salt barges were tied. In the nineteenth century a railway reached "
    "the town, the fish market moved to a new hall beside the station, and the shipyards grew until they "
    "employed almost half of the men. After the second war the yards closed one by one; the last launched a "
    "ferry in 1971. Today the town lives from visitors, a small university campus and a museum of navigation "
    "that fills the former rope works, a building four hundred metres long. "
) * 4


async def prefix_ttft(base: str, model: str, rounds: int) -> dict[str, float]:
    """TTFT of a request whose ~500-token system context is new (cold) and of a second request with
    the same context and another question (warm: a prefix cache serves the shared part)."""
    cold, warm = [], []
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        for r in range(rounds):
            context = {"role": "system", "content": f"Reference document {r}.\n" + DOCUMENT}
            for question, out in (("Summarize the document.", cold), ("When did the last shipyard close?", warm)):
                t = await one_request(client, model, r, 4, [context, {"role": "user", "content": question}])
                out.append(t.ttft)
    return {
        "cold_ttft_ms": round(float(np.median(cold)) * 1000, 1),
        "warm_ttft_ms": round(float(np.median(warm)) * 1000, 1),
        "rounds": rounds,
    }


#: max_tokens of the mixed workload, cycled.
MIXED_MAX_TOKENS = [8, 64, 16, 128, 32, 48, 8, 96]


def mixed_prompts(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """``n`` (prompt text, max_tokens): prompt lengths spread log-uniformly over 10-1,500 tokens of
    SmolLM2's tokenizer (the text is cut at a token boundary), each made unique by a leading number."""
    from ruvllm.checkpoint import open_checkpoint
    from ruvllm.resolve import resolve

    tok = open_checkpoint(resolve("smollm2")).tokenizer()
    ids = tok.encode(DOCUMENT * 8, add_special_tokens=False)
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(10), np.log(1500), n)).astype(int)
    return [
        (f"{i}. " + tok.decode(ids[: int(k)]) + "\nSummarize.", MIXED_MAX_TOKENS[i % len(MIXED_MAX_TOKENS)])
        for i, k in enumerate(lengths)
    ]


def compiles_while_serving(log: Path) -> int:
    """Step compilations our server logged after it reported ready."""
    return log.read_text(errors="replace").count("step compiled while serving")


def _check_alive(proc: subprocess.Popen, name: str, log: Path, wait: float) -> None:
    """Raise :class:`ServerCrashed` if the server process has died (waiting up to ``wait`` s)."""
    try:
        proc.wait(timeout=wait) if wait else None
    except subprocess.TimeoutExpired:
        return
    if proc.poll() is not None:
        raise ServerCrashed(f"{name} exited with status {proc.returncode} while serving (log: {log})")


def bench_server(
    name: str, cmd: list[str], model: str, args: argparse.Namespace, env: dict[str, str]
) -> list[LevelResult]:
    port = _free_port()
    cmd = [*cmd, "--port", str(port)]
    log = Path(args.log_dir) / f"{name.replace(' ', '_')}.log"
    print(f"\n== {name}: {' '.join(cmd)}", file=sys.stderr)
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    results = []
    try:
        _wait_ready(proc, base + args.ready_path.get(name, "/v1/models"), args.startup_timeout, log)
        for c in args.levels:
            n = max(c * args.requests_per_stream, 4)
            if args.workload == "mixed":
                # No warm-up: a server must not compile once it says it is ready.
                res = asyncio.run(run_level(base, model, name, c, n, 0, mixed_prompts(n, seed=c)))
                if name.startswith("ruvllm"):  # the peer logs no compilations
                    res.compiles = compiles_while_serving(log)
            else:
                # Warm-up at this concurrency first: JIT backends compile per batch shape, and that
                # one-off cost is not what a running server pays.
                warm = asyncio.run(run_level(base, model, name, c, c, 4))
                _check_alive(proc, name, log, wait=5.0 if warm.errors else 0.0)
                res = asyncio.run(run_level(base, model, name, c, n, args.max_tokens))
            _check_alive(proc, name, log, wait=5.0 if res.errors else 0.0)
            print(f"  c={c:<3} {res.tokens_per_s:>8.1f} tok/s  TTFT p50 {res.ttft_ms.get('p50')} ms  "
                  f"ITL p50 {res.itl_ms.get('p50')} ms  errors {res.errors}", file=sys.stderr)  # fmt: skip
            results.append(res)
        if args.prefix_rounds and args.workload == "chat":
            asyncio.run(prefix_ttft(base, model, 1))  # warm-up (compiles the long-prefill shapes)
            args.prefix_results[name] = asyncio.run(prefix_ttft(base, model, args.prefix_rounds))
            print(f"  shared 500-token prefix: {args.prefix_results[name]}", file=sys.stderr)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return results


class ServerCrashed(RuntimeError):
    """The server process died under the benchmark's requests."""


def pick_backend() -> str:
    from ruvllm.plugins import load_plugins

    backends = {n for n, b in load_plugins().backends.items() if b.available()}
    return "jax" if "jax" in backends else "candle-compat"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["chat", "mixed"], default="chat", help="see the module docstring")
    p.add_argument("--levels", type=int, nargs="+", default=None, help="streams (default 1 8 32 64; mixed: 8 32)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per level = this x concurrency")
    p.add_argument("--backend", default=None, help="ruvllm backend (default: jax if installed, else candle-compat)")
    p.add_argument("--quantization", default=None, help="ruvllm weight quantization (default: the server's)")
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--log-dir", default=None, help="server logs (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--prefix-rounds", type=int, default=3, help="rounds of the shared-prefix TTFT measurement")
    p.add_argument("--server-log-level", default="WARNING", help="RUVLLM_LOG for our server (INFO shows compiles)")
    args = p.parse_args()
    args.levels = args.levels or ([8, 32] if args.workload == "mixed" else [1, 8, 32, 64])

    import tempfile

    from ruvllm.resolve import resolve

    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench_server_")
    gguf = str(resolve("smollm2"))
    backend = args.backend or pick_backend()
    env = {**os.environ, "RUVLLM_LOG": args.server_log_level}
    quant = ["--quantization", args.quantization] if args.quantization else []
    ours = f"ruvllm ({backend}{', ' + args.quantization if args.quantization else ''})"
    args.ready_path = {ours: "/ready"}
    args.prefix_results = {}
    results: list[LevelResult] = []
    peer_failure = None
    peer_build = None
    results += bench_server(
        ours,
        [sys.executable, "-m", "ruvllm", "serve", gguf, "--served-model-name", "smollm2", "--backend", backend,
         "--max-num-seqs", "64", "--num-kv-blocks", "2048", *quant],
        "smollm2", args, env,
    )  # fmt: skip
    if args.skip_llama_cpp:
        pass
    elif importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("sse_starlette") is None:
        print("\nllama-cpp-python[server] is not installed: skipping llama_cpp.server", file=sys.stderr)
    else:
        peer_build = llama_cpp_build()  # the same installed library the server process loads
        try:
            results += bench_server(
                "llama.cpp (2 threads)",
                [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "smollm2",
                 "--n_threads", "2", "--n_threads_batch", "2", "--n_ctx", "4096", "--host", "127.0.0.1",
                 # Queue concurrent requests (its default cancels the running one for the newcomer).
                 "--interrupt_requests", "False"],
                "smollm2", args, env,
            )  # fmt: skip
        except ServerCrashed as exc:
            # The peer failing is reported, not fatal: our figures still stand on their own.
            print(f"\nno llama.cpp figures: {exc}", file=sys.stderr)
            peer_failure = str(exc)

    print(f"\nmax_tokens={args.max_tokens}, greedy, chat prompts; cpu: {cpu_summary()}")
    print(f"model: {gguf} ({gguf_weights(Path(gguf))})")
    # The server inherits this environment (RUVLLM_CPU_ISA included), so its kernels pick the same.
    kernels = native_isa() if backend == "jax" else None
    if kernels:
        print(f"ruvllm jax native kernels (w8a8, w4a8): {kernels}")
    if peer_build:
        print(f"llama.cpp: {llama_cpp_summary(peer_build)}")
    print()
    if args.workload == "mixed":
        print("workload: mixed, prompts 10-1,500 tokens, max_tokens 8-128, no warm-up after ready")
    print("| server | streams | requests | tok/s | req/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | ITL p99/p50 "
          "| compiles while serving | errors |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|---|---:|---:|---:|")
    for r in results:
        ttft = "/".join(str(r.ttft_ms.get(k, "-")) for k in ("p50", "p90", "p99"))
        itl = "/".join(str(r.itl_ms.get(k, "-")) for k in ("p50", "p90", "p99"))
        ratio = f"{r.itl_ms['p99'] / max(r.itl_ms['p50'], 1e-9):.1f}" if r.itl_ms else "-"
        compiles = "-" if r.compiles is None else r.compiles
        print(f"| {r.server} | {r.concurrency} | {r.requests} | {r.tokens_per_s} | {r.requests_per_s} | {ttft} | {itl} "
              f"| {ratio} | {compiles} | {r.errors} |")  # fmt: skip
    if args.prefix_results:
        print("\n| server | TTFT, new 500-token context (ms) | TTFT, same context again (ms) | ratio |")
        print("|---|---:|---:|---:|")
        for name, p in args.prefix_results.items():
            ratio = p["cold_ttft_ms"] / max(p["warm_ttft_ms"], 1e-9)
            print(f"| {name} | {p['cold_ttft_ms']} | {p['warm_ttft_ms']} | {ratio:.1f}x |")
    if peer_failure:
        print(f"\nllama.cpp: {peer_failure}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "meta": {"cpu": cpu_summary(), "model": gguf, "native_isa": kernels, "llama_cpp": peer_build},
                    "results": [asdict(r) for r in results],
                    "prefix": args.prefix_results,
                    "peer_failure": peer_failure,
                },
                indent=2,
            )
        )
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
