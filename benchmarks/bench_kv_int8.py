"""The JAX backend's int8 KV cache (one tier: every block int8; two tiers: each sequence's recent
blocks read from float slots) against its float cache on the default model: capacity and quality.

* capacity: blocks a KV memory budget holds (the bytes per block each cache reports, checked against
  the arrays a cache of that many blocks allocates) and how many concurrent 2,048-token sequences
  they fit;
* quality: ``--new-tokens`` greedy tokens through LLMEngine from fixed prompts; greedy agreement
  (share of tokens before the first difference), and teacher-forced top-1 agreement and max / mean
  |logit difference| over the float cache's continuation (one prefill with all logits, which reads
  the quantized cache for every earlier position);
* ms per decode step (noisy on a shared machine: there to show the dequantization cost; the int8 cache
  decodes through XLA attention, the float one through the native kernel on CPU).

    python benchmarks/bench_kv_int8.py [--budget-mib 1024] [--new-tokens 256]
"""

from __future__ import annotations

import argparse

import numpy as np
from kv_two_tier_quality import BLOCK_SIZE, generate, teacher_forced
from provenance import cpu_summary

from ruvllm.backend import LoadOptions
from ruvllm.runtime import load_model

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "List five things to pack for a week of hiking in the mountains, and say why.",
]
SEQ_TOKENS = 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget-mib", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--max-num-seqs", type=int, default=64, help="what a two-tier cache's float slots are sized for"
    )
    args = parser.parse_args()

    llm = load_model(args.model, backend="jax", options=LoadOptions(quantization="auto"))
    budget = args.budget_mib * 2**20
    caches = [
        ("float32", {}),
        ("int8, one tier", {"quantization": "int8", "recent_blocks": 0}),
        ("int8, two tiers (default: 2 recent blocks float)", {"quantization": "int8"}),
    ]
    capacity = []
    for name, options in caches:
        per_block = llm.kv_block_bytes(BLOCK_SIZE, **options)
        # As the engine counts: a two-tier cache's float slots come off the budget first.
        reserved, extra = llm.kv_reserve(BLOCK_SIZE, args.max_num_seqs, **options)
        blocks = (budget - reserved) // per_block
        allocated = llm.allocate_cache(blocks, BLOCK_SIZE, **options, **extra).nbytes  # what the arrays take
        assert allocated == blocks * per_block + reserved <= budget, (name, allocated, budget)
        capacity.append((name, per_block, reserved, blocks, allocated, blocks // (SEQ_TOKENS // BLOCK_SIZE)))

    rows = []
    for p_i, text in enumerate(PROMPTS):
        prompt = llm.tokenizer.encode(text)
        n = args.new_tokens
        ref_tokens, ref_ms, _ = generate(llm, prompt, n, {})
        ref_logits = teacher_forced(llm, prompt + ref_tokens, {})[len(prompt) - 1 : -1]
        for name, options in caches[1:]:
            tokens, ms, _ = generate(llm, prompt, n, options)
            logits = teacher_forced(llm, prompt + ref_tokens, options)[len(prompt) - 1 : -1]
            diverged = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b), n)
            same = sum(a == b for a, b in zip(tokens, ref_tokens, strict=True))
            diff = np.abs(logits - ref_logits)
            top1 = float((logits.argmax(-1) == ref_logits.argmax(-1)).mean())
            rows.append(
                f"| {p_i} | {len(prompt)} | {name.split(' (')[0]} | {diverged / n:.3f} ({diverged}/{n}) | {same}/{n} "
                f"| {top1:.3f} | {diff.max():.3f} | {diff.mean():.4f} | {ref_ms * 1e3:.1f} | {ms * 1e3:.1f} |"
            )
        print(f"done: prompt {p_i}", flush=True)

    print(f"\n{args.model}, jax backend (weights w4a8 where the CPU kernels run), block_size {BLOCK_SIZE}")
    print(f"cpu: {cpu_summary()}\n")
    print(
        f"| KV cache | bytes/block | float slots (for {args.max_num_seqs} sequences) | blocks in {args.budget_mib} MiB "
        f"| allocated | {SEQ_TOKENS}-token sequences |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, per_block, reserved, blocks, allocated, seqs in capacity:
        print(
            f"| {name} | {per_block} | {reserved / 2**20:.1f} MiB | {blocks} | {allocated / 2**20:.1f} MiB | {seqs} |"
        )
    for name, *_, seqs in capacity[1:]:
        print(f"\n{name} / float32 sequences: {seqs / max(capacity[0][-1], 1):.2f}x")
    print(
        "\n| prompt | prompt tokens | cache | greedy agreement (first difference) | same tokens | teacher-forced top-1 "
        "| max abs dlogit | mean abs dlogit | ms/step float32 | ms/step int8 |"
    )
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
