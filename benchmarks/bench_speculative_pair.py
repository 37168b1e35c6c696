"""Speculative decoding on a real draft/target pair (issue 56): Qwen2.5-Coder-0.5B-Instruct drafting for
Qwen2.5-Coder-1.5B-Instruct (both Q4_K_M GGUF), on the code prompts kept in
``benchmarks/prompts/code_pair.jsonl`` (edits of given code, completions, code written from a
description): single stream, chat, greedy, ``--max-tokens`` tokens.

    flock /tmp/ruvllm-cpu.lock python benchmarks/bench_speculative_pair.py --json pair.json
    python benchmarks/bench_speculative_pair.py --limit 2 --max-tokens 32 --no-llama-cpp   # a smoke run

In one process: the plain engine and one engine per speculative mode (``ngram``, ``draft``,
``ngram+draft``; ``MODE@N``: its draft over its N commonest tokens, ``draft_vocab_size``) over the
same loaded target and draft, taking turns prompt by prompt (the order
rotated by one per prompt). Every mode's tokens are checked equal to the plain engine's, prompt by
prompt. A prompt's rate is (tokens - 1) / (seconds after its first token); the report gives each
mode's median rate and its median per-prompt ratio to the plain engine, per prompt kind and overall,
its lowest ratio and its acceptance. Also measured in this process, before the prompts: a draft
step's and a target step's milliseconds (one token, 200 tokens of context, the forward and its
logits on the host), and their ratio, for the whole draft and each cut one.

llama.cpp: its plain rate through llama-cpp-python (the same GGUF, greedy, in this process) and its
speculative rate through the ``llama-speculative-simple`` binary (``--llama-spec-bin``; its
``decoded N tokens in S seconds`` line), each ``--llama-spec`` setting tried on the first
``--tune-prompts`` prompts, the best of them then run on every prompt in turn with the others. The
CPU is named in the report. Nothing here is run by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from bench_speculative import Run, llama_cpp_single, ruvllm_single
from provenance import cpu_summary

PROMPTS = Path(__file__).parent / "prompts" / "code_pair.jsonl"
MODELS = Path("/work/models")
TARGET = MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DRAFT = MODELS / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
MODES = ("plain", "ngram", "draft", "draft@32768", "ngram+draft", "ngram+draft@32768")
#: llama.cpp's speculative settings tried (``--spec-type`` and its arguments).
LLAMA_SPEC = (
    "draft-simple:3",
    "draft-simple:8",
    "draft-simple:16",
    "ngram-simple",
    "ngram-mod",
    "ngram-map-k",
    "draft-simple,ngram-mod:8",
)


@dataclass
class Prompt:
    kind: str
    text: str  # the chat template applied
    tokens: list[int]


def load_prompts(tokenizer: Any, limit: int | None) -> list[Prompt]:
    lines = [json.loads(x) for x in PROMPTS.read_text().splitlines() if x.strip()][:limit]
    out = []
    for x in lines:
        text = tokenizer.apply_chat_template(x["messages"], add_generation_prompt=True)
        out.append(Prompt(x["kind"], text, tokenizer.encode(text)))
    return out


def engine_for(target: Any, draft: Any, mode: str, args: argparse.Namespace) -> Any:
    """The engine of ``mode``: ``plain``, a speculative method, or ``METHOD@N`` (its draft over its
    ``N`` commonest tokens: ``draft`` is then a copy of the draft loaded for that, its head cut)."""
    from ruvllm.engine import EngineConfig, LLMEngine

    method, _, vocab = mode.partition("@")
    speculative = None if method == "plain" else method
    uses_draft = speculative in ("draft", "ngram+draft")
    config = EngineConfig(
        max_num_seqs=1,
        max_model_len=2048,
        num_blocks=2048 // 16 + 8,
        speculative=speculative,
        num_speculative_tokens=args.k,
        draft_model=str(args.draft) if uses_draft else None,
        draft_vocab_size=int(vocab) if vocab else None,
    )
    engine = LLMEngine(target, config, draft_model=draft if uses_draft else None)
    t0 = time.perf_counter()
    engine.precompile()  # nothing compiles while timed
    print(f"{mode}: precompiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return engine


def step_ms(model: Any, prompt: list[int], steps: int) -> list[float]:
    """Milliseconds of ``steps`` one-token forward passes of ``model`` after ``prompt`` (its own
    cache), each with its logits brought to the host as the draft proposer takes them."""
    from ruvllm.backend import ForwardBatch, SequenceChunk
    from ruvllm.engine.batch import block_table

    block = 16
    blocks = -(-(len(prompt) + steps + 1) // block)
    cache = model.allocate_cache(blocks + 1, block)
    table = block_table(list(range(blocks)))
    out = model.forward(ForwardBatch([SequenceChunk(np.asarray(prompt, np.int32), 0, table)], block), cache)
    token = int(np.argmax(np.asarray(out.logits)[-1]))
    ms = []
    for i in range(steps):
        t0 = time.perf_counter()
        chunk = SequenceChunk(np.asarray([token], np.int32), len(prompt) + i, table)
        out = model.forward(ForwardBatch([chunk], block), cache)
        token = int(np.argmax(np.asarray(out.logits, dtype=np.float64)[-1]))
        ms.append(1000.0 * (time.perf_counter() - t0))
    return ms


def verify_step_ms(model: Any, prompt: list[int], max_rows: int, rounds: int = 12) -> dict[int, float]:
    """Median milliseconds of a target step verifying ``rows - 1`` draft tokens (a verification chunk
    of ``rows`` positions after ``prompt``, every position's logits to the host), ``rows`` from 1 to
    ``max_rows``, the row counts taking turns ``rounds`` times (the first round is a warm-up)."""
    from ruvllm.backend import ForwardBatch, SequenceChunk
    from ruvllm.engine.batch import block_table

    block = 16
    blocks = -(-(len(prompt) + max_rows + 1) // block)
    cache = model.allocate_cache(blocks + 1, block)
    table = block_table(list(range(blocks)))
    model.forward(ForwardBatch([SequenceChunk(np.asarray(prompt, np.int32), 0, table)], block), cache)
    ms: dict[int, list[float]] = {n: [] for n in range(1, max_rows + 1)}
    for r in range(rounds):
        for n in ms:
            tokens = np.asarray(prompt[-n:], np.int32)  # any tokens: the cost does not depend on them
            chunk = SequenceChunk(tokens, len(prompt), table, all_logits=n > 1, verify=n > 1)
            t0 = time.perf_counter()
            out = model.forward(ForwardBatch([chunk], block), cache)
            np.asarray(out.all_logits[0] if n > 1 else out.logits)
            if r:
                ms[n].append(1000.0 * (time.perf_counter() - t0))
    return {n: statistics.median(v) for n, v in ms.items()}


def draft_step_cost(
    target: Any, drafts: dict[str, Any], prompt: list[int], rounds: int = 5, steps: int = 24
) -> dict[str, float]:
    """A target step's and each draft's (by name) median milliseconds, taking turns ``rounds`` times
    (the first round is a warm-up), and each draft's ratio to the target."""
    ms: dict[str, list[float]] = {"target": [], **{name: [] for name in drafts}}
    for r in range(rounds):
        for name, model in [("target", target), *drafts.items()]:
            got = step_ms(model, prompt, steps)
            if r:
                ms[name] += got[2:]
    med = {name: statistics.median(v) for name, v in ms.items()}
    out = {f"{name}_step_ms": m for name, m in med.items()}
    out.update({f"{name}_over_target": med[name] / med["target"] for name in drafts})
    return out


def llama_spec_run(binary: Path, setting: str, prompt: Prompt, args: argparse.Namespace) -> Run:
    """One prompt through ``llama-speculative-simple`` with ``setting`` (``types[:n_max]``): the tokens
    it decoded (their count only: the binary prints text) and its decode seconds."""
    types, _, n_max = setting.partition(":")
    cmd = [str(binary), "-m", str(args.target), "-n", str(args.max_tokens), "--temp", "0", "--top-k", "1"]
    cmd += ["-t", str(args.threads), "-c", "2048", "--spec-type", types]
    if "draft" in types:
        cmd += ["-md", str(args.draft), "-td", str(args.threads)]
    if n_max:
        cmd += ["--spec-draft-n-max", n_max] if "draft" in types else ["--spec-ngram-mod-n-max", n_max]
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt.text)
        f.flush()
        # OpenMP's waiting threads spin: two contexts' teams on two cores starve each other otherwise.
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE" if "draft" in types else "ACTIVE")
        done = subprocess.run([*cmd, "-f", f.name], capture_output=True, text=True, env=env, timeout=600)
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", done.stderr)
    if done.returncode != 0 or m is None:
        raise RuntimeError(f"llama-speculative-simple {setting} failed: {done.stderr[-800:]}")
    n, s = int(m.group(1)), float(m.group(2))
    acc = re.search(r"accept\s+=\s+([\d.]+)%", done.stderr)
    run = Run([0] * (n + 1), s)  # n tokens decoded after the first: the same rate formula as ruvllm's
    run.acceptance = float(acc.group(1)) / 100 if acc else None  # type: ignore[attr-defined]
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=TARGET)
    p.add_argument("--draft", type=Path, default=DRAFT)
    p.add_argument("--backend", default="jax")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (the most per step)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--limit", type=int, default=None, help="the first N prompts (a smoke run)")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--llama-spec-bin", type=Path, default=None, help="llama-speculative-simple")
    p.add_argument("--llama-spec", nargs="+", default=list(LLAMA_SPEC), help="settings: TYPES[:N_MAX]")
    p.add_argument("--tune-prompts", type=int, default=4, help="prompts each llama.cpp setting is tried on")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    assert modes[0] == "plain", "the plain engine comes first: the others are checked against it"

    from ruvllm.backend import LoadOptions
    from ruvllm.runtime import load_model

    options = LoadOptions(quantization="auto")
    target = load_model(str(args.target), backend=args.backend, options=options)
    draft = load_model(str(args.draft), backend=args.backend, options=options)
    # A draft of its own per reduced vocabulary (its head is cut in place).
    cut_drafts = {
        int(v): load_model(str(args.draft), backend=args.backend, options=options)
        for v in {m.partition("@")[2] for m in modes}
        if v
    }
    prompts = load_prompts(target.tokenizer, args.limit)
    report: dict[str, Any] = {
        "cpu": cpu_summary(),
        "target": args.target.name,
        "draft": args.draft.name,
        "backend": f"{args.backend} ({target.options.quantization})",
        "max_tokens": args.max_tokens,
        "k": args.k,
        "prompts": len(prompts),
    }
    engines = {}
    for m in modes:  # the first engine of a vocabulary cuts its draft's head, before the costs
        vocab = m.partition("@")[2]
        engines[m] = engine_for(target, cut_drafts[int(vocab)] if vocab else draft, m, args)

    runs: dict[str, list[Run]] = {m: [] for m in modes}
    # The cost of a draft step against a target step (each draft: whole head, cut heads), measured here.
    cost_prompt = (prompts[0].tokens * 4)[:200]
    report["step_cost"] = draft_step_cost(
        target, {"draft": draft, **{f"draft@{v}": d for v, d in cut_drafts.items()}}, cost_prompt
    )
    print(f"step cost: {report['step_cost']}", file=sys.stderr)
    report["verify_step_ms"] = verify_step_ms(target, cost_prompt, args.k + 1)
    print(f"verify step ms by rows: {report['verify_step_ms']}", file=sys.stderr)

    plain_llama = None if args.no_llama_cpp else llama_cpp_single(args.target, args.threads)
    spec_bin = None if args.no_llama_cpp else args.llama_spec_bin
    best_setting = None
    if spec_bin is not None:
        tried = {}
        for setting in args.llama_spec:
            got = [llama_spec_run(spec_bin, setting, q, args) for q in prompts[: args.tune_prompts]]
            tried[setting] = statistics.median(r.tok_s for r in got)
            print(f"llama.cpp {setting}: median {tried[setting]:.1f} tok/s", file=sys.stderr)
        best_setting = max(tried, key=tried.__getitem__)
        report["llama_cpp_tuning"] = {"prompts": args.tune_prompts, "median_tok_s": tried, "best": best_setting}
    turns = list(modes) + (["llama plain"] if plain_llama else []) + (["llama spec"] if best_setting else [])
    for name in turns[len(modes) :]:
        runs[name] = []
    mismatches: list[tuple[int, str]] = []
    before = {m: (e.speculator.stats.drafted, e.speculator.stats.accepted) for m, e in engines.items() if e.speculator}
    for i, q in enumerate(prompts):
        got: dict[str, Run] = {}
        for name in turns[i % len(turns) :] + turns[: i % len(turns)]:
            time.sleep(0.05)
            if name == "llama plain":
                n = len(got["plain"].tokens) if "plain" in got else args.max_tokens
                got[name] = plain_llama(q.tokens, n)  # type: ignore[misc]
            elif name == "llama spec":
                got[name] = llama_spec_run(spec_bin, best_setting, q, args)  # type: ignore[arg-type]
            else:
                got[name] = ruvllm_single(engines[name], q.tokens, args.max_tokens)
        for name, run in got.items():
            runs[name].append(run)
            if name in modes and run.tokens != got["plain"].tokens:
                mismatches.append((i, name))
        print(
            f"{i:2d} {q.kind:8s} " + ", ".join(f"{n} {r.tok_s:.1f}" for n, r in got.items()) + " tok/s", file=sys.stderr
        )

    plain = runs["plain"]
    rows: dict[str, Any] = {}
    for name in turns:
        rs = runs[name]
        ratios = [r.tok_s / b.tok_s for r, b in zip(rs, plain, strict=True)]
        row: dict[str, Any] = {
            "median_tok_s": statistics.median(r.tok_s for r in rs),
            "median_ratio": statistics.median(ratios),
            "min_ratio": min(ratios),
            "by_kind": {},
        }
        for kind in sorted({q.kind for q in prompts}):
            at = [j for j, q in enumerate(prompts) if q.kind == kind]
            row["by_kind"][kind] = {
                "median_tok_s": statistics.median(rs[j].tok_s for j in at),
                "median_ratio": statistics.median(ratios[j] for j in at),
            }
        e = engines.get(name)
        if e is not None and e.speculator is not None:
            d0, a0 = before[name]
            drafted, accepted = e.speculator.stats.drafted - d0, e.speculator.stats.accepted - a0
            row["acceptance"] = accepted / drafted if drafted else None
            row["drafted_per_token"] = drafted / sum(len(r.tokens) for r in rs)
            row["by_source"] = dict(e.speculator.stats.by_source)
        rows[name] = row
    report["modes"] = rows
    report["greedy_mismatches"] = mismatches
    report["per_prompt"] = [
        {"kind": q.kind, **{n: round(runs[n][j].tok_s, 2) for n in turns}} for j, q in enumerate(prompts)
    ]

    sc = report["step_cost"]
    lines = [
        f"CPU: {report['cpu']}",
        f"target {args.target.name}, draft {args.draft.name}, {report['backend']}, greedy chat, "
        f"{args.max_tokens} tokens, {len(prompts)} prompts, k <= {args.k}",
        f"one-token step: target {sc['target_step_ms']:.1f} ms; "
        + ", ".join(
            f"{k[: -len('_over_target')]} {sc[k[: -len('_over_target')] + '_step_ms']:.1f} ms ({v:.2f} of it)"
            for k, v in sc.items()
            if k.endswith("_over_target")
        ),
    ]
    vs = report["verify_step_ms"]
    lines.append("target step verifying rows - 1 drafts: " + ", ".join(f"{n} rows {m:.1f} ms" for n, m in vs.items()))
    for name, row in rows.items():
        kinds = ", ".join(f"{k} {v['median_ratio']:.2f}x" for k, v in row["by_kind"].items())
        line = (
            f"{name:12s} median {row['median_tok_s']:5.1f} tok/s, {row['median_ratio']:.2f}x plain "
            f"(min {row['min_ratio']:.2f}x; {kinds})"
        )
        if row.get("acceptance") is not None:
            line += f", acceptance {row['acceptance']:.0%}, {row['drafted_per_token']:.2f} drafted/token"
        lines.append(line)
    if best_setting:
        lines.append(
            f"llama.cpp speculative setting (best of {len(report['llama_cpp_tuning']['median_tok_s'])} tried "
            f"on {args.tune_prompts} prompts): {best_setting}"
        )
    lines.append(f"greedy outputs differing from the plain engine's: {len(mismatches)} {mismatches or ''}")
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
