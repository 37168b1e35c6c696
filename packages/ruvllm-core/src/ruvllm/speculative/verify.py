"""Verification of one sequence's draft against the target's logits, with the sequence's sampler.

Row ``i`` of the verification chunk's logits is the target's prediction after the first ``i`` draft
tokens. The sampler sees the rows in order, its state (penalties' counts, the grammar) advanced by
each token kept, exactly as if the tokens had come one step at a time: greedy rows keep a draft
token when it is the sampler's own choice, so the output is the non-speculative one token for token;
sampled rows go through :func:`~ruvllm.speculative.rejection.accept_or_resample`, so the output is
distributed as the target's. Log-probabilities are the target's raw logits', as without speculation.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ruvllm.sampling import Sampler, SampleResult, log_softmax, top_ids
from ruvllm.speculative.rejection import accept_or_resample


@dataclass
class SpeculationStats:
    """Engine-wide speculation counters (vLLM's ``spec_decode_num_*`` figures)."""

    #: Draft tokens the target verified.
    drafted: int = 0
    #: Draft tokens it kept.
    accepted: int = 0
    #: Verification chunks run (sequences x steps that carried a draft).
    verifications: int = 0
    #: Per proposer (``ngram``, ``draft``): [drafted, kept] tokens.
    by_source: dict[str, list[int]] = field(default_factory=dict)

    def count(self, source: str, drafted: int) -> None:
        """``drafted`` tokens of ``source`` go to verification."""
        self.by_source.setdefault(source, [0, 0])[0] += drafted

    def keep(self, source: str, accepted: int) -> None:
        """The target kept ``accepted`` tokens of ``source``'s draft."""
        self.by_source.setdefault(source, [0, 0])[1] += accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def _result(sampler: Sampler, row: np.ndarray, token: int) -> SampleResult:
    """``token`` as :meth:`Sampler.sample` reports it (the raw logits' log-probabilities), recorded."""
    p = sampler.params
    chosen, top = 0.0, []
    if p.logprobs is not None:
        lp = log_softmax(row)
        chosen = float(lp[token])
        if p.logprobs:
            top = [(int(i), float(lp[i])) for i in top_ids(lp, min(p.logprobs, lp.shape[-1]))]
    sampler._record(token)
    return SampleResult(token, chosen, top)


def verify_draft(
    sampler: Sampler, rows: np.ndarray, draft: list[int], q_rows: np.ndarray | None = None
) -> Iterator[tuple[SampleResult, bool]]:
    """Yield ``(sample, accepted)`` for the tokens the verification emits: each kept draft token
    (``accepted`` True), then the target's own token where the first draft token was refused or,
    all kept, the bonus token from the last row (``accepted`` False). ``rows``: ``[len(draft) + 1,
    vocab]`` logits; ``q_rows``: the draft's probabilities at its positions (None: a deterministic
    draft). The caller stops iterating once the sequence finishes; nothing past that is recorded."""
    # The float32 rows' argmax is the float64 copy's Sampler.sample takes.
    if sampler.raw_argmax():  # a sample per row costs more than the step's own sampling
        picks = np.argmax(rows[: len(draft) + 1], axis=-1)
        for i in range(len(draft) + 1):
            token = int(picks[i])
            sampler._record(token)
            ok = i < len(draft) and token == draft[i]
            yield SampleResult(token, 0.0, []), ok
            if not ok:
                return
        return
    greedy = sampler.params.greedy
    for i in range(len(draft) + 1):
        row = rows[i]
        want = draft[i] if i < len(draft) else None
        if greedy:
            sample = sampler.sample(row)
            ok = want is not None and sample.token_id == want
            yield sample, ok
            if not ok:
                return
            continue
        cand, probs = sampler.probabilities(row)
        if want is None:
            cdf = np.cumsum(probs)
            idx = min(int(np.searchsorted(cdf, sampler.rng.random() * cdf[-1], side="right")), len(cand) - 1)
            yield _result(sampler, row, int(cand[idx])), False
            return
        at = np.flatnonzero(cand == want)
        q = None if q_rows is None else np.asarray(q_rows[i], dtype=np.float64)[cand]
        ok, idx = accept_or_resample(probs, int(at[0]) if at.size else -1, q, sampler.rng)
        yield _result(sampler, row, int(cand[idx])), ok
        if not ok:
            return
