"""Rejection sampling (speculative decoding's verifier) keeps the target's distribution: on a toy
vocabulary of 16, for deterministic proposals (n-gram lookup: a one-hot q) and for proposals drawn
from a draft distribution, 20,000 samples per position, chi-square p > 0.01. Also the n-gram index
and the adaptive draft length, which need no model."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from ruvllm.sampling import Sampler, SamplingParams
from ruvllm.speculative import DraftLength, NgramIndex, rejection_sample, verify_draft

VOCAB = 16
SAMPLES = 20_000


def _probs(rng: np.random.Generator, rows: int) -> np.ndarray:
    p = rng.dirichlet(np.full(VOCAB, 0.7), size=rows)
    p[:, 3] = 0.0  # a token the target never picks (a draft of it is always refused)
    return p / p.sum(axis=1, keepdims=True)


def _check(counts: np.ndarray, p: np.ndarray) -> None:
    live = p > 0
    assert counts[~live].sum() == 0, "a token of probability 0 was emitted"
    assert chisquare(counts[live], p[live] * counts.sum()).pvalue > 0.01


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_rejection_sampling_keeps_the_target_distribution(kind):
    rng = np.random.default_rng(1)
    k = 3
    p = _probs(rng, k + 1)
    q = _probs(np.random.default_rng(2), k) if kind == "draft" else None
    fixed = [int(np.argmax(p[0])), 3, 5]  # a likely token, an impossible one, an arbitrary one
    counts = np.zeros((k + 1, VOCAB), np.int64)
    reached = np.zeros(k + 1, np.int64)
    for _ in range(SAMPLES):
        draft = fixed if q is None else [int(rng.choice(VOCAB, p=q[i])) for i in range(k)]
        out = rejection_sample(p, draft, q, rng)
        for i, t in enumerate(out):
            counts[i, t] += 1
            reached[i] += 1
    # The toy target's rows do not depend on the tokens before them, so each position's tokens are
    # distributed as its row, however often drafts are kept.
    _check(counts[0], p[0])
    assert reached[0] == SAMPLES
    for i in range(1, k + 1):
        if reached[i] >= 2000:
            _check(counts[i], p[i])
    if q is None:
        assert reached[2] == 0  # the impossible token is never kept, so nothing follows it


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=1.0, top_k=5), dict(top_p=0.8)])
def test_sampler_verification_draws_from_the_sampler_distribution(params):
    """verify_draft on a request's sampler: the first token it emits is distributed as the
    sampler's own probabilities (temperature, top_k, top_p applied), whatever the draft."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, VOCAB)).astype(np.float32)
    cand, probs = Sampler(SamplingParams(**params)).probabilities(logits[0])
    want = np.zeros(VOCAB)
    want[cand] = probs
    draft = [int(np.argsort(-logits[0])[1])]  # the second most likely token
    counts = np.zeros(VOCAB, np.int64)
    for i in range(SAMPLES // 4):
        sampler = Sampler(SamplingParams(seed=i, **params))
        sample, _ = next(verify_draft(sampler, logits, draft))
        counts[sample.token_id] += 1
    _check(counts, want)


def test_greedy_verification_keeps_the_argmax_prefix():
    logits = np.zeros((4, VOCAB), np.float32)
    for i, t in enumerate([5, 6, 9, 2]):
        logits[i, t] = 10.0
    sampler = Sampler(SamplingParams(temperature=0.0, logprobs=1))
    got = [(s.token_id, kept) for s, kept in verify_draft(sampler, logits, [5, 6, 7])]
    assert got == [(5, True), (6, True), (9, False)]
    assert sampler.generated == 3
    sampler = Sampler(SamplingParams(temperature=0.0))
    got = [(s.token_id, kept) for s, kept in verify_draft(sampler, logits, [5, 6, 9])]
    assert got == [(5, True), (6, True), (9, True), (2, False)]  # all kept: the bonus token


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),  # every row's argmax in one pass
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4]),  # the ban: row by row
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, frequency_penalty=2.0),
        SamplingParams(top_k=1, temperature=0.7, logit_bias={7: 0.5}),
    ],
    ids=["plain", "min-tokens", "repetition", "frequency", "top-k-1-bias"],
)
def test_greedy_verification_emits_what_sampling_row_by_row_would(params):
    """Whichever way a greedy verification picks (all rows' argmax at once, or the sampler row by
    row), it emits the tokens a token-at-a-time run samples, ties (the lowest id) included."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        logits = np.round(rng.standard_normal((6, VOCAB)), 1).astype(np.float32)  # rounded: ties
        reference = Sampler(params, [1, 2])
        want = [reference.sample(row).token_id for row in logits]
        draft = want[:5] if rng.random() < 0.5 else [*want[:2], (want[2] + 1) % VOCAB, *want[3:5]]
        sampler = Sampler(params, [1, 2])
        got = [s.token_id for s, _ in verify_draft(sampler, logits, draft)]
        kept = next((i for i, (d, w) in enumerate(zip(draft, want, strict=False)) if d != w), len(draft))
        assert got == want[: kept + 1]
        assert sampler.generated == kept + 1


def test_ngram_index_proposes_what_followed_the_longest_suffix():
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3])
    # [1, 2, 3] occurred at the start, followed by 4, 9: the longest match wins over [2, 3] -> 5.
    assert index.propose(2) == [4, 9]
    assert index.propose(0) == []
    index.extend([7])
    assert index.propose(3) == []  # 7 never occurred before
    index.sync([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3, 7, 2, 3])
    assert index.propose(2) == [7, 2]  # [2, 3]'s latest earlier occurrence was followed by 7
    with pytest.raises(ValueError, match="n_min"):
        NgramIndex(3, 2)


def test_draft_length_shrinks_and_stops_on_low_acceptance():
    length = DraftLength(4, stop_below=0.2, warmup=8)
    length.observe(4, 4)
    assert length.want() == 4
    length.observe(4, 1)
    assert length.want() == 2
    length.observe(2, 0)
    assert length.want() == 1
    for _ in range(8):
        length.observe(1, 0)
    assert length.want() == 0 and length.stopped


def test_draft_length_drafts_only_what_pays_for_its_positions():
    from ruvllm.speculative.adaptive import PROBE_AFTER, expected_tokens

    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(1.0, 3) == 4.0
    length = DraftLength(4, row_cost=0.2, stop_below=0.0)
    assert length.want() == 4  # all kept so far: the longest draft
    length.rate = 0.6  # 1.96 tokens for 1.4 of cost with two tokens: the best
    assert length.want() == 2
    length.rate = 0.15  # no draft beats a plain step; it tries one token now and then
    wants = [length.want() for _ in range(PROBE_AFTER)]
    assert wants.count(0) == PROBE_AFTER - 1 and wants[-1] == 1
