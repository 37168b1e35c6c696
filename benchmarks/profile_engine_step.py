"""A decode step of ``ruvllm benchmark`` by part, at any batch: the raw forward loop (as
``ruvllm benchmark`` runs it) and the same prompts through :class:`~ruvllm.engine.LLMEngine` (greedy,
EOS ignored), taking turns in one process.

Each part is the self time of the functions wrapped for it (a part's time less that of the parts it
calls), as wall time and as the main thread's CPU time; on shared cores the CPU time is the figure
to compare (the load stretches wall time, not the work done):

    scheduling              Scheduler.schedule and update_after_forward
    engine batch            StepExecutor.sampling_rows, StepExecutor.run less the forward
    fwd: step inputs        the backend's _prepare (inside the engine's "the forward" span)
    fwd: jit call           the compiled step's call
    fwd: other              the backend's forward less the above (checks, unpacking)
    fwd: wait               waiting for the step's result on the host (_to_host)
    sampling: engine        LLMEngine._sample less the two below
    sampling: sample_batch  the batch sampler
    outputs                 appending tokens, building RequestOutputs
    detokenization          IncrementalDetokenizer.push / flush
    other                   the rest of LLMEngine.step

    python benchmarks/profile_engine_step.py --model smollm2 --batch 1 --gen-length 128 --rounds 3
    python benchmarks/profile_engine_step.py --model gemma3 --batch 32 --gen-length 48 --rounds 2

The engine runs without its pipelined decode step (``pipeline_decode=False``), whose parts run beside
the model; ``bench_pipeline.py`` measures what it saves. Medians over rounds after one untimed round
of each. JAX backend, w4a8 unless told. Nothing here is run by the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

PARTS = (
    "scheduling",
    "engine batch",
    "fwd: step inputs",
    "fwd: jit call",
    "fwd: other",
    "fwd: wait",
    "sampling: engine",
    "sampling: sample_batch",
    "outputs",
    "detokenization",
    "other",
)
FORWARD = tuple(p for p in PARTS if p.startswith("fwd:"))


class PartTimer:
    """Self time per part, wall and the calling thread's CPU."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self._children: list[list[float]] = []

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._children.append([0.0, 0.0])
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                w, c = time.perf_counter() - w0, time.thread_time() - c0
                cw, cc = self._children.pop()
                self.wall[part] += w - cw
                self.cpu[part] += c - cc
                if self._children:
                    self._children[-1][0] += w
                    self._children[-1][1] += c

        return timed

    def take(self, steps: int) -> tuple[dict[str, float], dict[str, float]]:
        out = {p: self.wall[p] / steps for p in PARTS}, {p: self.cpu[p] / steps for p in PARTS}
        self.wall.clear()
        self.cpu.clear()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quantization", default="w4a8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-length", type=int, default=64)
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import ruvllm.engine.llm_engine as llm_engine
    import ruvllm_jax.runner as runner
    from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
    from ruvllm.bench_cli import BenchmarkSettings, benchmark_prompts
    from ruvllm.engine import GenerationRequest, LLMEngine
    from ruvllm.resolve import resolve
    from ruvllm.runtime import load_model
    from ruvllm.sampling import SamplingParams, argmax_rows
    from ruvllm.tokenizer import IncrementalDetokenizer

    batch, plen, gen = args.batch, args.prompt_length, args.gen_length
    model = load_model(str(resolve(args.model)), backend="jax", options=LoadOptions(quantization=args.quantization))
    settings = BenchmarkSettings(batch=batch, prompt_length=plen, gen_length=gen, iterations=1, warmup=0)
    prompts = benchmark_prompts(model, settings)
    timer = PartTimer()
    m = model.model
    m._prepare = timer.wrap("fwd: step inputs", m._prepare)
    step_for = m._step_for
    m._step_for = lambda *a, **k: timer.wrap("fwd: jit call", step_for(*a, **k))
    m.forward = timer.wrap("fwd: other", m.forward)
    runner._to_host = timer.wrap("fwd: wait", runner._to_host)
    # The parts of the synchronous step: the pipelined one (EngineConfig.pipeline_decode) runs them
    # beside the model, where this wrapping cannot split them (bench_pipeline.py measures it whole).
    engine = LLMEngine(model, dataclasses.replace(settings.engine_config(), pipeline_decode=False))
    sched, executor = engine.scheduler, engine.executor
    sched.schedule = timer.wrap("scheduling", sched.schedule)
    sched.update_after_forward = timer.wrap("scheduling", sched.update_after_forward)
    executor.sampling_rows = timer.wrap("engine batch", executor.sampling_rows)
    executor.run = timer.wrap("engine batch", executor.run)
    engine._sample = timer.wrap("sampling: engine", engine._sample)
    llm_engine.sample_batch = timer.wrap("sampling: sample_batch", llm_engine.sample_batch)
    engine.outputs.append_token = timer.wrap("outputs", engine.outputs.append_token)
    engine._emit = timer.wrap("outputs", engine._emit)
    IncrementalDetokenizer.push = timer.wrap("detokenization", IncrementalDetokenizer.push)
    IncrementalDetokenizer.flush = timer.wrap("detokenization", IncrementalDetokenizer.flush)
    engine.step = timer.wrap("other", engine.step)

    bs = settings.block_size
    per_seq = -(-(plen + gen) // bs)
    cache = model.allocate_cache(per_seq * batch, bs, **settings.kv_cache_options)
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(batch)]

    def raw() -> tuple[float, dict[str, float], dict[str, float]]:
        chunks = [SequenceChunk(p, 0, tables[i]) for i, p in enumerate(prompts)]
        last = argmax_rows(model.forward(ForwardBatch(chunks, bs), cache).logits).astype(np.int32)
        timer.take(1)
        steps = []
        for step in range(gen):
            started = time.perf_counter()
            chunks = [SequenceChunk(last[i : i + 1], plen + step, tables[i]) for i in range(batch)]
            last = argmax_rows(model.forward(ForwardBatch(chunks, bs), cache).logits).astype(np.int32)
            steps.append(time.perf_counter() - started)
        return statistics.fmean(steps), *timer.take(gen)

    def through_engine(tag: str) -> tuple[float, dict[str, float], dict[str, float]]:
        params = SamplingParams(max_tokens=gen + 1, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(GenerationRequest(p.tolist(), SamplingParams(**vars(params)), request_id=f"{tag}-{i}"))
        started_ids: set[str] = set()
        while len(started_ids) < batch:
            started_ids |= {o.request_id for o in engine.step() if any(d.token_ids for d in o.deltas)}
        timer.take(1)
        steps = []
        while engine.has_unfinished():
            started = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - started)
        return statistics.fmean(steps), *timer.take(len(steps))

    raw()
    through_engine("warm-up")
    raws, engines = [], []
    for r in range(args.rounds):
        raws.append(raw())
        engines.append(through_engine(str(r)))

    def median(rows: list[tuple[float, dict[str, float], dict[str, float]]]) -> tuple[float, dict, dict]:
        return (
            statistics.median(x[0] for x in rows),
            {p: statistics.median(x[1][p] for x in rows) for p in PARTS},
            {p: statistics.median(x[2][p] for x in rows) for p in PARTS},
        )

    (rs, rw, rc), (es, ew, ec) = median(raws), median(engines)
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"{args.model} {args.quantization}, batch {batch}, {gen} greedy tokens; {cpu}")
    print(f"decode step: raw {rs * 1e3:.2f} ms, engine {es * 1e3:.2f} ms (raw / engine {rs / es:.3f})")
    print(f"{'part (ms a step)':<24}{'raw wall':>10}{'engine wall':>13}{'raw CPU':>10}{'engine CPU':>12}")
    for p in PARTS:
        print(f"{p:<24}{rw[p] * 1e3:10.3f}{ew[p] * 1e3:13.3f}{rc[p] * 1e3:10.3f}{ec[p] * 1e3:12.3f}")
    own = [p for p in PARTS if p not in FORWARD]
    print(
        f"the forward span: raw {sum(rw[p] for p in FORWARD) * 1e3:.3f} ms, engine "
        f"{sum(ew[p] for p in FORWARD) * 1e3:.3f} ms (wall)"
    )
    print(f"the engine's own: {sum(ec[p] for p in own) * 1e3:.3f} ms CPU, {sum(ew[p] for p in own) * 1e3:.3f} ms wall")


if __name__ == "__main__":
    main()
