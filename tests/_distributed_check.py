"""Run by test_distributed.py: one process of a two-process group (``leader`` or ``follower``), or the
single-process reference (``alone``). The leader and the reference print the greedy tokens of a few
prompts as one JSON line (``TOKENS [...]``)."""

from __future__ import annotations

import json
import os
import sys

from ruvllm.backend import LoadOptions
from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.runtime import load_model
from ruvllm.sampling import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [11, 3], list(range(20, 60))]


def generate(path: str, options: LoadOptions) -> None:
    model = load_model(path, backend="jax", options=options)
    engine = LLMEngine(model, EngineConfig(num_blocks=64, max_num_seqs=4))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = engine.generate([GenerationRequest(p, params, request_id=str(i)) for i, p in enumerate(PROMPTS)])
    tokens = [[t for o in out for d in o.deltas for t in d.token_ids] for out in outs]
    print("TOKENS", json.dumps(tokens), flush=True)
    close = getattr(model.model, "close", None)
    if close is not None:
        close()


def rounds(path: str, options: LoadOptions) -> None:
    """Generate round after round until a step fails (the test kills the follower meanwhile)."""
    model = load_model(path, backend="jax", options=options)
    engine = LLMEngine(model, EngineConfig(num_blocks=64, max_num_seqs=4))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for r in range(10_000):
        try:
            engine.generate([GenerationRequest(p, params, request_id=f"{r}-{i}") for i, p in enumerate(PROMPTS)])
        except Exception as exc:
            print("ERROR", f"{type(exc).__name__}: {exc}", flush=True)
            # Not sys.exit: the distributed runtime's shutdown barrier would wait for the dead process.
            os._exit(1)
        print("ROUND", r, flush=True)


def main() -> None:
    role, path, coordinator = sys.argv[1], sys.argv[2], sys.argv[3]
    if role == "alone":
        generate(path, LoadOptions(quantization="none"))
        return
    from ruvllm_jax import distributed

    distributed.initialize(coordinator, num_processes=2, process_id=0 if role.startswith("leader") else 1)
    options = LoadOptions(quantization="none", extra={"tensor_parallel": 2})
    if role == "leader":
        generate(path, options)
    elif role == "leader-rounds":
        rounds(path, options)
    else:
        distributed.follow(path, options)
        print("FOLLOWER DONE", flush=True)


if __name__ == "__main__":
    main()
