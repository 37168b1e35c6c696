"""Quality and size of the JAX backend's weight formats on one model: resident weight bytes,
perplexity on a fixed text, top-1 agreement with float32 on that text, and where greedy
continuations first diverge from float32's. Prints a markdown table (docs/performance-journal.md).

    python benchmarks/jax_quality.py [--model smollm2] [--new-tokens 32] [--formats q8,fp8,bfloat16,fp8-bf16]
"""

from __future__ import annotations

import argparse

import numpy as np

from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm.resolve import resolve

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
    "from Mainz, combined movable metal type, oil-based ink and a wooden screw press into a system that could "
    "produce books quickly and cheaply. Before his invention, books were copied by hand, usually by monks, and a "
    "single volume could take months to finish. Within fifty years, printing shops had spread to more than two "
    "hundred cities across Europe, and millions of books were in circulation. Cheaper books helped more people "
    "learn to read, spread new scientific ideas, and changed the way religion, politics and education worked.\n\n"
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into chemical "
    "energy. In the chloroplasts, chlorophyll absorbs mostly blue and red light; the energy splits water "
    "molecules, releasing oxygen, and drives the synthesis of ATP and NADPH. In the Calvin cycle these carriers "
    "power the fixation of carbon dioxide into three-carbon sugars, which the plant uses to build glucose, "
    "starch and cellulose. Almost all the oxygen in the atmosphere comes from this reaction.\n\n"
    'import json\n\n\ndef load_settings(path):\n    with open(path, encoding="utf-8") as f:\n'
    "        data = json.load(f)\n    return {k.lower(): v for k, v in data.items() if v is not None}\n\n"
    "User: My train leaves at 14:35 and the trip takes 2 hours and 50 minutes. When do I arrive?\n"
    "Assistant: You arrive at 17:25, assuming the train is on time.\n\n"
    "The committee met on Tuesday to review the budget. Spending on maintenance had grown by twelve percent, "
    "mostly because of repairs to the roof of the library, while the sports programme came in under budget. "
    "After a long discussion, members voted to postpone the new playground until the spring."
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
]
FORMATS = {
    "float32": LoadOptions(),
    "q8": LoadOptions(quantization="q8"),
    "q4": LoadOptions(quantization="q4"),
    "w8a8": LoadOptions(quantization="w8a8"),
    "w4a8": LoadOptions(quantization="w4a8"),
    "GGUF blocks": LoadOptions(extra={"keep_gguf_blocks": True}),
    "fp8": LoadOptions(quantization="fp8"),
    # The GPU's compute dtype: bf16 itself, and the w8a16 / fp8 forms as a GPU runs them (weights
    # upcast to bf16 in the product); the quality is the weights', the same on any device.
    "bfloat16": LoadOptions(dtype="bfloat16"),
    "q8-bf16": LoadOptions(quantization="q8", dtype="bfloat16"),
    "fp8-bf16": LoadOptions(quantization="fp8", dtype="bfloat16"),
}


def all_logits(model, ids: list[int]) -> np.ndarray:
    blocks = -(-len(ids) // 16)
    cache = model.allocate_cache(blocks, 16)
    chunk = SequenceChunk(np.asarray(ids, np.int32), 0, np.arange(blocks, dtype=np.int32), all_logits=True)
    return model.forward(ForwardBatch([chunk], 16), cache).all_logits[0]


def greedy(model, ids: list[int], n: int) -> list[int]:
    blocks = -(-(len(ids) + n) // 16)
    cache, table = model.allocate_cache(blocks, 16), np.arange(blocks, dtype=np.int32)
    out = model.forward(ForwardBatch([SequenceChunk(np.asarray(ids, np.int32), 0, table)], 16), cache)
    toks = [int(out.logits[0].argmax())]
    for i in range(n - 1):
        chunk = SequenceChunk(np.asarray(toks[-1:], np.int32), len(ids) + i, table)
        toks.append(int(model.forward(ForwardBatch([chunk], 16), cache).logits[0].argmax()))
    return toks


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    x = logits[:-1].astype(np.float64)
    x -= x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


def mean_kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean over positions of KL(p || q) between the softmaxes of two logit matrices."""

    def logsoftmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = logsoftmax(p_logits), logsoftmax(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def main() -> int:
    from ruvllm_jax.runner import JaxModel

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma list from {', '.join(FORMATS)}")
    args = ap.parse_args()
    wanted = ["float32", *[f for f in args.formats.split(",") if f and f != "float32"]]
    unknown = [f for f in wanted if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown format(s) {', '.join(unknown)} (known: {', '.join(FORMATS)})")
    ckpt = open_checkpoint(resolve(args.model))
    tok = ckpt.tokenizer()
    ids = tok.encode(TEXT)
    prompts = [tok.encode(p) for p in PROMPTS]
    rows = []
    base_logits = base_ppl = base_greedy = None
    for name in wanted:
        opts = FORMATS[name]
        model = JaxModel.load(ckpt, opts)
        logits = all_logits(model, ids)
        ppl = perplexity(logits, ids)
        conts = [greedy(model, p, args.new_tokens) for p in prompts]
        if base_logits is None:
            base_logits, base_ppl, base_greedy = logits, ppl, conts
        top1 = float(np.mean(logits.argmax(-1) == base_logits.argmax(-1)))
        kl = mean_kl(base_logits, logits)
        diverge = [
            next((i for i, (a, b) in enumerate(zip(c, g, strict=True)) if a != b), None)
            for c, g in zip(conts, base_greedy, strict=True)
        ]
        rows.append((name, model.weight_bytes, ppl, ppl / base_ppl - 1, top1, kl, diverge))
    print(
        f"model {ckpt.path.name}, text of {len(ids)} tokens, "
        f"greedy {args.new_tokens} tokens of {len(prompts)} prompts\n"
    )
    print(
        "| weights | resident bytes | vs float32 | perplexity | change | top-1 agreement | KL to float32 (nats) "
        "| greedy first divergence |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, nbytes, ppl, change, top1, kl, div in rows:
        d = ", ".join("none" if x is None else str(x) for x in div)
        print(
            f"| {name} | {nbytes / 1e6:.1f} MB | {nbytes / rows[0][1]:.3f} | {ppl:.3f} | {change:+.2%} "
            f"| {top1:.1%} | {kl:.4f} | {d} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
