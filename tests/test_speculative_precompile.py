"""With speculative decoding on, the jax backend's precompiled step set holds the verification
chunks' shapes (their positions run as decoding rows): a workload of drafting sequences beside
prompts compiles nothing while it runs, and its greedy output is the non-speculative one."""

from __future__ import annotations

import pytest

from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny_jax(tmp_path_factory):
    from _jax_fixtures import write_tiny_hf_model
    from _tiny_served_fixtures import write_word_tokenizer

    from ruvllm.runtime import load_model

    path = write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")
    write_word_tokenizer(path)
    return load_model(str(path), backend="jax")


def _requests(prefix: str) -> list[GenerationRequest]:
    out = []
    for i, n in enumerate([3, 40, 7]):
        motif = [(5 * i + j) % 60 + 1 for j in range(4)]
        prompt = (motif * (n // 4 + 1))[:n]  # repetitive: the n-gram proposer finds drafts
        params = SamplingParams(max_tokens=12 + 3 * i, temperature=0.0, ignore_eos=True)
        out.append(GenerationRequest(prompt, params, request_id=f"{prefix}{i}"))
    return out


def _tokens(outputs) -> list[int]:
    return [t for out in outputs for d in out.deltas for t in d.token_ids]


@pytest.mark.slow  # compiles every step shape twice (every position's logits): ~40 s on a busy 2-core machine
def test_verification_chunks_are_precompiled(tiny_jax):
    config = dict(max_num_seqs=1, max_num_batched_tokens=16, num_blocks=256)
    engine = LLMEngine(tiny_jax, EngineConfig(speculative="ngram", num_speculative_tokens=2, **config))
    engine.precompile()
    jm = tiny_jax.model
    compiled, copies = jm.compiled_steps.stats.count, jm.block_copier.programs.stats.count
    got = engine.generate(_requests("spec-"))
    assert engine.stats().spec_draft_tokens > 0
    assert jm.compiled_steps.stats.count == compiled and jm.block_copier.programs.stats.count == copies
    plain = LLMEngine(tiny_jax, EngineConfig(**config)).generate(_requests("plain-"))
    assert [_tokens(o) for o in got] == [_tokens(o) for o in plain]
