"""Greedy answers do not change under load on the jax backend's default path (w4a8, native CPU
kernels): 24 different prompts run through the engine one at a time, then all together, give the
same token ids, for the variant this CPU runs by default and every other variant it can run (the
scalar loops, slow, on fewer prompts and tokens). Gemma-3 270M has one kv head, the case where a lone
sequence's decode attention is split across threads."""

from __future__ import annotations

import pytest

from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.sampling import SamplingParams

SUBJECTS = [
    "The capital of France",
    "My favourite colour",
    "Water boils at",
    "The quick brown fox",
    "Once upon a time",
    "Python is a programming language",
    "The moon orbits",
    "In 1492 Columbus",
    "The best way to learn",
    "Cats and dogs",
    "A healthy breakfast",
    "The theory of relativity",
]
PROMPTS = [s + e for s in SUBJECTS for e in ("", " is, as far as anyone knows,")]
MAX_TOKENS = 24


def _tokens(outputs) -> list[int]:
    return [t for o in outputs for d in o.deltas for t in d.token_ids]


def _alone_and_together(llm, count: int = len(PROMPTS), max_tokens: int = MAX_TOKENS) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(llm, EngineConfig(num_blocks=256, max_num_seqs=32))
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:count]]
    alone = [_tokens(engine.generate([GenerationRequest(p, params)])[0]) for p in prompts]
    together = [_tokens(o) for o in engine.generate([GenerationRequest(p, params) for p in prompts])]
    changed = [i for i, (a, b) in enumerate(zip(alone, together, strict=True)) if a != b]
    assert not changed, f"{len(changed)} of {count} greedy answers changed under load (prompts {changed})"
    assert all(len(a) == max_tokens for a in alone)


def _load(path):
    from ruvllm.backend import LoadOptions
    from ruvllm.runtime import load_model

    # quantization "auto": what `ruvllm serve` and `ruvllm run` load by default
    llm = load_model(str(path), backend="jax", options=LoadOptions(quantization="auto"))
    if llm.options.quantization != "w4a8":
        pytest.skip(f"the jax backend's default here is {llm.options.quantization}, not the native w4a8 path")
    return llm


def _variants() -> list:
    from ruvllm_jax import native

    if not native.available():
        return [None]
    default = native.isa()
    # The scalar loops take over a minute here: slow; the vector variants a few seconds each.
    others = [pytest.param(i, marks=pytest.mark.slow) if i == "scalar" else i
              for i in native.supported_isas() if i != default]  # fmt: skip
    return [None, *others]


@pytest.mark.parametrize("isa", _variants())
def test_smollm2_greedy_answers_do_not_change_under_load(smollm2_path, isa):
    from ruvllm_jax import native

    llm = _load(smollm2_path)
    if isa is None:
        return _alone_and_together(llm)
    with native.use_isa(isa):
        if isa == "scalar":  # the reference loops run ~50x slower: a batch of 9 still meets every block width
            _alone_and_together(llm, 9, 8)
        else:
            _alone_and_together(llm)


def test_gemma3_greedy_answers_do_not_change_under_load(gemma3_path):
    _alone_and_together(_load(gemma3_path))
