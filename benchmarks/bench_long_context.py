"""Long prompts (issue 60): a pass key hidden in the middle of an 8k- or 32k-token prompt, retrieved
greedily, with prefill speed and peak RSS, ruvllm against llama.cpp on the same GGUF (by default
Qwen2.5-Coder-1.5B-Instruct Q4_K_M, whose context is 32,768).

The prompt is filler sentences with ``The pass key is NNNNN. Remember it. NNNNN is the pass key.`` at
its middle, ending ``What is the pass key? The pass key is``, sized with ruvllm's tokenizer of the file
to ``--tokens`` (llama.cpp tokenizes the same text itself; both counts are reported). Each engine runs
in a child process of its own, taking turns, ``--rounds`` times:

    ruvllm      the jax backend's default form of the file (``load_model``), one ``LLMEngine`` with
                room for the prompt and the answer; greedy, ``--answer-tokens`` tokens. Prefill time:
                from the request's submission to its first output token (the whole prompt, in the
                engine's chunks, then one token).
    llama.cpp   ``llama_cpp.Llama(n_ctx = tokens + answer, n_batch 2048)`` streaming a greedy
                completion: the same two times.

Reported per engine and length: the median prefill tok/s, the peak RSS (``wait4``), the answer text,
whether it holds the pass key, and whether the two engines' answers are the same text. The
independent check is the pass key itself and llama.cpp's greedy answer on the same weights. Nothing
here is run by the tests.

    python benchmarks/bench_long_context.py --file qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --tokens 8192 32768
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_scale import cpu_tag, run_child  # noqa: E402

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    "Rivers run to the sea, and the sea does not fill. "
)
QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer: Any, tokens: int, key: int) -> str:
    """Filler around the key's sentence, as many filler sentences as make ``tokens`` tokens in all."""
    needle = f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
    unit = len(tokenizer.encode(FILLER, add_special_tokens=False))
    fixed = len(tokenizer.encode(needle + QUESTION, add_special_tokens=False))
    reps = max(2, (tokens - fixed) // unit)
    for _ in range(8):  # the unit's count is close, not exact, across joins: adjust to at most `tokens`
        half = reps // 2
        text = FILLER * half + needle + FILLER * (reps - half) + QUESTION
        n = len(tokenizer.encode(text))
        if n <= tokens:
            return text
        reps -= -(-(n - tokens) // unit)
    return text


def child_ruvllm(args: argparse.Namespace) -> int:
    from ruvllm.engine import EngineConfig, LLMEngine
    from ruvllm.engine.types import GenerationRequest
    from ruvllm.runtime import load_model
    from ruvllm.sampling import SamplingParams

    model = load_model(str(args.file), quantization="auto")  # what `ruvllm generate` loads
    prompt = args.prompt.read_text()
    ids = model.tokenizer.encode(prompt)
    sampling = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=len(ids) + args.answer_tokens))
    t0 = time.perf_counter()
    first = None
    pieces: list[str] = []
    for out in engine.stream(GenerationRequest(prompt_token_ids=ids, sampling=sampling)):
        for delta in out.deltas:
            if first is None:
                first = time.perf_counter() - t0
            pieces.append(delta.text or "")
    total = time.perf_counter() - t0
    print(json.dumps({"prompt_tokens": len(ids), "prefill_s": first, "total_s": total, "answer": "".join(pieces)}))
    return 0


def child_llama(args: argparse.Namespace) -> int:
    import llama_cpp

    prompt = args.prompt.read_text()
    probe = llama_cpp.Llama(model_path=str(args.file), vocab_only=True, verbose=False)
    n = len(probe.tokenize(prompt.encode()))
    del probe
    llm = llama_cpp.Llama(
        model_path=str(args.file), n_ctx=n + args.answer_tokens + 8, n_batch=2048, n_ubatch=512,
        n_threads=args.threads, n_threads_batch=args.threads, verbose=False,
    )  # fmt: skip
    t0 = time.perf_counter()
    first = None
    pieces: list[str] = []
    for chunk in llm.create_completion(prompt, max_tokens=args.answer_tokens, temperature=0.0, stream=True):
        if first is None:
            first = time.perf_counter() - t0
        pieces.append(chunk["choices"][0]["text"] or "")
    total = time.perf_counter() - t0
    print(json.dumps({"prompt_tokens": n, "prefill_s": first, "total_s": total, "answer": "".join(pieces)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--key", type=int, default=71432)
    ap.add_argument("--engines", nargs="+", default=["ruvllm", "llama.cpp"])
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", choices=["ruvllm", "llama.cpp"])
    ap.add_argument("--prompt", type=Path)
    args = ap.parse_args(argv)
    if args.child == "ruvllm":
        return child_ruvllm(args)
    if args.child == "llama.cpp":
        return child_llama(args)

    from ruvllm.checkpoint import open_checkpoint

    tokenizer = open_checkpoint(str(args.file)).tokenizer()
    results: dict[str, Any] = {"file": str(args.file), "cpu": cpu_tag(), "threads": args.threads, "lengths": {}}
    for tokens in args.tokens:
        text = passkey_prompt(tokenizer, tokens, args.key)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(text)
            prompt_file = Path(f.name)
        runs: dict[str, list[dict[str, Any]]] = {e: [] for e in args.engines}
        for _ in range(args.rounds):
            for engine in args.engines:  # taking turns
                cmd = [sys.executable, str(Path(__file__).resolve()), "--file", str(args.file), "--child", engine]
                cmd += ["--prompt", str(prompt_file), "--answer-tokens", str(args.answer_tokens)]
                cmd += ["--threads", str(args.threads)]
                got = run_child(cmd, dict(os.environ), args.timeout)
                if got["rc"] != 0:
                    raise RuntimeError(f"{engine} child failed: {got['stderr'][-2000:]}")
                rec = json.loads(got["stdout"].strip().splitlines()[-1])
                rec["peak_rss_bytes"] = got["peak_rss_bytes"]
                runs[engine].append(rec)
        prompt_file.unlink()
        summary: dict[str, Any] = {}
        for engine, recs in runs.items():
            prefill = statistics.median(r["prefill_s"] for r in recs)
            summary[engine] = {
                "prompt_tokens": recs[0]["prompt_tokens"],
                "prefill_s_median": prefill,
                "prefill_tok_s": recs[0]["prompt_tokens"] / prefill,
                "peak_rss_gb": max(r["peak_rss_bytes"] for r in recs) / 1e9,
                "answer": recs[0]["answer"],
                "has_key": str(args.key) in recs[0]["answer"],
                "runs": recs,
            }
        answers = {s["answer"].strip() for s in summary.values()}
        summary["same_answer"] = len(answers) == 1
        results["lengths"][str(tokens)] = summary
        for engine in args.engines:
            s = summary[engine]
            print(
                f"{tokens:>6} tokens  {engine:<10} prefill {s['prefill_tok_s']:7.1f} tok/s  "
                f"peak RSS {s['peak_rss_gb']:5.2f} GB  key {'found' if s['has_key'] else 'MISSING'}  "
                f"answer {s['answer']!r}"
            )
        print(f"{tokens:>6} tokens  same greedy answer: {summary['same_answer']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
