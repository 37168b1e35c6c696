"""The draft-model proposer: greedy output equals the non-speculative output (SmolLM2 drafting for
itself, jax and candle-compat, one and several sequences), quantized self-drafting (a float32
target with its w4a8 form as draft, ``draft_model="same"``), sampled requests, and a draft with
another tokenizer refused by name at start."""

from __future__ import annotations

import pytest

from ruvllm.backend import LoadOptions
from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.engine.config import EngineConfigError
from ruvllm.sampling import SamplingParams
from ruvllm.speculative.draft import DraftModelError

PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):\n", "List three colours:"]


@pytest.fixture(scope="module", params=["candle-compat", "jax"])
def llm(request, smollm2_path):
    from ruvllm.runtime import load_model

    options = LoadOptions(quantization="auto") if request.param == "jax" else None
    return load_model(str(smollm2_path), backend=request.param, options=options)


def _config(**kw) -> EngineConfig:
    return EngineConfig(max_num_seqs=8, num_blocks=256, max_model_len=256, speculative_step_tokens=64, **kw)


def _tokens(engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
    reqs = [GenerationRequest(p, SamplingParams(**vars(sampling)), request_id=str(i)) for i, p in enumerate(prompts)]
    return [[t for o in out for d in o.deltas for t in d.token_ids] for out in engine.generate(reqs)]


@pytest.mark.parametrize("concurrent", [1, 4])
def test_greedy_output_is_unchanged_with_a_draft_model(llm, concurrent):
    prompts = [llm.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(concurrent)]
    sampling = SamplingParams(max_tokens=24, temperature=0.0)
    plain = _tokens(LLMEngine(llm, _config()), prompts, sampling)
    engine = LLMEngine(llm, _config(speculative="draft", draft_model="same"), draft_model=llm)
    assert _tokens(engine, prompts, sampling) == plain
    stats = engine.stats()
    # The model drafting for itself: nearly every draft token is kept (not all on jax: the draft
    # catches up through the prompt path, whose sums differ in the last bits, which flips near-ties).
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens >= 0.8 * stats.spec_draft_tokens
    assert stats.blocks_used == 0


def test_sampled_requests_with_a_draft_model(llm):
    engine = LLMEngine(llm, _config(speculative="draft", draft_model="same"), draft_model=llm)
    sampling = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True)
    got = _tokens(engine, [llm.tokenizer.encode(PROMPTS[0])] * 2, sampling)
    assert [len(t) for t in got] == [20, 20]
    assert engine.stats().spec_draft_tokens > 0 and engine.stats().spec_accepted_tokens > 0


def test_quantized_self_drafting(smollm2_path):
    """A float32 target drafts with its own w4a8 form: the same greedy output, most drafts kept."""
    from ruvllm.runtime import load_model

    target = load_model(str(smollm2_path), backend="jax", options=LoadOptions(quantization="none"))
    prompts = [target.tokenizer.encode(p) for p in PROMPTS[:2]]
    sampling = SamplingParams(max_tokens=24, temperature=0.0)
    plain = _tokens(LLMEngine(target, _config()), prompts, sampling)
    engine = LLMEngine(target, _config(speculative="draft", draft_model="same", draft_quantization="w4a8"))
    assert engine.drafter is not None and engine.drafter.model.options.quantization == "w4a8"
    assert _tokens(engine, prompts, sampling) == plain
    stats = engine.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_acceptance_rate > 0.5


def test_a_draft_with_another_tokenizer_is_refused(smollm2_path, tmp_path):
    from _jax_fixtures import write_tiny_hf_model
    from _tiny_served_fixtures import write_word_tokenizer

    from ruvllm.runtime import load_model

    path = write_tiny_hf_model(tmp_path, "llama")
    write_word_tokenizer(path)
    tiny = load_model(str(path), backend="jax")
    target = load_model(str(smollm2_path), backend="candle-compat")
    with pytest.raises(DraftModelError, match="a draft must share the target's tokenizer"):
        LLMEngine(target, _config(speculative="draft", draft_model=str(path)), draft_model=tiny)
    with pytest.raises(EngineConfigError, match="needs draft_model"):
        LLMEngine(target, _config(speculative="draft"))
