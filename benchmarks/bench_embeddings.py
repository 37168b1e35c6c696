"""Embedding throughput against sentence-transformers (torch, CPU), same machine, same run: texts/s at
batch 1, 32 and 256 for each model and backend (never run by the test suite).

Each figure is the median of ``--rounds`` timed passes, the engines taking turns, after one untimed
pass each (jax compiles its shapes there), over the same texts (sentences of 8-40 words). The CPU is
printed from /proc/cpuinfo.

    JAX_PLATFORMS=cpu python benchmarks/bench_embeddings.py MODELS/all-MiniLM-L6-v2 MODELS/embeddinggemma-300m
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = [
        "search",
        "engine",
        "vector",
        "model",
        "sentence",
        "paris",
        "river",
        "music",
        "energy",
        "market",
        "school",
        "garden",
        "travel",
    ]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 40))) for _ in range(n)]


def rates(engines: dict, batch: int, items: list[str], rounds: int) -> dict[str, float]:
    """texts/s of each engine: ``items`` in chunks of ``batch``, one untimed pass each (jax compiles
    every chunk's shape there), then ``rounds`` timed passes with the engines taking turns; the
    median pass."""
    chunks = [items[i : i + batch] for i in range(0, len(items), batch)]
    for run in engines.values():
        for c in chunks:
            run(c)
    times: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(rounds):
        for label, run in engines.items():
            t0 = time.perf_counter()
            for c in chunks:
                run(c)
            times[label].append(time.perf_counter() - t0)
    return {label: len(items) / statistics.median(t) for label, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--backends", default="candle-compat,jax")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--texts", type=int, default=256, help="texts per timed run (batch 1 runs 32 of them)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    from ruvllm.embedding import load_embedding_model

    print(json.dumps({"cpu": cpu_name(), "torch_threads": torch.get_num_threads()}), flush=True)
    items = texts(args.texts)
    for path in args.models:
        name = path.rstrip("/").split("/")[-1]
        st = SentenceTransformer(path, device="cpu")
        engines = {"sentence-transformers": lambda b, st=st: st.encode(b, batch_size=len(b))}
        for backend in args.backends.split(","):
            m = load_embedding_model(path, backend=backend)
            engines[f"ruvllm-{backend}"] = lambda b, m=m: m.embed(b, truncate=True)
        for batch in (int(b) for b in args.batches.split(",")):
            subset = items[:32] if batch == 1 else items
            got = rates(engines, batch, subset, args.rounds)
            row = {"model": name, "batch": batch, **{k: round(v, 1) for k, v in got.items()}}
            st_rate = got["sentence-transformers"]
            ours = {k: v for k, v in got.items() if k.startswith("ruvllm")}
            row.update({f"{k} / sentence-transformers": round(v / st_rate, 2) for k, v in ours.items()})
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
