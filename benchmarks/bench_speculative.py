"""Speculative decoding (n-gram prompt lookup, or a draft model: ``--speculative draft``, by default
the model's own w4a8 form) against the same engine without it and against
llama.cpp (llama-cpp-python, same GGUF, when installed): single-stream decode tok/s on the
input-grounded prompts kept in ``benchmarks/prompts/speculative_grounded.jsonl`` (rewrite or continue
a given code file, extract fields from a given text, summarize with quotes) and on open-ended ones
(``speculative_open.jsonl``), and aggregate tok/s with many streams at once (by wall clock and by
CPU seconds; the two engines take turns, ``--aggregate-rounds`` runs each).

    python benchmarks/bench_speculative.py                      # SmolLM2 on jax, every prompt
    python benchmarks/bench_speculative.py --limit 3 --max-tokens 64 --no-aggregate   # a smoke run
    python benchmarks/bench_speculative.py --streams 32 --json spec.json
    python benchmarks/bench_speculative.py --quantization none --speculative draft --draft-quantization w4a8

Prompt by prompt the engines take turns in an order rotated by one per prompt (interleaved: each
pair of figures is seconds apart, as in bench_backends.py --interleave). Greedy decoding: the
speculative engine's tokens are checked equal to the plain engine's. A prompt's decode rate is
(tokens - 1) / (seconds after its first token); the report gives, per prompt set, the total tokens
over the total decode seconds of each engine and the median of the per-prompt ratios. The CPU is
named in the report. Nothing here is run by the tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from provenance import cpu_summary

PROMPTS = Path(__file__).parent / "prompts"
SETS = {"grounded": PROMPTS / "speculative_grounded.jsonl", "open": PROMPTS / "speculative_open.jsonl"}
#: A verification chunk's most positions past the context (k + 1 for k at most 16).
MAX_SPECULATIVE_POSITIONS = 17


@dataclass
class Run:
    """One engine's generation of one prompt: its tokens and the decode seconds after the first."""

    tokens: list[int]
    decode_s: float

    @property
    def tok_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 and len(self.tokens) > 1 else 0.0


@dataclass
class Aggregate:
    """One many-stream run: each stream's tokens, its wall and CPU seconds."""

    tokens: list[list[int]]
    wall_s: float
    cpu_s: float


@dataclass
class Figures:
    name: str
    runs: dict[str, list[Run]] = field(default_factory=dict)  # prompt set -> one run per prompt
    aggregate_tok_s: dict[str, float] = field(default_factory=dict)
    aggregate_cpu_tok_s: dict[str, float] = field(default_factory=dict)  # tokens per CPU second
    acceptance: dict[str, float | None] = field(default_factory=dict)


def load_prompts(tokenizer: Any, which: str, limit: int | None) -> list[list[int]]:
    lines = [json.loads(x) for x in SETS[which].read_text().splitlines() if x.strip()]
    texts = [tokenizer.apply_chat_template(x["messages"], add_generation_prompt=True) for x in lines[:limit]]
    return [tokenizer.encode(t) for t in texts]


def ruvllm_engine(
    model: Any, speculative: str | None, args: argparse.Namespace, streams: int, longest: int = 2048
) -> Any:
    """An engine for ``streams`` sequences of prompts up to ``longest`` tokens (KV blocks for that:
    two aggregate engines live at once; precompiling needs one sequence's whole context)."""
    from ruvllm.engine import EngineConfig, LLMEngine

    per_stream = -(-(longest + args.max_tokens + MAX_SPECULATIVE_POSITIONS) // 16)
    config = EngineConfig(
        max_num_seqs=streams,
        max_model_len=2048,
        num_blocks=max(streams * per_stream, 2048 // 16) + 8,
        speculative=speculative,
        num_speculative_tokens=args.k,
        draft_model=args.draft_model if speculative == "draft" else None,
        draft_quantization=args.draft_quantization if speculative == "draft" else None,
    )
    engine = LLMEngine(model, config)
    engine.precompile()  # nothing compiles while timed
    return engine


def ruvllm_single(engine: Any, prompt: list[int], max_tokens: int) -> Run:
    from ruvllm.engine import GenerationRequest
    from ruvllm.sampling import SamplingParams

    tokens: list[int] = []
    first = None
    for out in engine.stream(GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))):
        for d in out.deltas:
            tokens += d.token_ids
        if first is None and tokens:
            first = time.perf_counter()
    assert first is not None
    return Run(tokens, time.perf_counter() - first)


def ruvllm_aggregate(engine: Any, prompts: list[list[int]], streams: int, max_tokens: int) -> Aggregate:
    """``streams`` requests at once (the prompts repeated): their tokens, wall and CPU seconds (CPU
    seconds of this process, its threads included: what the step cost on a shared machine)."""
    from ruvllm.engine import GenerationRequest
    from ruvllm.sampling import SamplingParams

    reqs = [
        GenerationRequest(prompts[i % len(prompts)], SamplingParams(max_tokens=max_tokens, temperature=0.0))
        for i in range(streams)
    ]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(reqs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Aggregate([[t for o in out for d in o.deltas for t in d.token_ids] for out in outs], wall, cpu)


def llama_cpp_single(path: Path, threads: int) -> Callable[[list[int], int], Run] | None:
    """Greedy decoding in llama.cpp through llama-cpp-python's low-level API (None: not installed).
    It decodes as many tokens as ruvllm produced, its own argmax each step."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 2048, 512, 512
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    mem = llama_cpp.llama_get_memory(ctx)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    def decode(tokens: list[int], start: int) -> int:
        b = llama_cpp.llama_batch_init(len(tokens), 0, 1)
        try:
            b.n_tokens = len(tokens)
            for i, t in enumerate(tokens):
                b.token[i], b.pos[i], b.n_seq_id[i] = t, start + i, 1
                b.seq_id[i][0] = 0
                b.logits[i] = i == len(tokens) - 1
            if llama_cpp.llama_decode(ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
        finally:
            llama_cpp.llama_batch_free(b)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        return int(logits.argmax())

    def run(prompt: list[int], n: int) -> Run:
        llama_cpp.llama_memory_clear(mem, True)
        out = [decode(prompt, 0)]
        t0 = time.perf_counter()
        while len(out) < n:
            out.append(decode(out[-1:], len(prompt) + len(out) - 1))
        return Run(out, time.perf_counter() - t0)

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--backend", default="jax")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--speculative", default="ngram", choices=["ngram", "draft"])
    p.add_argument("--draft-model", default="same", help="--speculative draft: the draft model, or same")
    p.add_argument("--draft-quantization", default="w4a8", help="--speculative draft: the draft's quantization")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each set (a smoke run)")
    p.add_argument("--streams", type=int, default=32, help="streams of the aggregate figure")
    p.add_argument("--no-aggregate", action="store_true")
    p.add_argument("--aggregate-rounds", type=int, default=3, help="many-stream runs per engine, taking turns")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: the usable CPUs)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import os

    from ruvllm.backend import LoadOptions
    from ruvllm.resolve import resolve
    from ruvllm.runtime import load_model

    path = resolve(args.model)
    model = load_model(str(path), backend=args.backend, options=LoadOptions(quantization=args.quantization))
    threads = args.threads or len(os.sched_getaffinity(0))
    plain = Figures("ruvllm")
    spec = Figures(f"ruvllm + {args.speculative} k={args.k}")
    peer = Figures("llama.cpp")
    engines = {"plain": ruvllm_engine(model, None, args, 1), "spec": ruvllm_engine(model, args.speculative, args, 1)}
    llama = None if args.no_llama_cpp or path.suffix != ".gguf" else llama_cpp_single(path, threads)
    mismatches = 0
    for which in SETS:
        prompts = load_prompts(model.tokenizer, which, args.limit)
        for fig in (plain, spec, peer):
            fig.runs[which] = []
        before = engines["spec"].stats()
        for i, prompt in enumerate(prompts):
            turns = ["plain", "spec", "llama"] if llama is not None else ["plain", "spec"]
            got: dict[str, Run] = {}
            for name in turns[i % len(turns) :] + turns[: i % len(turns)]:
                time.sleep(0.05)
                if name == "llama":
                    n = len(got["plain"].tokens) if "plain" in got else args.max_tokens
                    got[name] = llama(prompt, n)  # type: ignore[misc]
                else:
                    got[name] = ruvllm_single(engines[name], prompt, args.max_tokens)
            if got["spec"].tokens != got["plain"].tokens:
                mismatches += 1
            plain.runs[which].append(got["plain"])
            spec.runs[which].append(got["spec"])
            if "llama" in got:
                peer.runs[which].append(got["llama"])
            print(f"{which} {i}: plain {got['plain'].tok_s:.1f} tok/s, spec {got['spec'].tok_s:.1f}", file=sys.stderr)
        after = engines["spec"].stats()
        drafted = after.spec_draft_tokens - before.spec_draft_tokens
        spec.acceptance[which] = (
            (after.spec_accepted_tokens - before.spec_accepted_tokens) / drafted if drafted else None
        )
        if not args.no_aggregate:
            # Both engines at once, taking turns run by run (order rotated each round), as above.
            longest = max(len(x) for x in prompts)
            many = {
                "plain": ruvllm_engine(model, None, args, args.streams, longest),
                "spec": ruvllm_engine(model, args.speculative, args, args.streams, longest),
            }
            totals = {name: [0, 0.0, 0.0] for name in many}  # tokens, wall, CPU seconds
            for engine in many.values():
                ruvllm_aggregate(engine, prompts, args.streams, args.max_tokens)  # warm-up
            for r in range(args.aggregate_rounds):
                got_many = {}
                for name in ["plain", "spec"] if r % 2 == 0 else ["spec", "plain"]:
                    time.sleep(0.05)
                    got_many[name] = run = ruvllm_aggregate(many[name], prompts, args.streams, args.max_tokens)
                    totals[name][0] += sum(len(t) for t in run.tokens)
                    totals[name][1] += run.wall_s
                    totals[name][2] += run.cpu_s
                    print(
                        f"{which} {args.streams} streams, round {r}: {name} {run.wall_s:.2f} s, {run.cpu_s:.2f} CPU s",
                        file=sys.stderr,
                    )
                if got_many["spec"].tokens != got_many["plain"].tokens:
                    mismatches += 1
            for fig, name in ((plain, "plain"), (spec, "spec")):
                tokens, wall, cpu = totals[name]
                fig.aggregate_tok_s[which] = tokens / wall
                fig.aggregate_cpu_tok_s[which] = tokens / cpu
            del many

    def total(runs: list[Run]) -> float:
        return sum(len(r.tokens) - 1 for r in runs) / sum(r.decode_s for r in runs) if runs else 0.0

    report: dict[str, Any] = {
        "cpu": cpu_summary(),
        "model": str(path),
        "backend": f"{args.backend} ({model.options.quantization})",
        "max_tokens": args.max_tokens,
        "greedy_mismatches": mismatches,
        "sets": {},
    }
    lines = [f"CPU: {report['cpu']}", f"model {path.name} on {report['backend']}, greedy, {args.max_tokens} tokens"]
    for which in SETS:
        base = plain.runs[which]
        row: dict[str, Any] = {
            "prompts": len(base),
            "plain_tok_s": total(base),
            "spec_tok_s": total(spec.runs[which]),
            "acceptance": spec.acceptance.get(which),
            "median_speedup": statistics.median(s.tok_s / b.tok_s for s, b in zip(spec.runs[which], base, strict=True))
            if base
            else None,
        }
        if peer.runs.get(which):
            row["llama_cpp_tok_s"] = total(peer.runs[which])
        if which in spec.aggregate_tok_s:
            row[f"aggregate_{args.streams}_plain_tok_s"] = plain.aggregate_tok_s[which]
            row[f"aggregate_{args.streams}_spec_tok_s"] = spec.aggregate_tok_s[which]
            row[f"aggregate_{args.streams}_plain_cpu_tok_s"] = plain.aggregate_cpu_tok_s[which]
            row[f"aggregate_{args.streams}_spec_cpu_tok_s"] = spec.aggregate_cpu_tok_s[which]
        report["sets"][which] = row
        line = (
            f"{which:9s} {row['prompts']:2d} prompts: plain {row['plain_tok_s']:.1f} tok/s, "
            f"spec {row['spec_tok_s']:.1f} tok/s ({row['spec_tok_s'] / row['plain_tok_s']:.2f}x, "
            f"median {row['median_speedup']:.2f}x), acceptance {row['acceptance'] or 0:.0%}"
        )
        if "llama_cpp_tok_s" in row:
            line += f", llama.cpp {row['llama_cpp_tok_s']:.1f} tok/s"
        if which in spec.aggregate_tok_s:
            a, b = spec.aggregate_tok_s[which], plain.aggregate_tok_s[which]
            ca, cb = spec.aggregate_cpu_tok_s[which], plain.aggregate_cpu_tok_s[which]
            line += (
                f"; {args.streams} streams {a:.1f} vs {b:.1f} tok/s ({a / b:.2f}x), "
                f"by CPU seconds {ca:.1f} vs {cb:.1f} ({ca / cb:.2f}x)"
            )
        lines.append(line)
    lines.append(f"greedy outputs differing between spec and plain (prompts and many-stream runs): {mismatches}")
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
