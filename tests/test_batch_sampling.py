"""The batch sampler against the per-sequence reference: ``sample_batch(samplers, logits)`` must pick
exactly the tokens ``Sampler.sample`` picks, row by row and step after step (the penalty counts,
constraints and random streams evolve alike), with logprobs within 1e-5, for every parameter, for
rows of mixed kinds in one batch, and keep an error with its row.

Both sides get fresh samplers with the same seeds and prompts. Logits are float32 (the model's
dtype), of several shapes: a few hundred likely tokens over noise (like a language model's), flat
noise (whole-vocabulary candidate sets), and values on a coarse grid (many exact ties, like bf16
logits), over a small vocabulary that is not a multiple of the selection's groups and over SmolLM2's
(49152).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ruvllm.sampling import Sampler, SampleResult, SamplingParams, sample_batch, top_ids

EOS = 2
STOP = 7

PARAMS: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0),
    "top_k=1": dict(temperature=0.9, top_k=1),
    "greedy+penalties+bias": dict(
        temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.6, logit_bias={11: 9.0}
    ),
    "temperature": dict(temperature=0.8),
    "hot temperature": dict(temperature=1.7),
    "top_k": dict(temperature=0.8, top_k=40),
    "large top_k": dict(temperature=1.1, top_k=900),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "tight top_p": dict(temperature=1.0, top_p=0.3),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "top_p+min_p": dict(temperature=0.9, top_p=0.95, min_p=0.01),
    "top_k+top_p+min_p": dict(temperature=0.7, top_k=30, top_p=0.8, min_p=0.02),
    "issue config": dict(
        temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5
    ),
    "penalties that raise": dict(
        temperature=0.9, top_k=20, repetition_penalty=0.7, presence_penalty=-1.5, frequency_penalty=-0.5
    ),
    "logit_bias": dict(temperature=0.8, top_p=0.9, logit_bias={3: 12.0, 5: -100.0, 17: 6.5, 40: 100.0}),
    "min_tokens ban": dict(temperature=0.8, min_tokens=6, stop_token_ids=[STOP], logit_bias={EOS: 30.0}),
    "logprobs=0": dict(temperature=0.8, logprobs=0),
    "logprobs=5": dict(temperature=0.6, top_k=10, logprobs=5, repetition_penalty=1.2),
    "greedy logprobs=20": dict(temperature=0.0, logprobs=20),
}

KINDS = ("peaked", "flat", "tied")


def make_logits(rng: np.random.Generator, rows: int, vocab: int, kind: str) -> np.ndarray:
    x = rng.normal(0.0, 2.0, (rows, vocab))
    if kind == "peaked":  # like a language model: a few hundred plausible tokens above noise
        hot = rng.integers(0, vocab, (rows, min(300, vocab // 4)))
        np.put_along_axis(x, hot, np.take_along_axis(x, hot, axis=1) + rng.normal(7.0, 2.0, hot.shape), axis=1)
    elif kind == "tied":  # a coarse grid: many exact ties, like bf16 logits
        x = np.round(x * 4.0) / 4.0
    return x.astype(np.float32)


def pairs(params: SamplingParams, rows: int, vocab: int, seed: int = 0) -> tuple[list[Sampler], list[Sampler]]:
    """Two identical sets of samplers (prompts, seeds, choice streams)."""

    def make() -> list[Sampler]:
        rng = np.random.default_rng(seed)
        out = []
        for i in range(rows):
            prompt = rng.integers(0, vocab, int(rng.integers(0, 40))).tolist()
            p = SamplingParams(**{**vars(params), "seed": 1000 * seed + i // 2})
            out.append(Sampler(p, prompt, (EOS,), choice_index=i % 2))
        return out

    return make(), make()


def assert_same(got: list[SampleResult], want: list[SampleResult]) -> None:
    assert [r.token_id for r in got] == [r.token_id for r in want]
    for a, b in zip(got, want, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        np.testing.assert_allclose([v for _, v in a.top_logprobs], [v for _, v in b.top_logprobs], atol=1e-5)


def run(fast: list[Sampler], ref: list[Sampler], logits: np.ndarray) -> list[int]:
    got = sample_batch(fast, logits)
    want = [s.sample(row) for s, row in zip(ref, logits, strict=True)]
    assert_same(got, want)
    for a, b in zip(fast, ref, strict=True):  # the state moved alike
        assert a.generated == b.generated
        assert [x.tolist() for x in a.produced()] == [x.tolist() for x in b.produced()]
    return [r.token_id for r in got]


@pytest.mark.parametrize("name", list(PARAMS))
def test_many_rows_one_step(name):
    """200 rows of different seeds and logits of every kind, one step, vocabulary 1003."""
    rng = np.random.default_rng(7)
    fast, ref = pairs(SamplingParams(**PARAMS[name]), 200, 1003)
    logits = np.concatenate([make_logits(rng, 67, 1003, kind) for kind in KINDS])[:200]
    run(fast, ref, logits)


@pytest.mark.parametrize("name", list(PARAMS))
def test_twenty_steps_as_counts_evolve(name):
    """30 rows over 20 steps: penalties, min_tokens and the streams evolve; identical sequences."""
    rng = np.random.default_rng(11)
    fast, ref = pairs(SamplingParams(**PARAMS[name]), 30, 1003, seed=1)
    produced = []
    for step in range(20):
        produced.append(run(fast, ref, make_logits(rng, 30, 1003, KINDS[step % 3])))
    if PARAMS[name].get("min_tokens"):  # the ban held, then the biased eos came
        assert all(EOS not in row and STOP not in row for row in produced[:6])
        assert EOS in produced[6]


@pytest.mark.parametrize(
    "name", ["greedy+penalties+bias", "top_k", "top_p", "min_p", "issue config", "temperature", "logprobs=5"]
)
def test_smollm2_vocabulary(name):
    """SmolLM2's vocabulary (49152), peaked and tied logits, 4 steps."""
    rng = np.random.default_rng(3)
    fast, ref = pairs(SamplingParams(**PARAMS[name]), 24, 49152, seed=2)
    for step in range(4):
        run(fast, ref, make_logits(rng, 24, 49152, ("peaked", "tied")[step % 2]))


def test_mixed_rows_and_shared_rows_in_one_batch():
    """Greedy next to sampled next to constrained rows, choices of one request sharing their row
    (the engine's n > 1 forks pass the same array several times), over 10 steps."""
    rng = np.random.default_rng(5)
    vocab = 4096
    names = list(PARAMS)

    def make() -> list[Sampler]:
        out = []
        for i, name in enumerate(names):
            for choice in range(2):
                constraint = FakeGrammar(vocab, i) if i % 4 == 0 else None
                p = SamplingParams(**{**PARAMS[name], "seed": i})
                out.append(Sampler(p, [i, i + 1, 30 + i], (EOS,), choice_index=choice, constraint=constraint))
        return out

    fast, ref = make(), make()
    for step in range(10):
        base = make_logits(rng, len(names), vocab, KINDS[step % 3])
        rows = [base[i // 2] for i in range(len(fast))]  # each request's row, shared by its choices
        got = sample_batch(fast, rows)
        want = [s.sample(row) for s, row in zip(ref, rows, strict=True)]
        assert_same(got, want)
    for a, b in zip(fast, ref, strict=True):
        if a.constraint is not None:
            assert a.constraint.consumed == b.constraint.consumed


def test_inputs_of_any_layout_give_the_same_draws():
    """A [batch, vocab] array, a list of its rows, separate rows of another dtype: the same."""
    rng = np.random.default_rng(9)
    logits = make_logits(rng, 12, 2048, "peaked")
    results = []
    for form in (logits, list(logits), [row.astype(np.float64) for row in logits], list(logits[::-1])[::-1]):
        fast, _ = pairs(SamplingParams(**PARAMS["issue config"]), 12, 2048)
        results.append([r.token_id for r in sample_batch(fast, form)])
    assert all(r == results[0] for r in results)


# ----------------------------------------------------------------------------- structured output


class FakeGrammar:
    """A stand-in for :class:`ruvllm.structured.Constraint` (the real one is tested with llguidance
    elsewhere): a mask that changes with what was consumed; every 5th step it allows only eos (its
    end), so under a min_tokens ban nothing is left and the grammar's own mask must win."""

    def __init__(self, vocab: int, salt: int) -> None:
        self.vocab, self.salt = vocab, salt
        self.consumed: list[int] = []

    def allowed(self) -> np.ndarray:
        if len(self.consumed) % 5 == 4:
            mask = np.zeros(self.vocab, bool)
            mask[EOS] = True
            return mask
        ids = np.arange(self.vocab)
        return (ids * 7 + self.salt + len(self.consumed)) % 11 < 3  # about a quarter of the vocabulary

    def consume(self, token: int) -> None:
        if not self.allowed()[token]:
            raise AssertionError(f"token {token} is not allowed")
        self.consumed.append(token)

    @property
    def finished(self) -> bool:
        return False


def grammar_samplers(name: str, vocab: int, rows: int = 16) -> list[Sampler]:
    """Seeded samplers of PARAMS[name], each under its own FakeGrammar, with a min_tokens ban."""
    p = SamplingParams(**{**PARAMS[name], "min_tokens": 12, "stop_token_ids": [STOP]})
    return [
        Sampler(SamplingParams(**{**vars(p), "seed": i}), [1, 2, 3], (EOS,), constraint=FakeGrammar(vocab, i))
        for i in range(rows)
    ]


@pytest.mark.parametrize("name", ["greedy+penalties+bias", "issue config", "top_p", "temperature", "min_tokens ban"])
def test_grammar_masks_and_their_fallback(name):
    vocab = 1003
    rng = np.random.default_rng(13)
    fast, ref = grammar_samplers(name, vocab), grammar_samplers(name, vocab)
    for step in range(10):
        run(fast, ref, make_logits(rng, 16, vocab, KINDS[step % 3]))
    # The fallback happened: eos came at step 5 under the min_tokens ban, because the grammar said so.
    assert all(s.constraint.consumed[4] == EOS for s in fast)


# ----------------------------------------------------------------------------- errors


class Broken(FakeGrammar):
    def __init__(self, vocab: int, where: str) -> None:
        super().__init__(vocab, 0)
        self.where = where

    def allowed(self) -> np.ndarray:
        if self.where == "allowed":
            raise RuntimeError("the grammar is broken")
        return super().allowed()

    def consume(self, token: int) -> None:
        if self.where == "consume":
            raise RuntimeError("the grammar is broken")
        super().consume(token)


@pytest.mark.parametrize("where", ["allowed", "consume", "shape"])
def test_an_error_stays_with_its_row(where):
    """One bad row among 8: with return_exceptions it gets the exception, the other rows get the
    reference's tokens (a retried pass consumed nothing from their streams); without, it raises."""
    vocab = 512
    rng = np.random.default_rng(17)
    logits = list(make_logits(rng, 8, vocab, "peaked"))
    fast, ref = pairs(SamplingParams(**PARAMS["issue config"]), 8, vocab)
    if where == "shape":
        logits[3] = logits[3][None, :]  # [1, vocab]: not a row
    else:
        fast[3].constraint = Broken(vocab, where)
    got = sample_batch(fast, logits, return_exceptions=True)
    assert isinstance(got[3], (RuntimeError, ValueError))
    keep = [i for i in range(8) if i != 3]
    assert_same([got[i] for i in keep], [ref[i].sample(logits[i]) for i in keep])  # type: ignore[misc]
    fast2, _ = pairs(SamplingParams(**PARAMS["issue config"]), 8, vocab)
    if where != "shape":
        fast2[3].constraint = Broken(vocab, where)
    with pytest.raises((RuntimeError, ValueError)):
        sample_batch(fast2, logits)


def test_a_row_with_nothing_allowed_fails_alone():
    vocab = 256
    logits = np.zeros((3, vocab), np.float32)
    logits[1] = -np.inf
    fast, _ = pairs(SamplingParams(temperature=0.8, top_k=5), 3, vocab)
    got = sample_batch(fast, logits, return_exceptions=True)
    assert isinstance(got[1], FloatingPointError)
    assert isinstance(got[0], SampleResult) and isinstance(got[2], SampleResult)


def test_no_rows():
    assert sample_batch([], np.empty((0, 10), np.float32)) == []


# ----------------------------------------------------------------------------- the reference's order


def test_ties_resolve_by_token_id():
    """Tied candidates are ordered by token id, in the reference as in the batch (so a seeded draw
    does not depend on a selection algorithm's order)."""
    x = np.array([1.0, 3.0, 2.0, 3.0, 3.0, 0.5, 3.0], np.float32)
    assert top_ids(x, 3).tolist() == [1, 3, 4]
    assert top_ids(x, 7).tolist() == [1, 3, 4, 6, 2, 0, 5]
    cand, probs = Sampler(SamplingParams(top_k=3)).probabilities(x)
    assert cand.tolist() == [1, 3, 4]
    np.testing.assert_allclose(probs, [1 / 3] * 3)
    cand, _ = Sampler(SamplingParams(top_p=0.5)).probabilities(x)
    assert cand.tolist() == [1, 3, 4]  # three of the four tied reach 0.5: the lowest ids


def test_safety_nets_give_the_same_draws(monkeypatch):
    """Paths only rounding can take: a top_p row whose cut falls outside its bounded candidates is
    sorted whole, and candidate keys too wide to pack into one integer sort with np.lexsort."""
    import ruvllm.sampling.batch as batch
    from ruvllm.sampling.selection import canonical

    truncate = batch._truncate

    def never_reached(*args):
        keep, cdf, reached = truncate(*args)
        return keep, cdf, np.zeros_like(reached)

    monkeypatch.setattr(batch, "_truncate", never_reached)
    rng = np.random.default_rng(19)
    fast, ref = pairs(SamplingParams(**PARAMS["top_p"]), 12, 1003)
    for kind in KINDS:
        run(fast, ref, make_logits(rng, 12, 1003, kind))
    monkeypatch.undo()

    r = rng.integers(0, 3, 500)
    tok = rng.integers(0, 2**45, 500)
    key = np.round(rng.normal(size=500), 1)
    np.testing.assert_array_equal(canonical(r, tok, key), np.lexsort((tok, -key, r)))
    np.testing.assert_array_equal(canonical(r, tok % 1000, key), np.lexsort((tok % 1000, -key, r)))


# ----------------------------------------------------------------------------- in the engine


def test_engine_steps_equal_the_per_sequence_reference(smollm2_path, monkeypatch):
    """The engine with the batch sampler and with one ``Sampler.sample`` per sequence produce the
    same tokens and logprobs, for seeded sampling with n > 1, penalties, logprobs and greedy."""
    import ruvllm.engine.llm_engine as llm_engine
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.runtime import load_model

    llm = load_model(str(smollm2_path), backend="candle-compat")
    tok = llm.tokenizer
    requests = [
        (tok.encode("The capital of France is"), dict(temperature=0.0, repetition_penalty=1.2)),
        (tok.encode("Once upon a time"), dict(temperature=0.9, top_p=0.9, n=3, seed=4, logprobs=3)),
        (tok.encode("List three colours:"), dict(**PARAMS["issue config"], seed=5)),
        (tok.encode("def add(a, b):"), dict(temperature=1.0, min_p=0.05, seed=6, logprobs=0)),
    ]

    def generate() -> list[list[tuple[int, float | None]]]:
        engine = LLMEngine(llm, EngineConfig(num_blocks=64))
        outs = engine.generate(
            [GenerationRequest(list(p), SamplingParams(max_tokens=10, ignore_eos=True, **kw)) for p, kw in requests]
        )
        result = []
        for out in outs:
            for index in range(3):
                deltas = [d for o in out for d in o.deltas if d.index == index]
                if deltas:
                    result.append(
                        [
                            (lp.token_id, lp.logprob) if d.logprobs else (t, None)
                            for d in deltas
                            for t, lp in zip(d.token_ids, d.logprobs or [None] * len(d.token_ids), strict=True)
                        ]
                    )
        return result

    batched = generate()

    def per_sequence(samplers, rows, *, return_exceptions=False, check_finite=False):
        return [s.sample(row) for s, row in zip(samplers, rows, strict=True)]

    monkeypatch.setattr(llm_engine, "sample_batch", per_sequence)
    reference = generate()
    assert [[t for t, _ in seq] for seq in batched] == [[t for t, _ in seq] for seq in reference]
    for a, b in zip(batched, reference, strict=True):
        for (_, x), (_, y) in zip(a, b, strict=True):
            assert (x is None) == (y is None) and (x is None or abs(x - y) <= 1e-5)


def test_engine_fails_only_the_request_whose_sampling_fails(smollm2_path, monkeypatch):
    import ruvllm.engine.llm_engine as llm_engine
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.runtime import load_model

    llm = load_model(str(smollm2_path), backend="candle-compat")
    tok = llm.tokenizer
    prompts = [tok.encode(t) for t in ("Hello there", "The sky is", "Numbers: 1, 2,")]
    engine = LLMEngine(llm, EngineConfig(num_blocks=64))
    new_sequence = engine._new_sequence

    def with_a_broken_grammar(state, index):
        seq = new_sequence(state, index)
        if state.request.request_id == "bad":
            seq.sampler.constraint = Broken(llm.config.vocab_size, "consume")
        return seq

    monkeypatch.setattr(engine, "_new_sequence", with_a_broken_grammar)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(GenerationRequest(list(p), greedy, request_id="bad" if i == 1 else f"ok{i}"))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(t for d in out.deltas for t in d.token_ids)
    failures = engine.take_failures()
    assert [f.request_id for f in failures] == ["bad"] and "broken" in str(failures[0])
    alone = LLMEngine(llm, EngineConfig(num_blocks=64))
    for i in (0, 2):
        ref = alone.generate([GenerationRequest(list(prompts[i]), greedy)])[0]
        assert done[f"ok{i}"] == [t for o in ref for d in o.deltas for t in d.token_ids]
    assert llm_engine.sample_batch is sample_batch
