"""The pipelined decode step (``EngineConfig.pipeline_decode``) against the engine without it, in one
process, the two engines taking turns on the same loaded model: decode tok/s at each batch size, and
every token of every run compared between them (the run stops if one differs).

    python benchmarks/bench_pipeline.py                                  # smollm2 and gemma3, batches 1 and 32
    python benchmarks/bench_pipeline.py --models smollm2 --batches 1 --rounds 12 --json out.json

A run is a batch of different chat prompts, greedy, ``ignore_eos``, ``--max-tokens`` tokens each; its
decode rate counts the tokens after the first step over the time from the second step to the last
(the prefill falls out). Each round runs both engines, in alternating order; the figure is the median
of the rounds' ratios. The CPU is named in the report.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from provenance import cpu_summary

PROMPTS = [
    "Write a story about a dragon who learns to bake bread.",
    "Explain how a bicycle stays upright.",
    "List the planets of the solar system and one fact about each.",
    "Describe the water cycle to a child.",
    "What makes a good cup of tea?",
    "Write a poem about autumn leaves.",
    "How do vaccines train the immune system?",
    "Give advice to someone learning to cook.",
]


def _run(engine: Any, tokenizer: Any, batch: int, max_tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    from ruvllm.engine import GenerationRequest
    from ruvllm.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = []
    for i in range(batch):
        rid = f"{tag}-{i}"
        prompt = tokenizer.encode(f"{PROMPTS[i % len(PROMPTS)]} (variant {i})")
        engine.add_request(GenerationRequest(prompt, params, request_id=rid))
        ids.append(rid)
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    steps, started = 0, 0.0
    while engine.has_unfinished():
        for out in engine.step():
            for d in out.deltas:
                got[out.request_id] += d.token_ids
        steps += 1
        if steps == 1:
            started = time.perf_counter()
    seconds = time.perf_counter() - started
    return batch * (max_tokens - 1) / seconds, [got[rid] for rid in ids]


def bench_model(model: str, args: argparse.Namespace) -> dict[str, Any]:
    from ruvllm.backend import LoadOptions
    from ruvllm.engine import EngineConfig, LLMEngine
    from ruvllm.runtime import load_model

    llm = load_model(model, backend="jax", options=LoadOptions(), quantization=args.quantization)
    engines = {
        on: LLMEngine(llm, EngineConfig(max_num_seqs=max(args.batches), pipeline_decode=on)) for on in (True, False)
    }
    rows = []
    for batch in args.batches:
        for on, engine in engines.items():  # compile and warm both
            _run(engine, llm.tokenizer, batch, 8, f"warm-{on}-{batch}")
        rates: dict[bool, list[float]] = {True: [], False: []}
        ratios = []
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            tokens = {}
            for on in order:
                rate, tokens[on] = _run(engines[on], llm.tokenizer, batch, args.max_tokens, f"r{r}-{on}-{batch}")
                rates[on].append(rate)
            if tokens[True] != tokens[False]:
                raise SystemExit(f"{model} batch {batch} round {r}: the pipelined engine's tokens differ")
            ratios.append(rates[True][-1] / rates[False][-1])
        row = {
            "batch": batch,
            "pipelined_tok_s": statistics.median(rates[True]),
            "sync_tok_s": statistics.median(rates[False]),
            "ratio_median": statistics.median(ratios),
            "ratios": [round(x, 4) for x in ratios],
            "outputs_identical": True,
        }
        rows.append(row)
        print(
            f"{model} ({llm.options.quantization}) batch {batch}: pipelined {row['pipelined_tok_s']:.1f} tok/s, "
            f"without {row['sync_tok_s']:.1f} tok/s, ratio {row['ratio_median']:.3f} "
            f"(rounds {min(ratios):.3f}-{max(ratios):.3f}), outputs identical",
            flush=True,
        )
    steps = engines[True].stats().pipelined_steps
    return {"model": model, "quantization": llm.options.quantization, "rows": rows, "pipelined_steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    ap.add_argument("--quantization", default="w4a8")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_summary()}", flush=True)
    report = {"cpu": cpu_summary(), "args": vars(args) | {"json": str(args.json)}, "models": []}
    for model in args.models:
        report["models"].append(bench_model(model, args))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
