"""Quality and memory of the candle-compat two-tier KV cache against the float32 cache on one model.

For each cache (float32; int8 and int4 old blocks with two ``recent_blocks`` values) it generates
``--new-tokens`` tokens greedily through LLMEngine from one fixed prompt and reports:

* greedy agreement: the share of the tokens that match float32's before the first difference;
* teacher-forced top-1 agreement and max / mean |logit difference| over float32's continuation (one
  prefill with all logits; the two-tier cache gives a position the same view token by token);
* bytes one token takes in each tier, measured on the arrays the cache holds, and the KV bytes the
  cache holds for the sequence at the end against float32 blocks for the same positions;
* decode time per token (noisy on a shared machine; it is here only to show the dequantization cost).

Prints a markdown table.

    python benchmarks/kv_two_tier_quality.py [--model smollm2] [--new-tokens 256] [--recent 0 2]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.runtime import LoadedModel, load_model
from ruvllm.sampling import SamplingParams

PROMPT = "The history of the printing press begins in the fifteenth century, when"
BLOCK_SIZE = 16


def generate(llm: LoadedModel, prompt: list[int], new_tokens: int, options: dict) -> tuple[list[int], float, Any]:
    """Greedy tokens through the engine, seconds per decode step, and the engine's cache."""
    blocks = -(-(len(prompt) + new_tokens) // BLOCK_SIZE)
    engine = LLMEngine(llm, EngineConfig(block_size=BLOCK_SIZE, num_blocks=blocks, kv_cache_options=options))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    tokens, stamps = [], []
    for out in engine.stream(GenerationRequest(prompt, params)):
        tokens += [t for d in out.deltas for t in d.token_ids]
        stamps.append(time.perf_counter())
    per_step = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return tokens, per_step, engine.cache


def teacher_forced(llm: LoadedModel, ids: list[int], options: dict) -> np.ndarray:
    blocks = -(-len(ids) // BLOCK_SIZE)
    cache = llm.allocate_cache(blocks, BLOCK_SIZE, **options)
    chunk = SequenceChunk(np.asarray(ids, np.int32), 0, np.arange(blocks, dtype=np.int32), all_logits=True)
    return llm.forward(ForwardBatch([chunk], BLOCK_SIZE), cache).all_logits[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--recent", type=int, nargs="+", default=[0, 2], help="recent_blocks values to try")
    args = parser.parse_args()

    llm = load_model(args.model, backend="candle-compat")
    prompt = llm.tokenizer.encode(PROMPT)
    n = args.new_tokens
    configs = [("float32", None, {})] + [
        (fmt, r, {"quantize_old": fmt, "recent_blocks": r}) for fmt in ("int8", "int4") for r in args.recent
    ]
    cfg = llm.config
    float_block = 2 * cfg.num_layers * BLOCK_SIZE * cfg.num_kv_heads * cfg.head_dim * 4
    reference_tokens: list[int] = []
    reference_logits = np.empty(0)
    rows = []
    for fmt, recent, options in configs:
        tokens, per_step, cache = generate(llm, prompt, n, options)
        if fmt == "float32":
            reference_tokens = tokens
            reference_logits = teacher_forced(llm, prompt + tokens, {})[len(prompt) - 1 : -1]
        logits = teacher_forced(llm, prompt + reference_tokens, options)[len(prompt) - 1 : -1]
        diverged = next((i for i, (a, b) in enumerate(zip(tokens, reference_tokens, strict=True)) if a != b), n)
        diff = np.abs(logits - reference_logits)
        top1 = float((logits.argmax(-1) == reference_logits.argmax(-1)).mean())
        held_blocks = -(-(len(prompt) + n - 1) // BLOCK_SIZE)  # the last token is never fed back
        if fmt == "float32":
            per_token = {"float32": float_block / BLOCK_SIZE}
            held = held_blocks * float_block  # the pool itself is preallocated: blocks x float_block
            tiers = f"{per_token['float32']:.0f} / -"
        else:
            per_token = cache.bytes_per_token()
            held = cache.nbytes
            assert cache.num_float_blocks + cache.num_quantized_blocks == held_blocks
            tiers = f"{per_token['float32']:.0f} / {per_token[fmt]:.0f}"
        rows.append(
            f"| {fmt} | {'-' if recent is None else recent} | {diverged / n:.3f} ({diverged}/{n}) | {top1:.3f} "
            f"| {diff.max():.3f} | {diff.mean():.4f} | {tiers} | {held / 1e6:.2f} MB "
            f"| {held_blocks * float_block / held:.2f}x | {per_step * 1e3:.0f} |"
        )
        print(f"done: {fmt} recent_blocks={recent}", flush=True)

    print(f"\n{args.model}, candle-compat, block_size {BLOCK_SIZE}, prompt {len(prompt)} tokens + {n} greedy tokens\n")
    print(
        "| old blocks | recent_blocks | greedy agreement | teacher-forced top-1 | max abs dlogit | mean abs dlogit "
        "| bytes/token float32 / quantized tier | KV bytes held at end | vs float32 | ms/decode step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
