"""Resident memory and the first tokens' cost of ``mmap_experts`` on the synthetic Qwen3-30B-A3B-shaped
Q4_K_M file (``moe_synthetic.py``): one load and one greedy sequence per run, in this process.

Prints one JSON object: the process's RSS (all, anonymous, file-backed) after load and after the
decode steps, the load time, and the time of every decode step, so the first steps (which page each
newly chosen expert in from the file) read against the later ones. For a cold page cache drop it
first as root (``sync; echo 1 > /proc/sys/vm/drop_caches``); a second run right after is warm.

    python benchmarks/moe_mmap_memory.py --mmap-experts true --tokens 32
    python benchmarks/moe_mmap_memory.py --backend jax --quantization w4a8 --mmap-experts true --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

DEFAULT_FILE = Path.home() / ".cache" / "ruvllm-bench" / "qwen3moe-synthetic-6l-s0-Q4_K_M.gguf"
BLOCK = 16


def rss() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) // 1024
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=DEFAULT_FILE)
    ap.add_argument("--backend", default="candle-compat")
    ap.add_argument("--mmap-experts", default=None, help="auto, true or false")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens (one prefill step)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy decode steps")
    args = ap.parse_args(argv)

    from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
    from ruvllm.checkpoint import open_checkpoint
    from ruvllm.plugins import load_plugins

    extra = {} if args.mmap_experts is None else {"mmap_experts": args.mmap_experts}
    t0 = time.perf_counter()
    ckpt = open_checkpoint(args.file)
    backend = load_plugins().choose_backend(args.backend)
    model = backend.load(ckpt, LoadOptions(quantization=args.quantization, extra=extra))
    load_s = time.perf_counter() - t0
    after_load = rss()

    blocks = -(-(args.prompt + args.tokens) // BLOCK)
    cache = model.kv_cache(blocks, BLOCK, {})
    table = np.arange(blocks, dtype=np.int32)
    ids = np.random.default_rng(0).integers(300, 1000, size=args.prompt).astype(np.int32)
    t = time.perf_counter()
    logits = np.asarray(model.forward(ForwardBatch([SequenceChunk(ids, 0, table)], BLOCK), cache).logits)
    prefill_s = time.perf_counter() - t
    steps = []
    pos = args.prompt
    for _ in range(args.tokens):
        token = np.asarray([int(np.argmax(logits[0]))], np.int32)
        t = time.perf_counter()
        logits = np.asarray(model.forward(ForwardBatch([SequenceChunk(token, pos, table)], BLOCK), cache).logits)
        steps.append(round(time.perf_counter() - t, 4))
        pos += 1
    print(
        json.dumps(
            {
                "file": str(args.file),
                "file_mib": args.file.stat().st_size // 2**20,
                "backend": args.backend,
                "options": {"quantization": model.options.quantization, **model.options.extra},
                "cpus": os.cpu_count(),
                "load_s": round(load_s, 2),
                "rss_after_load_mib": after_load,
                "prefill_s": round(prefill_s, 3),
                "decode_step_s": steps,
                "rss_after_decode_mib": rss(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
