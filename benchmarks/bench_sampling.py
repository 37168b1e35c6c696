"""Batch sampling cost: ``sample_batch`` (one vectorised pass over all sequences of a step) against the
per-sequence reference loop (``Sampler.sample`` per row), per decode step of 64 sequences over
SmolLM2's vocabulary (49152), beside the forward time of the same decode step, so the sampler's
share of a step can be judged (target: under 5% of the forward).

The logits are the model's own: 64 sequences (windows of one text) are prefilled on the jax backend
(quantization auto, the default model's configuration), then decoded step by step; each step's
forward is timed and its [64, vocab] logits are sampled by every arm, timed, with seeded samplers
(one pair per arm, same seeds and prompts, so both sides carry the same penalty state). The batch
and reference arms must pick the same tokens; mismatches are counted and reported. The primary
arm's tokens are fed back. ``--synthetic`` skips the model and samples random peaked logits.

Arms: the issue's configuration (temperature 0.8, top_k 50, top_p 0.9, repetition 1.1, presence
0.5, frequency 0.5), plus greedy, temperature only (the API's defaults) and top_p 0.9 alone for
context. Medians over ``--steps`` steps after ``--warmup`` untimed ones. Then the engine itself runs
``--batch`` requests of the issue's configuration: the median decode step and the ``sample_batch``
call inside it.

A third arm samples as a GPU server does, on the device (``ruvllm_jax.sampling``, jitted, here on
XLA's CPU device): building the rows from the samplers' state, the call, the tokens back to the host
and the commits; its tokens are compared with the reference's too (float32 on the device: a draw at
a CDF boundary may flip). On a CPU the logits are in host memory already, which is why the engine's
``sampling="auto"`` keeps the host sampler there: this arm says what that choice is worth.

Run: ``python benchmarks/bench_sampling.py [--steps 30] [--batch 64] [--synthetic] [--json F]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from bench_backends import TEXT
from provenance import cpu_summary

from ruvllm.sampling import Sampler, SampleResult, SamplingParams, sample_batch

ARMS: dict[str, dict[str, Any]] = {
    "issue config": dict(
        temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5
    ),
    "greedy": dict(temperature=0.0),
    "temperature 1.0 only": dict(temperature=1.0),
    "top_p 0.9 only": dict(temperature=0.8, top_p=0.9),
}


def load() -> Any:
    from ruvllm.backend import LoadOptions
    from ruvllm.runtime import load_model

    return load_model("smollm2", backend="jax", options=LoadOptions(quantization="auto"))


def prompts_of(model: Any, batch: int, prompt_tokens: int) -> list[list[int]]:
    ids = model.tokenizer.encode(TEXT)
    return [ids[i : i + prompt_tokens] for i in range(batch)]


def model_steps(
    model: Any, batch: int, prompt_tokens: int, steps: int
) -> Iterator[tuple[np.ndarray, float, list[list[int]]]]:
    """Prompts, then (logits [batch, vocab], forward seconds) per decode step; send the next tokens."""
    from ruvllm.backend import ForwardBatch, SequenceChunk

    prompts = prompts_of(model, batch, prompt_tokens)
    bs = 16
    per_seq = -(-(prompt_tokens + steps + 1) // bs)
    cache = model.allocate_cache(per_seq * batch + 1, bs)
    tables = [np.arange(per_seq, dtype=np.int32) + 1 + i * per_seq for i in range(batch)]
    chunks = [SequenceChunk(np.asarray(p, np.int32), 0, tables[i]) for i, p in enumerate(prompts)]
    out = model.forward(ForwardBatch(chunks, bs), cache)
    nxt = yield np.asarray(out.logits, np.float32), 0.0, prompts
    for step in range(steps):
        chunks = [SequenceChunk(np.asarray([nxt[i]], np.int32), prompt_tokens + step, tables[i]) for i in range(batch)]
        t0 = time.perf_counter()
        out = model.forward(ForwardBatch(chunks, bs), cache)
        seconds = time.perf_counter() - t0
        nxt = yield np.asarray(out.logits, np.float32), seconds, prompts


def synthetic_steps(
    batch: int, vocab: int, prompt_tokens: int, steps: int
) -> Iterator[tuple[np.ndarray, float, list[list[int]]]]:
    """Random logits with a few hundred likely tokens per row (no model, no forward time)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, prompt_tokens).tolist() for _ in range(batch)]
    for _ in range(steps + 1):
        x = rng.normal(0.0, 2.0, (batch, vocab)).astype(np.float32)
        hot = rng.integers(0, vocab, (batch, 300))
        np.put_along_axis(x, hot, np.take_along_axis(x, hot, axis=1) + rng.normal(8.0, 2.0, hot.shape), axis=1)
        yield x, 0.0, prompts


def engine_steps(model: Any, batch: int, prompt_tokens: int, steps: int) -> tuple[float, float]:
    """The engine itself: ``batch`` requests of the issue's configuration decoded together; the
    median wall time of its decode steps and of the ``sample_batch`` call inside each (ms)."""
    import ruvllm.engine.llm_engine as llm_engine
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine

    calls: list[tuple[float, int]] = []
    batch_sampler = llm_engine.sample_batch

    def timed_sampler(samplers: Any, rows: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = batch_sampler(samplers, rows, **kwargs)
        calls.append((time.perf_counter() - t0, len(samplers)))
        return out

    blocks = batch * -(-(prompt_tokens + steps + 8) // 16) + 8
    engine = LLMEngine(model, EngineConfig(num_blocks=blocks, max_num_seqs=batch))
    for i, prompt in enumerate(prompts_of(model, batch, prompt_tokens)):
        params = SamplingParams(max_tokens=steps + 4, ignore_eos=True, seed=1000 + i, **ARMS["issue config"])
        engine.add_request(GenerationRequest(list(prompt), params))
    timings: list[tuple[float, float]] = []  # (step, sampling) of steps that sampled every sequence
    llm_engine.sample_batch = timed_sampler  # type: ignore[assignment]
    try:
        while engine.has_unfinished():
            calls.clear()
            t0 = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - t0
            if calls and calls[0][1] == batch:
                timings.append((seconds, calls[0][0]))
    finally:
        llm_engine.sample_batch = batch_sampler
    decode = timings[3:]  # past the prompts' step and a warm-up
    return 1000 * statistics.median(t for t, _ in decode), 1000 * statistics.median(t for _, t in decode)


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def reference(samplers: list[Sampler], logits: np.ndarray) -> list[SampleResult]:
    """What the engine did before: one ``Sampler.sample`` per sequence."""
    return [s.sample(row) for s, row in zip(samplers, logits, strict=True)]


class DeviceArm:
    """Device sampling of one step (rows built, jitted call, tokens back, commits)."""

    def __init__(self) -> None:
        from functools import partial

        import jax

        from ruvllm_jax import sampling as dev

        self.dev = dev
        self.fns = {sort: jax.jit(partial(dev.sample_rows, sort=sort)) for sort in (False, True)}

    def __call__(self, samplers: list[Sampler], logits: np.ndarray) -> list[SampleResult]:
        from ruvllm.sampling import device_sampling

        vocab = logits.shape[-1]
        ds = device_sampling(samplers, vocab)
        _, sort = self.dev.variant(ds)
        got = self.dev.to_host(self.fns[sort](logits, self.dev.pad_inputs(ds, len(samplers), vocab)), len(samplers))
        return [s.commit(int(got.tokens[i]), float(got.logprobs[i]), []) for i, s in enumerate(samplers)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--synthetic", action="store_true", help="random logits instead of the model's")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary of --synthetic logits")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    total = args.warmup + args.steps
    model = None if args.synthetic else load()
    if model is None:
        source = synthetic_steps(args.batch, args.vocab, args.prompt_tokens, total)
    else:
        source = model_steps(model, args.batch, args.prompt_tokens, total)
    logits, _, prompts = next(source)
    vocab = logits.shape[-1]

    def samplers(params: dict[str, Any]) -> list[Sampler]:
        return [Sampler(SamplingParams(seed=1000 + i, **params), prompts[i], (2,)) for i in range(args.batch)]

    pairs = {name: (samplers(p), samplers(p)) for name, p in ARMS.items()}
    on_device = {name: samplers(p) for name, p in ARMS.items()}
    device_arm = DeviceArm()
    times: dict[str, dict[str, list[float]]] = {name: {"batch": [], "reference": [], "device": []} for name in ARMS}
    mismatches = dict.fromkeys(ARMS, 0)
    device_mismatches = dict.fromkeys(ARMS, 0)
    forward: list[float] = []
    primary = next(iter(ARMS))
    for step in range(total + 1):
        tokens: list[int] = []
        for name, (fast, ref) in pairs.items():
            got, t_batch = timed(sample_batch, fast, logits)
            want, t_ref = timed(reference, ref, logits)
            dev, t_dev = timed(device_arm, on_device[name], logits)
            mismatches[name] += sum(a.token_id != b.token_id for a, b in zip(got, want, strict=True))
            device_mismatches[name] += sum(a.token_id != b.token_id for a, b in zip(dev, want, strict=True))
            if step >= args.warmup:
                times[name]["batch"].append(t_batch)
                times[name]["reference"].append(t_ref)
                times[name]["device"].append(t_dev)
            if name == primary:
                tokens = [r.token_id for r in got]
        if step == total:
            break
        logits, seconds, _ = source.send(tokens)
        if step >= args.warmup:
            forward.append(seconds)

    out: dict[str, Any] = {
        "cpu": cpu_summary(),
        "load_average": os.getloadavg(),
        "logits": "synthetic" if args.synthetic else "smollm2 (jax, quantization auto)",
        "batch": args.batch,
        "vocab": vocab,
        "steps": args.steps,
        "forward_ms": 1000 * statistics.median(forward) if not args.synthetic else None,
        "arms": {},
    }
    if model is not None:
        out["engine_step_ms"], out["engine_sampling_ms"] = engine_steps(
            model, args.batch, args.prompt_tokens, args.steps
        )
    for name, params in ARMS.items():
        b = 1000 * statistics.median(times[name]["batch"])
        r = 1000 * statistics.median(times[name]["reference"])
        d = 1000 * statistics.median(times[name]["device"])
        out["arms"][name] = {
            "params": params,
            "batch_ms": b,
            "reference_ms": r,
            "device_ms": d,
            "mismatches": mismatches[name],
            "device_mismatches": device_mismatches[name],
        }
    print(f"cpu: {out['cpu']}; load average {' '.join(f'{x:.2f}' for x in out['load_average'])}")
    print(f"logits: {out['logits']}, {args.batch} sequences x vocab {vocab}, median of {args.steps} steps")
    if out["forward_ms"] is not None:
        print(f"forward of a {args.batch}-sequence decode step: {out['forward_ms']:.1f} ms (median)")
        print(
            f"in the engine ({args.batch} requests, issue config): decode step {out['engine_step_ms']:.1f} ms, "
            f"of which sample_batch {out['engine_sampling_ms']:.2f} ms "
            f"({100 * out['engine_sampling_ms'] / out['engine_step_ms']:.1f}%)"
        )
    print(
        "| sampling | batch ms/step | reference ms/step | speed-up | % of forward | token mismatches "
        "| device (XLA CPU) ms/step | device / batch | device mismatches |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, a in out["arms"].items():
        share = f"{100 * a['batch_ms'] / out['forward_ms']:.1f}%" if out["forward_ms"] else "-"
        print(
            f"| {name} | {a['batch_ms']:.2f} | {a['reference_ms']:.2f} | {a['reference_ms'] / a['batch_ms']:.1f}x | "
            f"{share} | {a['mismatches']} | {a['device_ms']:.2f} | {a['device_ms'] / a['batch_ms']:.1f}x "
            f"| {a['device_mismatches']} |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
