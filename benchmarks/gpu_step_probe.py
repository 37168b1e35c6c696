"""Where a Llama-3-8B-shaped decode step's time goes on a GPU (run by benchmarks/gpu_lease.sh's probe part):
the whole ``JaxModel.forward`` (host preparation + compiled step + device sampling) against the compiled
f"step alone {statistics.median(alone[2:]) * 1e3:.2f} ms, "
f"prepare {statistics.median(prep) * 1e3:.2f} ms, "
(bytes it accesses, for one pass of a loop's body). ``UNROLL_LAYERS`` = auto | true | false is the
backend's ``unroll_layers`` option (auto: unrolled on CUDA). Measured with it, on an H200: a scanned
step copies each layer's weights out of the stacked arrays before its products (see
benchmarks/results/h200-2026-11-27)."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, "benchmarks")
from bench_gpu import BLOCK_SIZE, LLAMA3_8B, greedy_rows, random_llama, weights_read

from ruvllm.backend import ForwardBatch, SequenceChunk


def main() -> None:
    for attention in sys.argv[1:] or ["pallas"]:
        model = random_llama(LLAMA3_8B, "bfloat16", attention, unroll_layers=os.environ.get("UNROLL_LAYERS", "auto"))
        spec = model.spec
        for b in (1, 32):
            per_seq = 40
            cache = model.allocate_cache(per_seq * b + 1, BLOCK_SIZE)
            tables = [np.arange(per_seq, dtype=np.int32) + i * per_seq for i in range(b)]
            pos = 512
            chunks = [SequenceChunk(np.asarray([7], np.int32), pos, tables[i]) for i in range(b)]
            batch = ForwardBatch(chunks, BLOCK_SIZE, sampling=greedy_rows(b, spec.vocab_size))
            whole = []
            for _ in range(12):
                t0 = time.perf_counter()
                model.forward(batch, cache)
                whole.append(time.perf_counter() - t0)
            inputs, plan, _, lora = model._prepare(chunks, cache)
            step = model._step_for(plan, cache, inputs, lora)
            alone = []
            for _ in range(12):
                t0 = time.perf_counter()
                logits, _, cache.state = step(model.weights, cache.state, inputs, lora)
                logits.block_until_ready()
                alone.append(time.perf_counter() - t0)
            prep = []
            for _ in range(12):
                t0 = time.perf_counter()
                model._prepare(chunks, cache)
                prep.append(time.perf_counter() - t0)
            cost = step.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            accessed = (cost or {}).get("bytes accessed", float("nan"))
            print(
                f"probe {attention} b={b}: forward {statistics.median(whole[2:]) * 1e3:.2f} ms, "
                f"step alone {statistics.median(alone[2:]) * 1e3:.2f} ms, "
                f"prepare {statistics.median(prep) * 1e3:.2f} ms, "
                f"weights {weights_read(model) / 1e9:.2f} GB, XLA bytes accessed {accessed / 1e9:.2f} GB, "
                f"flops {(cost or {}).get('flops', float('nan')) / 1e9:.1f} G",
                flush=True,
            )
            del cache
        if attention == "pallas":
            text = step.as_text()
            print("probe hlo: copies", text.count(" copy("), "dynamic-slice", text.count("dynamic-slice("),
                  "while", text.count(" while("), "custom-call", text.count("custom-call("), flush=True)
            if os.environ.get("OUT"):
                Path(os.environ["OUT"], "step_hlo.txt").write_text(text)
        del model


if __name__ == "__main__":
    main()
