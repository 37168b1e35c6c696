"""``speculative="ngram+draft"``: each sequence drafts from the prompt lookup where it matches and pays,
from the draft model otherwise. On tiny random checkpoints written here (jax and candle-compat):
greedy output equals the non-speculative output token for token, alone and four at a time, with both
proposers used; a draft that disagrees with the target changes nothing but acceptance; a seeded
sampled request gives the same tokens run to run; the grammar's mask holds; a draft model is
required by name. And the reduced draft vocabulary (``draft_vocab_size``): a cut head's logits are
the full head's for its tokens, and greedy output is unchanged with it."""

from __future__ import annotations

import pytest

from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.engine.config import EngineConfigError
from ruvllm.sampling import SamplingParams


def _write(directory, seed: int):
    """A tiny qwen2 checkpoint with a byte-level tokenizer of one character per token (printable
    ASCII, space, newline, tab: 97 tokens), which the grammar compiler reads as it reads real ones."""
    import tokenizers
    from _jax_fixtures import TINY, write_tiny_hf_model

    path = write_tiny_hf_model(directory, "qwen2", seed=seed)
    chars = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a", "\u0109"]  # "Ġ", "Ċ", "ĉ": space, \n, \t
    assert len(chars) == TINY["vocab_size"]
    inner = tokenizers.Tokenizer(tokenizers.models.BPE({c: i for i, c in enumerate(chars)}, []))
    inner.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = tokenizers.decoders.ByteLevel()
    inner.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module", params=["candle-compat", "jax"])
def pair(request, tmp_path_factory):
    """The target and a draft of other weights (seed 1) with the same tokenizer, on one backend."""
    from ruvllm.runtime import load_model

    target = load_model(str(_write(tmp_path_factory.mktemp("target"), 0)), backend=request.param)
    other = load_model(str(_write(tmp_path_factory.mktemp("draft"), 1)), backend=request.param)
    return target, other


def _prompts(n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        motif = [(7 * i + j) % 90 + 3 for j in range(5)]
        # A repeated motif (the prompt lookup matches), then a tail of its own (it may not).
        out.append(motif * 3 + [(11 * i + 13 * j) % 90 + 3 for j in range(6)])
    return out


def _config(speculative: str | None, **kw) -> EngineConfig:
    cfg = dict(max_num_seqs=4, num_blocks=128, max_model_len=128, speculative_step_tokens=64)
    if speculative is not None:
        cfg.update(draft_model="same" if "draft" in speculative else None)
    cfg.update(kw)
    return EngineConfig(speculative=speculative, **cfg)


def _tokens(engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
    reqs = [GenerationRequest(p, SamplingParams(**vars(sampling)), request_id=str(i)) for i, p in enumerate(prompts)]
    return [[t for o in out for d in o.deltas for t in d.token_ids] for out in engine.generate(reqs)]


@pytest.mark.parametrize("concurrent", [1, 4])
def test_greedy_output_is_unchanged_with_both_proposers(pair, concurrent):
    target, _ = pair
    prompts = _prompts(concurrent)
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = _tokens(LLMEngine(target, _config(None)), prompts, sampling)
    engine = LLMEngine(target, _config("ngram+draft"), draft_model=target)
    assert _tokens(engine, prompts, sampling) == plain
    by_source = engine.speculator.stats.by_source
    assert by_source["ngram"][0] > 0 and by_source["draft"][0] > 0, by_source
    assert by_source["draft"][1] > 0  # the target drafting for itself: its drafts are kept
    assert engine.stats().blocks_used == 0


def test_a_draft_that_disagrees_changes_only_acceptance(pair):
    target, other = pair
    prompts = _prompts(2)
    sampling = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = _tokens(LLMEngine(target, _config(None)), prompts, sampling)
    engine = LLMEngine(target, _config("ngram+draft"), draft_model=other)
    assert _tokens(engine, prompts, sampling) == plain
    assert engine.stats().spec_draft_tokens > 0


def test_seeded_sampling_is_reproducible(pair):
    """Sampled requests draft by the priors, not the clock: the same seed gives the same tokens."""
    target, _ = pair
    sampling = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = LLMEngine(target, _config("ngram+draft"), draft_model=target)
        runs.append(_tokens(engine, _prompts(2), sampling))
        assert engine.stats().spec_draft_tokens > 0
    assert runs[0] == runs[1] and all(len(t) == 24 for t in runs[0])


def test_structured_output_keeps_its_mask(pair):
    import re

    from ruvllm.structured import StructuredOutput

    target, _ = pair
    regex = r"(&'){3}[a-z]"  # seven tokens; the prompt has & ' ( (ids 5 6 7): the lookup drafts ( after '
    sampling = SamplingParams(max_tokens=7, temperature=0.0, structured=StructuredOutput("regex", regex))
    prompt = _prompts(1)
    plain = _tokens(LLMEngine(target, _config(None)), prompt, sampling)[0]
    engine = LLMEngine(target, _config("ngram+draft"), draft_model=target)
    got = _tokens(engine, prompt, sampling)[0]
    assert got == plain and engine.stats().spec_accepted_tokens > 0
    assert re.fullmatch(regex, target.tokenizer.decode(got))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("cut"), 0)


@pytest.mark.parametrize("backend", ["candle-compat", "jax"])
def test_a_cut_head_gives_the_full_heads_logits_for_its_tokens(paths, backend):
    """restrict_head keeps the kept tokens' logits as they were (the jax head's panel layout kept)."""
    import numpy as np

    from ruvllm.backend import ForwardBatch, SequenceChunk
    from ruvllm.engine.batch import block_table
    from ruvllm.runtime import load_model

    full, cut = (load_model(str(paths), backend=backend) for _ in range(2))
    keep = np.asarray(sorted({*range(0, 90, 2), 93, 95, 96}), np.int64)[:48]
    cut.model.restrict_head(keep)

    def logits(model):
        cache = model.allocate_cache(4, 16)
        chunk = SequenceChunk(np.asarray(_prompts(1)[0], np.int32), 0, block_table([0, 1]))
        return np.asarray(model.forward(ForwardBatch([chunk], 16), cache).logits)

    want, got = logits(full), logits(cut)
    assert got.shape == (1, 48)
    np.testing.assert_allclose(got, want[:, keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["candle-compat", "jax"])
@pytest.mark.parametrize("speculative", ["draft", "ngram+draft"])
def test_a_reduced_draft_vocabulary_leaves_greedy_output_unchanged(paths, backend, speculative):
    """The draft (the target's weights, loaded apart) drafts over its 48 lowest ids only: the target
    keeps its drafts where they are its own choice and outputs what it would alone."""
    from ruvllm.runtime import load_model

    target = load_model(str(paths), backend=backend)
    draft = load_model(str(paths), backend=backend)
    prompts = _prompts(2)
    sampling = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = _tokens(LLMEngine(target, _config(None)), prompts, sampling)
    engine = LLMEngine(target, _config(speculative, draft_vocab_size=48), draft_model=draft)
    assert engine.drafter is not None and engine.drafter.vocab is not None and len(engine.drafter.vocab) == 48
    assert _tokens(engine, prompts, sampling) == plain
    drafted, kept = engine.speculator.stats.by_source["draft"]
    assert drafted > 0 and kept > 0
    sampled = SamplingParams(max_tokens=16, temperature=0.9, seed=2, ignore_eos=True)
    assert all(len(t) == 16 for t in _tokens(engine, prompts, sampled))
    with pytest.raises(EngineConfigError, match="the draft must be loaded apart from the target"):
        LLMEngine(target, _config(speculative, draft_vocab_size=48), draft_model=target)


def test_a_draft_model_is_required(pair):
    target, _ = pair
    with pytest.raises(EngineConfigError, match="speculative='ngram\\+draft' needs draft_model"):
        LLMEngine(target, EngineConfig(speculative="ngram+draft"))
    with pytest.raises(EngineConfigError, match="speculative must be one of ngram, draft, ngram\\+draft"):
        LLMEngine(target, EngineConfig(speculative="auto"))
