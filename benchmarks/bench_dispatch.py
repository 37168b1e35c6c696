"""What core adds to a backend's step: ``LoadedModel.forward`` (how the engine calls a backend)
against the backend model's own ``forward``, interleaved on the same model, cache and one-token
batch of a tiny random Llama (``ruvllm.testing.write_tiny_checkpoint``), for every installed
backend. Core calls the backend object directly (no per-step hook dispatch), so the difference
should be within timer noise; the per-step pluggy dispatch this replaced cost about 14 us a step.

Run: ``python benchmarks/bench_dispatch.py [--steps 3000]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.plugins import load_plugins
from ruvllm.runtime import load_model
from ruvllm.testing import write_tiny_checkpoint


def measure(backend: str, path: str, steps: int) -> tuple[float, float]:
    model = load_model(path, backend=backend)
    cache = model.allocate_cache(16, 16)
    batch = ForwardBatch([SequenceChunk(np.array([5], dtype=np.int32), 3, np.array([0], dtype=np.int32))], 16)
    for _ in range(50):  # compile, warm the allocator
        model.forward(batch, cache)
        model.model.forward(batch, cache)
    through, direct = [], []
    for _ in range(steps):
        t = time.perf_counter()
        model.forward(batch, cache)
        through.append(time.perf_counter() - t)
        t = time.perf_counter()
        model.model.forward(batch, cache)
        direct.append(time.perf_counter() - t)
    return statistics.median(through) * 1e6, statistics.median(direct) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    path = str(write_tiny_checkpoint(tempfile.mkdtemp()))
    backends = [b.name for b in load_plugins().backends.values() if b.available()]
    print(f"{args.steps} interleaved one-token steps of a tiny Llama; medians in microseconds")
    print("| backend | LoadedModel.forward | backend model's forward | added by core |")
    print("|---|---|---|---|")
    for name in backends:
        through, direct = measure(name, path, args.steps)
        print(f"| {name} | {through:.1f} | {direct:.1f} | {through - direct:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
