"""Replicas on Ray Serve: aggregate throughput and latency of 16 concurrent streams through one
``ruvllm serve`` process, through Ray Serve with 1 replica and with 2 replicas
(``ruvllm_server.ray.build_app``, local Ray cluster), on the same model, in one run.

The CPU's cores are split between the replicas (``threads`` = cores / replicas), so on a small
machine two replicas are not expected to be faster than one: the point is that the deployment works
and what Ray's proxy costs. Run: ``python benchmarks/bench_ray.py [--model smollm2] [--json out.json]``
(needs ``ruvllm-server[ray]``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench_server import _free_port, _wait_ready, run_level
from provenance import cpu_summary


def direct(model: str, threads: int, streams: int, requests: int, max_tokens: int) -> dict:
    port = _free_port()
    log = Path(tempfile.mkdtemp()) / "serve.log"
    cmd = [sys.executable, "-m", "ruvllm", "serve", model, "--port", str(port), "--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_ready(proc, f"{base}/ready", 600, log)
        asyncio.run(run_level(base, model, "warm-up", 2, 2, 8))
        return asdict(asyncio.run(run_level(base, model, "ruvllm serve", streams, requests, max_tokens)))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def on_ray(model: str, replicas: int, port: int, streams: int, requests: int, max_tokens: int) -> dict:
    from ray import serve

    from ruvllm_server.ray import build_app

    cores = len(os.sched_getaffinity(0))
    app = build_app({"model": model, "replicas": replicas, "threads": max(1, cores // replicas)})
    t0 = time.monotonic()
    serve.run(app, name="ruvllm", route_prefix="/")
    started = time.monotonic() - t0
    base = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(run_level(base, model, "warm-up", 2 * replicas, 2 * replicas, 8))
        result = asdict(
            asyncio.run(run_level(base, model, f"ray {replicas} replica(s)", streams, requests, max_tokens))
        )
    finally:
        serve.delete("ruvllm")
    result["deploy_s"] = round(started, 1)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import ray
    from ray import serve

    cores = len(os.sched_getaffinity(0))
    rows = [direct(args.model, cores, args.streams, args.requests, args.max_tokens)]
    port = _free_port()
    ray.init(num_cpus=max(4, cores), include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for replicas in (1, 2):
            rows.append(on_ray(args.model, replicas, port, args.streams, args.requests, args.max_tokens))
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"model {args.model}; cpu: {cpu_summary()}; {args.streams} streams, {args.requests} requests x "
          f"{args.max_tokens} tokens (greedy chat completions)")  # fmt: skip
    print("| server | tok/s | vs ruvllm serve | TTFT p50 / p99 ms | ITL p50 / p99 ms | errors |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["tokens_per_s"] / rows[0]["tokens_per_s"]
        ttft, itl = r["ttft_ms"], r["itl_ms"]
        print(f"| {r['server']} | {r['tokens_per_s']} | {ratio:.2f}x | {ttft.get('p50')} / {ttft.get('p99')} | "
              f"{itl.get('p50')} / {itl.get('p99')} | {r['errors']} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
