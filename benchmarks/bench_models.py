"""Several models in one server (issue 57): ``ruvllm serve A B C --models-max 2``, requests alternating
between the three so that every request loads its model and unloads the least recently used.

Each model is first served alone (``ruvllm serve MODEL``) for its reference: one greedy chat answer.
Then one server holds all of them, with room for two (``--models-max``, or ``--models-memory``):

    cold    per model, a streamed greedy chat to the model while it is not loaded: time to its first
            token (which includes the load) and the load's own seconds (the server's ``model loaded``
            log line), against the time to first token of the next request, the model loaded (warm).
    churn   ``--alternations`` requests cycling through the models (each loads its model): every
            answer compared with the model's answer alone, the server process's RSS after each
            request: after the first tenth (warm) and at the end, the peak, and the growth.

Reported as JSON (``--json``): the CPU, the models, cold and warm times, load seconds (median per
model), answers equal to the alone answers, RSS. Nothing here is run by the tests.

    python benchmarks/bench_models.py smollm2 gemma3 qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
        --alternations 200 --json benchmarks/results/<folder>/models.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from provenance import cpu_summary  # noqa: E402

PROMPT = "Write one sentence about the sea."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(args: list[str], log: Path, timeout: float) -> Any:
    """``ruvllm serve ARGS`` until the block exits: ``(base url, process, seconds to /ready)``."""
    port = free_port()
    exe = shutil.which("ruvllm") or str(Path(sys.executable).with_name("ruvllm"))
    cmd = [exe, "serve", *args, "--port", str(port)]
    env = {**os.environ, "RUVLLM_LOG": "INFO"}
    with log.open("w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"`{' '.join(cmd)}` exited:\n{log.read_text()[-3000:]}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(base + "/ready", timeout=2).status_code == 200:
                        break
                if time.perf_counter() - t0 > timeout:
                    raise SystemExit(f"`{' '.join(cmd)}` not ready in {timeout}s")
                time.sleep(0.2)
            yield base, proc, time.perf_counter() - t0
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def chat(base: str, model: str, max_tokens: int) -> tuple[str, float, float]:
    """A streamed greedy chat: ``(answer, seconds to the first token, seconds in all)``."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    first, parts = None, []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            raise SystemExit(f"{model}: HTTP {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            text = choices[0]["delta"].get("content") if choices else None
            if text:
                first = first if first is not None else time.perf_counter() - t0
                parts.append(text)
    return "".join(parts), first or 0.0, time.perf_counter() - t0


def load_seconds(log: Path) -> dict[str, list[float]]:
    """Each model's ``model loaded`` seconds, from the server's JSON log lines."""
    out: dict[str, list[float]] = {}
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") == "model loaded" and "memory_mib" in event:
                out.setdefault(event["model"], []).append(float(event["seconds"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=["smollm2", "gemma3"])
    ap.add_argument("--backend", default="jax")
    ap.add_argument("--models-max", type=int, default=None, help="default: one fewer than the models")
    ap.add_argument("--models-memory", default=None)
    ap.add_argument("--alternations", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if len(args.models) < 2:
        raise SystemExit("give two models or more")
    names = [Path(m).stem if m.endswith(".gguf") else Path(m).name for m in args.models]
    work = Path(tempfile.mkdtemp(prefix="bench-models-"))
    common = ["--backend", args.backend, "--max-num-seqs", "4"]

    alone: dict[str, dict[str, Any]] = {}
    for ref, name in zip(args.models, names, strict=True):
        with serve([ref, *common], work / f"alone-{name}.log", args.timeout) as (base, _, ready):
            answer, ttft, _ = chat(base, name, args.max_tokens)
            alone[name] = {"ready_s": round(ready, 2), "answer": answer, "ttft_s": round(ttft, 3)}
        print(f"alone {name}: ready {ready:.1f}s, ttft {ttft:.3f}s: {answer!r}", flush=True)

    limit = ["--models-max", str(args.models_max or len(args.models) - 1), "--keep-alive", "-1"]
    if args.models_memory:
        limit += ["--models-memory", args.models_memory]
    log = work / "pool.log"
    cold: dict[str, dict[str, float]] = {}
    equal, total_requests, rss = 0, 0, []
    with serve([*args.models, *common, *limit], log, args.timeout) as (base, proc, ready):
        server = psutil.Process(proc.pid)
        for name in names:
            answer, ttft_cold, _ = chat(base, name, args.max_tokens)
            _, ttft_warm, _ = chat(base, name, args.max_tokens)
            cold[name] = {"ttft_cold_s": round(ttft_cold, 3), "ttft_warm_s": round(ttft_warm, 3)}
            equal += answer == alone[name]["answer"]
            total_requests += 1
            print(f"pool {name}: ttft cold {ttft_cold:.2f}s, warm {ttft_warm:.3f}s", flush=True)
        loads_cold = load_seconds(log)
        for name in names:
            cold[name]["load_s"] = round(loads_cold[name][0], 3)
        latencies: dict[str, list[float]] = {n: [] for n in names}
        for i in range(args.alternations):
            name = names[i % len(names)]
            answer, ttft, _ = chat(base, name, args.max_tokens)
            latencies[name].append(ttft)
            equal += answer == alone[name]["answer"]
            total_requests += 1
            rss.append(server.memory_info().rss)
            if (i + 1) % 20 == 0:
                print(f"  {i + 1}/{args.alternations}: rss {rss[-1] / 2**20:.0f} MiB", flush=True)
        models = httpx.get(base + "/v1/models", timeout=10).json()["data"]
    loads = load_seconds(log)
    warm_at = max(len(names), len(rss) // 10)
    # The loaded pair differs with the request's place in the cycle: compare each place with itself.
    cycle = len(names)
    last = range(max(warm_at, len(rss) - cycle), len(rss))
    growth = [rss[i] - rss[warm_at + (i - warm_at) % cycle] for i in last]
    report = {
        "cpu": cpu_summary(),
        "backend": args.backend,
        "models": dict(zip(names, args.models, strict=True)),
        "models_max": int(limit[1]),
        "pool_ready_s": round(ready, 2),
        "alone": alone,
        "cold": cold,
        "alternations": args.alternations,
        "answers_equal_alone": f"{equal}/{total_requests}",
        "load_s_median": {n: round(statistics.median(v), 3) for n, v in loads.items()},
        "loads": {n: len(v) for n, v in loads.items()},
        "ttft_s_median_during_churn": {n: round(statistics.median(v), 3) for n, v in latencies.items() if v},
        "rss_mib": {
            "after_first_tenth": round(rss[warm_at - 1] / 2**20, 1) if rss else None,
            "end": round(rss[-1] / 2**20, 1) if rss else None,
            "peak": round(max(rss) / 2**20, 1) if rss else None,
            "growth_same_place_in_cycle_since_first_tenth": [round(g / 2**20, 1) for g in growth],
            "per_request": [round(r / 2**20, 1) for r in rss],
        },
        "final_states": {m["id"]: m["status"] for m in models},
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
