"""Many adapters at once: aggregate decode tok/s of SmolLM2 on the jax backend (quantization auto) at
``--streams`` concurrent streams with 0, 1 and 4 distinct rank-16 LoRA adapters (q, k, v, o of every
layer), assigned round-robin, and with every stream on one X-LoRA model over those 4 adapters (a
random one-layer classifier; two passes a step), in one run through the engine. Every stream decodes exactly
``--tokens`` tokens; aggregate = all tokens / wall time of the batch. Medians over ``--iterations``
after a warm-up per arm (compilation), arms interleaved.

Run: ``python benchmarks/bench_adapters.py [--streams 32] [--tokens 64] [--iterations 3] [--json F]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from provenance import cpu_summary

from ruvllm.adapters import LoraWeights, XLoraAdapter
from ruvllm.backend import LoadOptions
from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.runtime import load_model
from ruvllm.sampling import SamplingParams


def random_adapter(
    cfg, name: str, seed: int, rank: int = 16, projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
) -> LoraWeights:
    rng = np.random.default_rng(seed)
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    every = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
             "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}  # fmt: skip
    shapes = {p: every[p] for p in projections}
    params = {
        (layer, proj): (
            (rng.standard_normal((rank, inp)) / np.sqrt(inp)).astype(np.float32),
            (rng.standard_normal((out, rank)) * 0.01).astype(np.float32),
            2.0,
        )
        for layer in range(cfg.num_layers)
        for proj, (out, inp) in shapes.items()
    }
    return LoraWeights(name, params)


def run(engine: LLMEngine, prompts: list[list[int]], adapters: list, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
    requests = [
        GenerationRequest(p, params, adapter=adapters[i % len(adapters)] if adapters else None)
        for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    results = engine.generate(requests)
    wall = time.perf_counter() - t0
    total = sum(outs[-1].metrics.completion_tokens for outs in results)
    assert total == tokens * len(prompts)
    return total / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    model = load_model("smollm2", backend="jax", options=LoadOptions(quantization="auto"))
    engine = LLMEngine(model, EngineConfig(num_blocks=1024, max_num_seqs=args.streams))
    tok = engine.tokenizer
    prompts = [tok.encode(f"Story number {i}: once upon a time") for i in range(args.streams)]
    four = [random_adapter(model.config, f"a{k}", k) for k in range(4)]
    rng = np.random.default_rng(9)
    weight = (rng.standard_normal((4, model.config.hidden_size)) * 0.05).astype(np.float32)
    classifier = (weight, np.zeros(4, np.float32))
    arms = {
        "no adapter": [],
        "1 adapter": [random_adapter(model.config, "a0", 0)],
        "4 adapters": four,
        "X-LoRA, 4 experts": [XLoraAdapter("xlora", tuple(four), (classifier,))],
    }
    figures: dict[str, list[float]] = {name: [] for name in arms}
    for adapters in arms.values():
        run(engine, prompts, adapters, args.tokens)  # warm-up: compile this arm's shapes
    for _ in range(args.iterations):
        for name, adapters in arms.items():
            figures[name].append(run(engine, prompts, adapters, args.tokens))
    base = statistics.median(figures["no adapter"])
    print(f"cpu: {cpu_summary()}")
    print(f"| arm | aggregate tok/s at {args.streams} streams | vs no adapter |")
    print("|---|---|---|")
    for name, values in figures.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {med / base:.3f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"cpu": cpu_summary(), "streams": args.streams, "figures": figures}, fh, indent=1)


if __name__ == "__main__":
    main()
