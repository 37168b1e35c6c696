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


def adapter(model, seed: int):
    """A seeded random LoRA adapter on q/v of layer 0 and down of the last layer, large enough to
    change greedy tokens (the same in every process that makes it)."""
    import numpy as np

    from ruvllm.adapters import LoraWeights

    c = model.config
    q, kv, h, f = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    rng = np.random.default_rng(seed)
    shapes = {(0, "q_proj"): (q, h), (0, "v_proj"): (kv, h), (c.num_layers - 1, "down_proj"): (h, f)}
    params = {
        key: ((rng.standard_normal((4, i)) / np.sqrt(i)).astype(np.float32),
              rng.standard_normal((o, 4)).astype(np.float32), 2.0)
        for key, (o, i) in shapes.items()
    }  # fmt: skip
    return LoraWeights(f"random-{seed}", params)


def generate(path: str, options: LoadOptions, *, lora: bool = False, device: bool = False) -> None:
    """The greedy tokens of PROMPTS; ``lora``: the first prompt with adapter 1, the second with
    adapter 2, the third with none, in one batch (twice: the adapters cross the channel once);
    ``device``: seeded top-p sampling on the device instead (every process runs the sampler)."""
    model = load_model(path, backend="jax", options=options)
    engine = LLMEngine(model, EngineConfig(num_blocks=64, max_num_seqs=4, sampling="device" if device else "host"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    if device:
        params = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    assert engine.device_sampling == device
    adapters = [adapter(model, 1), adapter(model, 2), None] if lora else [None] * len(PROMPTS)
    for _ in range(2 if lora else 1):
        requests = zip(PROMPTS, adapters, strict=True)
        outs = engine.generate(
            [GenerationRequest(p, params, request_id=str(i), adapter=a) for i, (p, a) in enumerate(requests)]
        )
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
    if role in ("alone", "alone-lora", "alone-device"):
        generate(path, LoadOptions(quantization="none"), lora=role.endswith("lora"), device=role.endswith("device"))
        return
    from ruvllm_jax import distributed

    distributed.initialize(coordinator, num_processes=2, process_id=0 if role.startswith("leader") else 1)
    options = LoadOptions(quantization="none", extra={"tensor_parallel": 2})
    if role in ("leader", "leader-lora", "leader-device"):
        generate(path, options, lora=role.endswith("lora"), device=role.endswith("device"))
    elif role == "leader-rounds":
        rounds(path, options)
    else:
        distributed.follow(path, options)
        print("FOLLOWER DONE", flush=True)


if __name__ == "__main__":
    main()
