"""Structured-output overhead: decode speed of SmolLM2 on the jax backend (quantization auto) with a
JSON-schema constraint against the same requests without one, at 1 and 8 concurrent streams, in one
run through the engine (continuous batching, llguidance masks computed on worker threads while the
model steps).

Both arms generate exactly ``--tokens`` tokens per stream: the schema asks for one long string
(``minLength`` above what fits), the unconstrained arm sets ``min_tokens`` so it cannot stop early.
Decode tok/s of a stream = (completion tokens - 1) / (end - first token); aggregate = all completion
tokens / wall time of the batch. Medians over ``--iterations`` after one warm-up (compilation).

Run: ``python benchmarks/bench_structured.py [--streams 1 8] [--tokens 128] [--iterations 3] [--json F]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from provenance import cpu_summary

from ruvllm.backend import LoadOptions
from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.runtime import load_model
from ruvllm.sampling import SamplingParams
from ruvllm.structured import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 100000}},
    "required": ["story"],
    "additionalProperties": False,
}


def run_batch(engine: LLMEngine, prompt: list[int], streams: int, tokens: int, constrained: bool) -> dict[str, float]:
    spec = StructuredOutput.json_schema(SCHEMA) if constrained else None
    params = SamplingParams(
        max_tokens=tokens, min_tokens=0 if constrained else tokens, temperature=0.0, structured=spec
    )
    t0 = time.perf_counter()
    results = engine.generate([GenerationRequest(list(prompt), params) for _ in range(streams)])
    wall = time.perf_counter() - t0
    per_stream, total = [], 0
    for outs in results:
        m = outs[-1].metrics
        assert m.completion_tokens == tokens, (m.completion_tokens, tokens)
        total += m.completion_tokens
        per_stream.append((m.completion_tokens - 1) / (m.e2e - m.ttft))
    return {"decode_tok_s": statistics.median(per_stream), "aggregate_tok_s": total / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    model = load_model("smollm2", backend="jax", options=LoadOptions(quantization="auto"))
    engine = LLMEngine(model, EngineConfig(num_blocks=512, max_num_seqs=max(args.streams)))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Write a long story about a lighthouse."}])
    out: dict[str, Any] = {"cpu": cpu_summary(), "model": "smollm2", "backend": "jax", "tokens": args.tokens}
    rows = []
    for streams in args.streams:
        figures: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for constrained in (False, True):
            run_batch(engine, prompt, streams, args.tokens, constrained)  # warm-up: compile the shapes
        for _ in range(args.iterations):
            for constrained in (False, True):  # interleaved, so drift hits both arms alike
                figures[constrained].append(run_batch(engine, prompt, streams, args.tokens, constrained))
        row: dict[str, Any] = {"streams": streams}
        for constrained, name in ((False, "free"), (True, "json_schema")):
            for key in ("decode_tok_s", "aggregate_tok_s"):
                row[f"{name}_{key}"] = statistics.median(f[key] for f in figures[constrained])
        row["decode_ratio"] = row["json_schema_decode_tok_s"] / row["free_decode_tok_s"]
        row["aggregate_ratio"] = row["json_schema_aggregate_tok_s"] / row["free_aggregate_tok_s"]
        rows.append(row)
    out["rows"] = rows
    print(f"cpu: {out['cpu']}")
    print(
        "| streams | decode tok/s free | decode tok/s json_schema | ratio "
        "| aggregate free | aggregate json_schema | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['streams']} | {r['free_decode_tok_s']:.1f} | {r['json_schema_decode_tok_s']:.1f} | "
            f"{r['decode_ratio']:.3f} | {r['free_aggregate_tok_s']:.1f} | {r['json_schema_aggregate_tok_s']:.1f} | "
            f"{r['aggregate_ratio']:.3f} |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
