"""The batch sampler's short paths against the reference: plain greedy rows (nothing adjusts them, no
logprobs) are one argmax of the raw row, read-only rows (a backend's host logits, as jax hands them
over) are read without a copy, and ``check_finite`` fails a row holding an infinite or NaN logit in
the same pass, leaving its sampler untouched and the other rows sampled as usual."""

from __future__ import annotations

import numpy as np
import pytest

from ruvllm.sampling import Sampler, SamplingParams, argmax_rows, sample_batch
from ruvllm.sampling.batch import NON_FINITE
from ruvllm.sampling.selection import unlocked

VOCAB = 1003


def read_only(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


def logits(rows: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).normal(0.0, 2.0, (rows, VOCAB))
    x[:, ::97] = np.round(x[:, ::97])  # a few exact ties between groups
    return x.astype(np.float32)


def samplers(kinds: list[dict]) -> list[Sampler]:
    return [Sampler(SamplingParams(**kw, seed=i), [1, 2, 3], (2,)) for i, kw in enumerate(kinds)]


MIXED = [
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.3),
    dict(temperature=0.8, top_k=20),
    dict(temperature=0.0, logprobs=3),
    dict(temperature=0.7, top_k=1),
    dict(temperature=0.0, min_tokens=3, stop_token_ids=[5]),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.0),
]


@pytest.mark.parametrize("as_list", [False, True])
def test_read_only_rows_equal_the_reference(as_list):
    x = read_only(logits(len(MIXED)))
    fast, ref = samplers(MIXED), samplers(MIXED)
    for step in range(4):
        rows = [x[i] for i in range(len(x))] if as_list else x
        got = sample_batch(fast, rows)
        want = [s.sample(row) for s, row in zip(ref, x, strict=True)]
        assert [g.token_id for g in got] == [w.token_id for w in want], step
        for g, w in zip(got, want, strict=True):
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
            assert [t for t, _ in g.top_logprobs] == [t for t, _ in w.top_logprobs]
        assert [s.generated for s in fast] == [s.generated for s in ref]
    assert not x.flags.writeable


def test_plain_greedy_ties_take_the_first():
    x = np.zeros((3, VOCAB), np.float32)
    x[0, [5, 9]] = 4.0
    x[1, [900, 7]] = 1.0
    got = sample_batch(samplers([dict(temperature=0.0)] * 3), read_only(x))
    assert [g.token_id for g in got] == [5, 7, 0]
    assert all(g.logprob == 0.0 and g.top_logprobs == [] for g in got)


def test_argmax_rows_reads_read_only_logits_in_place():
    x = read_only(logits(4, seed=3))
    view = unlocked(x)
    assert np.shares_memory(view, x) and view.flags.writeable and not x.flags.writeable
    np.testing.assert_array_equal(argmax_rows(x), x.argmax(axis=-1))
    y = logits(2, seed=4).astype(np.float64)  # another dtype: NumPy's own argmax
    np.testing.assert_array_equal(argmax_rows(y), y.argmax(axis=-1))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("as_list", [False, True])
def test_check_finite_fails_the_row_alone(bad, as_list):
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=20), dict(temperature=0.0), dict(temperature=0.9)]
    x = logits(len(kinds), seed=5)
    x[0, 17] = bad
    x[3, 400] = bad
    x = read_only(x)
    fast, ref = samplers(kinds), samplers(kinds)
    rows = [x[i] for i in range(len(x))] if as_list else x
    got = sample_batch(fast, rows, return_exceptions=True, check_finite=True)
    for i in (0, 3):
        assert isinstance(got[i], FloatingPointError) and str(got[i]) == NON_FINITE
        assert fast[i].generated == 0
    for i in (1, 2):
        assert got[i].token_id == ref[i].sample(x[i]).token_id
    with pytest.raises(FloatingPointError, match="non-finite"):
        sample_batch(samplers(kinds), rows, check_finite=True)


def test_check_finite_reads_a_repeated_row_once_and_fails_every_choice():
    """The choices of a fork share their row."""
    x = logits(2, seed=6)
    x[1, 3] = np.nan
    rows = [x[0], x[0], x[1], x[1]]
    got = sample_batch(samplers([dict(temperature=0.0)] * 4), rows, return_exceptions=True, check_finite=True)
    assert got[0].token_id == got[1].token_id == int(x[0].argmax())
    assert all(isinstance(g, FloatingPointError) for g in got[2:])


def test_check_finite_leaves_other_dtypes_to_the_full_pass():
    ok = logits(1, seed=7)[0]
    got = sample_batch(
        samplers([dict(temperature=0.0)] * 3),
        [ok.astype(np.float64), ok, np.full(VOCAB, np.inf)],
        return_exceptions=True,
        check_finite=True,
    )
    assert got[0].token_id == got[1].token_id == int(ok.argmax())
    assert isinstance(got[2], FloatingPointError)


def test_unlocked_leaves_other_dtypes_locked():
    x = read_only(np.arange(12, dtype=np.int32).reshape(3, 4))
    view = unlocked(x, (3, 2), (16, 4))
    assert not view.flags.writeable
    np.testing.assert_array_equal(view, x[:, :2])
