"""Sampling parameters on synthetic logits: each test fails if its parameter is ignored.

The engine-level checks of the same parameters on SmolLM2 live in tests/test_engine.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from ruvllm.engine.sequence import StopStringText
from ruvllm.errors import RequestError
from ruvllm.sampling import Sampler, SamplingParams, log_softmax

V = 50


@pytest.fixture
def logits() -> np.ndarray:
    rng = np.random.default_rng(1234)
    return rng.normal(0.0, 2.0, V).astype(np.float32)


def _draws(params: SamplingParams, logits: np.ndarray, k: int = 400) -> list[int]:
    s = Sampler(params)
    return [s.sample(logits).token_id for _ in range(k)]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_greedy_and_top_k_1_pick_the_argmax(logits):
    best = int(np.argmax(logits))
    assert set(_draws(SamplingParams(temperature=0.0), logits, 5)) == {best}
    assert set(_draws(SamplingParams(temperature=1.5, top_k=1), logits, 50)) == {best}
    # Without top_k the same temperature draws other tokens too.
    assert len(set(_draws(SamplingParams(temperature=1.5), logits, 50))) > 1


def test_temperature_scales_the_distribution(logits):
    for t in (0.5, 1.0, 1.7):
        cand, probs = Sampler(SamplingParams(temperature=t)).probabilities(logits)
        full = np.zeros(V)
        full[cand] = probs
        np.testing.assert_allclose(full, _softmax(logits.astype(np.float64) / t), rtol=1e-12, atol=1e-15)


def test_top_k_keeps_the_k_most_likely(logits):
    cand, probs = Sampler(SamplingParams(top_k=5)).probabilities(logits)
    assert set(cand.tolist()) == set(np.argsort(-logits)[:5].tolist())
    assert set(_draws(SamplingParams(top_k=5), logits)) <= set(cand.tolist())
    np.testing.assert_allclose(probs.sum(), 1.0)


def test_top_p_keeps_the_smallest_set_reaching_p(logits):
    p_full = _softmax(logits.astype(np.float64))
    order = np.argsort(-p_full)
    cum = np.cumsum(p_full[order])
    k = int(np.argmax(cum >= 0.8)) + 1
    cand, probs = Sampler(SamplingParams(top_p=0.8)).probabilities(logits)
    assert cand.tolist() == order[:k].tolist()
    np.testing.assert_allclose(probs, p_full[order[:k]] / p_full[order[:k]].sum(), rtol=1e-12)
    assert set(_draws(SamplingParams(top_p=0.8), logits)) <= set(cand.tolist())


def test_min_p_drops_tokens_below_a_fraction_of_the_best(logits):
    p_full = _softmax(logits.astype(np.float64))
    expected = set(np.flatnonzero(p_full >= 0.1 * p_full.max()).tolist())
    cand, _ = Sampler(SamplingParams(min_p=0.1)).probabilities(logits)
    assert set(cand.tolist()) == expected
    assert len(expected) < V
    assert set(_draws(SamplingParams(min_p=0.1), logits)) <= expected


def test_logit_bias_forces_and_bans(logits):
    worst = int(np.argmin(logits))
    assert set(_draws(SamplingParams(temperature=1.0, logit_bias={worst: 100.0}), logits, 50)) == {worst}
    best = int(np.argmax(logits))
    assert best not in _draws(SamplingParams(temperature=0.0, logit_bias={best: -100.0}), logits, 3)


def test_same_seed_repeats_and_different_seeds_differ(logits):
    flat = np.zeros(V, np.float32)
    a = _draws(SamplingParams(seed=7), flat, 30)
    assert a == _draws(SamplingParams(seed=7), flat, 30)
    assert a != _draws(SamplingParams(seed=8), flat, 30)
    # The choices of an n > 1 request draw from different streams.
    s0 = Sampler(SamplingParams(seed=7), choice_index=0)
    s1 = Sampler(SamplingParams(seed=7), choice_index=1)
    assert [s0.sample(flat).token_id for _ in range(30)] != [s1.sample(flat).token_id for _ in range(30)]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    x = np.array([2.0, -2.0, 3.0, -1.0, 0.5], np.float32)
    s = Sampler(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt_token_ids=[0, 1])
    assert s.sample(np.array([0, 0, 0, 0, 9.0], np.float32)).token_id == 4  # token 4 is now produced
    adj = s.adjust(x)
    np.testing.assert_allclose(adj, [1.0, -4.0, 3.0, -1.0, 0.25])


def test_presence_and_frequency_penalties_follow_the_openai_definition():
    s = Sampler(SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25))
    for tok in (3, 3, 1):  # token 3 produced twice, token 1 once
        one_hot = np.full(5, -50.0, np.float32)
        one_hot[tok] = 50.0
        assert s.sample(one_hot).token_id == tok
    x = np.zeros(5, np.float32)
    np.testing.assert_allclose(s.adjust(x), [0.0, -0.75, 0.0, -1.0, 0.0])
    # Penalties apply to produced tokens only, not to the prompt.
    s2 = Sampler(SamplingParams(presence_penalty=1.0), prompt_token_ids=[2])
    np.testing.assert_allclose(s2.adjust(x), np.zeros(5))


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    eos = 4
    logits = np.array([0.0, 0.0, 0.0, 0.0, 10.0], np.float32)
    s = Sampler(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3]), eos_token_ids=(eos,))
    picks = [s.sample(logits).token_id for _ in range(4)]
    assert picks[:3] != [eos] * 3 and eos not in picks[:3] and 3 not in picks[:3]
    assert picks[3] == eos


def test_logprobs_are_log_softmax_of_the_raw_logits(logits):
    s = Sampler(SamplingParams(temperature=0.7, top_k=3, logprobs=5, repetition_penalty=1.3, seed=0))
    r = s.sample(logits)
    ref = log_softmax(logits.astype(np.float64))
    assert r.logprob == pytest.approx(ref[r.token_id], abs=1e-12)
    assert [t for t, _ in r.top_logprobs] == np.argsort(-ref)[:5].tolist()
    np.testing.assert_allclose([lp for _, lp in r.top_logprobs], np.sort(ref)[::-1][:5], atol=1e-12)
    # Reference the other way round too: exp of log_softmax sums to 1.
    assert np.exp(ref).sum() == pytest.approx(1.0)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_k": -1},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"presence_penalty": 3.0},
        {"min_tokens": 9, "max_tokens": 8},
        {"n": 0},
        {"logprobs": 21},
        {"logit_bias": {V: 1.0}},
        {"logit_bias": {0: 101.0}},
        {"stop": [""]},
        {"stop_token_ids": [V]},
    ],
)
def test_invalid_parameters_raise_request_error(bad):
    with pytest.raises(RequestError):
        SamplingParams(**bad).validate(vocab_size=V)


# -- stop strings in streamed text ------------------------------------------------------------


def _stream(pieces: list[str], stop: list[str]) -> tuple[list[str], str | None]:
    out = StopStringText(stop)
    emitted = []
    for p in pieces:
        text, found = out.feed(p, True)
        emitted.append(text)
        if found is not None:
            return emitted, found
    text, found = out.finish("", True)
    emitted.append(text)
    return emitted, found


def test_stop_string_spanning_pieces_is_cut_exactly_and_never_leaks():
    emitted, found = _stream(["Hello wor", "ld! STO", "P here"], ["STOP"])
    assert found == "STOP"
    assert "".join(emitted) == "Hello world! "
    # The partial "STO" was held back, never emitted before the match was known.
    assert emitted[1] == "ld! "


def test_held_back_text_is_released_when_it_is_not_a_stop():
    emitted, found = _stream(["a ST", "ART b"], ["STOP"])
    assert found is None
    assert emitted == ["a ", "START b", ""]


def test_held_text_comes_out_at_the_end():
    emitted, found = _stream(["x S", "T"], ["STOP"])
    assert found is None and "".join(emitted) == "x ST"


def test_earliest_of_several_stop_strings_wins():
    emitted, found = _stream(["one two three"], ["three", "two"])
    assert found == "two" and "".join(emitted) == "one "
