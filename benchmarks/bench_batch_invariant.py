"""Issue 44's check of ``--batch-invariant`` and its cost, in one process per setting (the option's XLA
flags are read once, when jax's GPU backend starts): 24 different greedy prompts through the engine
one at a time, then all together, counting the answers that change; then decode tok/s at each
``--batches`` size.

    python benchmarks/bench_batch_invariant.py --backend-option native=false                   # CPU, XLA's path
    python benchmarks/bench_batch_invariant.py --backend-option native=false --batch-invariant
    python benchmarks/bench_batch_invariant.py --model smollm2 --batch-invariant --json on.json  # a GPU (bf16)

A batch's decode rate is its tokens after the first over the time two runs differ by (``--decode-tokens``
tokens and one token each, the same prompts): the prefill and the first step fall out. Greedy,
``ignore_eos``. The device (CPU named) is in the report. Nothing here is run by the tests except
through ``gpu_lease.sh``'s argument check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from provenance import cpu_summary

SUBJECTS = [
    "The capital of France", "My favourite colour", "Water boils at", "The quick brown fox",
    "Once upon a time", "Python is a programming language", "The moon orbits", "In 1492 Columbus",
    "The best way to learn", "Cats and dogs", "A healthy breakfast", "The theory of relativity",
]  # fmt: skip
#: 24 prompts, as tests/test_batch_invariance_default.py's.
PROMPTS = [s + e for s in SUBJECTS for e in ("", " is, as far as anyone knows,")]


def _tokens(outputs: Any) -> list[int]:
    return [t for o in outputs for d in o.deltas for t in d.token_ids]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the 24 prompts")
    ap.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per answer")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8], help="decode rates at these batch sizes")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=8, help="the engine's limit (at least the largest batch)")
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="the engine's token budget: with the option every step computes about this many rows",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import jax

    from ruvllm.backend import LoadOptions, parse_backend_options
    from ruvllm.cli import with_batch_invariant
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.runtime import load_model
    from ruvllm.sampling import SamplingParams

    extra = parse_backend_options(with_batch_invariant(args.backend_option, args.batch_invariant))
    llm = load_model(
        args.model, backend="jax", options=LoadOptions(dtype=args.dtype, extra=extra), quantization=args.quantization
    )
    dev = jax.devices()[0]
    device = dev.device_kind if dev.platform != "cpu" else cpu_summary()
    label = f"{'on' if args.batch_invariant else 'off'} ({llm.options.quantization}, {llm.options.dtype}, {extra})"
    print(f"batch_invariant {label} on {device}", flush=True)
    limits = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    engine = LLMEngine(llm, EngineConfig(num_blocks=512, **limits))
    engine.precompile()  # the one token count of these limits, compiled before anything is timed
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[: args.prompts]]

    def run(ids: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return [_tokens(o) for o in engine.generate([GenerationRequest(p, params) for p in ids])]

    alone = [run([p], args.max_tokens)[0] for p in prompts]
    together = run(prompts, args.max_tokens)
    pairs = zip(alone, together, strict=True)
    first = [next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None) for a, b in pairs]
    changed = [i for i, j in enumerate(first) if j is not None]
    print(f"row changed {len(changed)} of {len(prompts)} (prompts {changed}, first differing tokens "
          f"{[first[i] for i in changed]})", file=sys.stderr, flush=True)  # fmt: skip
    rates = {}
    for b in args.batches:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        run(batch, args.decode_tokens)  # every shape of this batch compiled
        t0 = time.perf_counter()
        run(batch, 1)
        t1 = time.perf_counter()
        run(batch, args.decode_tokens)
        t2 = time.perf_counter()
        rates[b] = b * (args.decode_tokens - 1) / max((t2 - t1) - (t1 - t0), 1e-9)
        print(f"row decode batch {b}: {rates[b]:.1f} tok/s", file=sys.stderr, flush=True)
    report = {
        "batch_invariant": args.batch_invariant,
        "device": device,
        "quantization": llm.options.quantization,
        "dtype": llm.options.dtype,
        "extra": extra,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "limits": limits,
        "changed": changed,
        "first_difference": [first[i] for i in changed],
        "decode_tok_s": rates,
    }
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
