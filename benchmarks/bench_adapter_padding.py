"""What precompiling declared adapters costs: steps with one adapter in the padded plan the jax backend
compiles before traffic (``LoadedModel.expect_adapters``: slots, rank and projections padded to the
declared bounds) against the plan sized to the step's adapters (compiled on first use), in one process,
arms interleaved. SmolLM2 on the jax backend (quantization auto), ``--max-num-seqs`` sequences per step.

Per arm and round: a ``--prompt-tokens`` prompt prefilled in one step (time to its first token), and
8 streams decoding 32 tokens each (wall time). Medians over ``--iterations`` per round.

Two declarations: SONA's (rank 2 on q/v, one adapter per sequence: slots = ``--max-num-seqs``) and a
PEFT adapter's as the server declares it with runtime updates (rank 8 on q/v/down, 4 per step).

Run: ``python benchmarks/bench_adapter_padding.py [--iterations 5] [--rounds 2] [--json F]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from bench_adapters import random_adapter
from provenance import cpu_summary

from ruvllm.backend import AdapterLimits, LoadOptions
from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.runtime import load_model
from ruvllm.sampling import SamplingParams

DECLARATIONS = {
    "sona": (2, ("q_proj", "v_proj"), None),
    "peft": (8, ("q_proj", "v_proj", "down_proj"), 4),
}


def measure(engine: LLMEngine, adapter: Any, prompt_tokens: int, iterations: int) -> tuple[float, float]:
    prompt = [(i * 37) % 40000 + 10 for i in range(prompt_tokens)]
    prefill, decode = [], []
    for _ in range(iterations):
        t0 = time.perf_counter()
        engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=1, temperature=0.0), adapter=adapter)])
        prefill.append(time.perf_counter() - t0)
        params = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0)
        streams = [GenerationRequest(prompt[: 20 + j], params, adapter=adapter) for j in range(8)]
        t0 = time.perf_counter()
        engine.generate(streams)
        decode.append(time.perf_counter() - t0)
    return statistics.median(prefill), statistics.median(decode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    model = load_model(args.model, backend="jax", options=LoadOptions(quantization="auto"))
    jm = model.model
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048, num_blocks=512)
    print(f"cpu: {cpu_summary()}; model {args.model}, quantization {jm.options.quantization}")
    report = {"cpu": cpu_summary(), "model": args.model, "declarations": {}}
    for name, (rank, projections, per_step) in DECLARATIONS.items():
        model.expect_adapters("bench", AdapterLimits(rank, projections, per_step))
        engine = LLMEngine(model, config)
        engine.precompile()
        padded_plan = jm.fixed_lora
        adapter = random_adapter(model.config, "bench", 0, rank, projections)
        rows = []
        for rnd in range(args.rounds):
            figures = {}
            for arm, plan in (("padded", padded_plan), ("sized", None)):
                jm.fixed_lora = plan
                measure(engine, adapter, args.prompt_tokens, 1)  # warm-up (the sized arm compiles here)
                figures[arm] = measure(engine, adapter, args.prompt_tokens, args.iterations)
            rows.append(figures)
            (pp, pd), (sp, sd) = figures["padded"], figures["sized"]
            print(
                f"{name} {padded_plan} round {rnd}: prefill {args.prompt_tokens} tokens padded {pp * 1e3:.0f} ms / "
                f"sized {sp * 1e3:.0f} ms ({pp / sp:.3f}x); 8 x 32 decode padded {pd * 1e3:.0f} ms / "
                f"sized {sd * 1e3:.0f} ms ({pd / sd:.3f}x)",
                flush=True,
            )
        report["declarations"][name] = {"plan": str(padded_plan), "rounds": rows}
        model.expect_adapters("bench", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
