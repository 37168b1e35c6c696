"""The reference sampler: one sequence's sampling state and the order in which parameters apply.

:class:`Sampler` defines what every sampler computes; the batch sampler
(:func:`ruvllm.sampling.sample_batch`) gives the same tokens for a whole step at once, and device
sampling (:func:`ruvllm.sampling.device_sampling`) the same up to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ruvllm.sampling.params import SamplingParams

if TYPE_CHECKING:
    from ruvllm.structured import Constraint


class TokenObserver(Protocol):
    """State derived from a sampler's produced tokens, kept up to date one token at a time
    (device sampling's :class:`~ruvllm.sampling.device.DeviceOverlay`)."""

    def record(self, token: int, first: bool, params: SamplingParams) -> None:
        """Count ``token`` (``first``: its first time) under the sampler's ``params``."""
        ...


@dataclass
class SampleResult:
    token_id: int
    #: Log-probability of ``token_id`` under the model's raw logits (0.0 unless logprobs were asked).
    logprob: float
    #: The ``logprobs`` most likely tokens under the raw logits, most likely first.
    top_logprobs: list[tuple[int, float]]


def log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax of a logits vector."""
    x = np.asarray(x, dtype=np.float64)
    shifted = x - np.max(x)
    return shifted - np.log(np.sum(np.exp(shifted)))


def top_ids(values: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest values, largest first, equal values by id: one canonical order, so a
    seeded draw does not depend on how a selection algorithm happens to order ties."""
    n = values.shape[-1]
    if k < n:
        ids = np.flatnonzero(values >= np.partition(values, n - k)[n - k])
    else:
        ids = np.arange(n)
    return ids[np.lexsort((ids, -values[ids]))][:k]


class Sampler:
    """Per-choice sampling state: its random generator and the counts of the tokens it produced.

    Order of operations on a logits row: repetition penalty (prompt and output tokens), presence and
    frequency penalties (output tokens), logit bias, the min_tokens ban on eos/stop tokens, the
    structured-output mask (tokens the grammar does not allow next); then greedy argmax, or
    temperature followed by top_k, top_p and min_p filtering and a draw. A draw inverts the CDF at
    one ``rng.random()`` per token: over the whole vocabulary in id order when nothing filters, else
    over the kept tokens in canonical order (adjusted logit descending, then id ascending).
    Logprobs are those of the model's raw logits (what the model predicted, before any of this).

    :meth:`sample` is the per-sequence reference; the engine samples all sequences of a step at once
    with :func:`~ruvllm.sampling.sample_batch`, which gives the same tokens, or has the backend
    sample on its device (:func:`~ruvllm.sampling.device_sampling`, then :meth:`commit`).
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        *,
        choice_index: int = 0,
        constraint: Constraint | None = None,
    ) -> None:
        self.params = params
        self.constraint = constraint
        # Each of the n choices of a seeded request gets its own reproducible stream.
        seed = None if params.seed is None else [params.seed & 0xFFFF_FFFF_FFFF_FFFF, choice_index]
        self.rng = np.random.default_rng(seed)
        self.eos_token_ids = tuple(eos_token_ids)
        self._prompt_ids = np.unique(np.asarray(prompt_token_ids or [], dtype=np.int64))
        # Produced tokens and their counts as arrays (first-produced order), which the batch sampler
        # reads without converting a dict every step; _slot maps a token to its index.
        self._slot: dict[int, int] = {}
        self._ids = np.empty(16, np.int64)
        self._cnt = np.empty(16, np.float64)
        self.generated = 0
        #: Device sampling's overlay of penalties and bias, built on its first step and then kept up
        #: to date token by token (see :mod:`ruvllm.sampling.device`).
        self._overlay: TokenObserver | None = None

    def produced(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct tokens produced so far and how often each was (float64), as views."""
        n = len(self._slot)
        return self._ids[:n], self._cnt[:n]

    def raw_argmax(self, vocab: int | None = None) -> bool:
        """Whether this row's choice is the raw logits' argmax: greedy, and no penalty, bias,
        grammar or logprobs changes or reads it; nor a min_tokens ban, still to apply (with
        ``vocab``: one that bans a token of the vocabulary)."""
        p = self.params
        return (
            p.greedy
            and p.logprobs is None
            and self.constraint is None
            and p.repetition_penalty == 1.0
            and not (p.presence_penalty or p.frequency_penalty)
            and not p.logit_bias
            and (self.generated >= p.min_tokens or (vocab is not None and not self._banned(vocab)))
        )

    def _banned(self, vocab: int) -> list[int]:
        """The tokens min_tokens bans (eos and stop tokens inside the vocabulary)."""
        return [t for t in (*self.eos_token_ids, *self.params.stop_token_ids) if 0 <= t < vocab]

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        """Logits after penalties, bias and the min_tokens ban (before temperature), float64."""
        p = self.params
        x = np.array(logits, dtype=np.float64, copy=True)
        ids, cnt = self.produced()
        if p.repetition_penalty != 1.0:
            seen = np.union1d(self._prompt_ids, ids)
            if seen.size:
                v = x[seen]
                x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if ids.size and (p.presence_penalty or p.frequency_penalty):
            x[ids] -= p.frequency_penalty * cnt + p.presence_penalty
        if p.logit_bias:
            bias_ids = np.fromiter((int(t) for t in p.logit_bias), dtype=np.int64)
            x[bias_ids] += np.fromiter(p.logit_bias.values(), dtype=np.float64)
        if self.generated < p.min_tokens:
            x[self._banned(x.shape[-1])] = -np.inf
        if self.constraint is not None:
            allowed = self.constraint.allowed()
            n = min(len(allowed), x.shape[-1])
            banned = np.flatnonzero(~allowed[:n])
            x[banned] = -np.inf
            x[n:] = -np.inf
            if not np.isfinite(x).any():
                # Only what the min_tokens ban removed is allowed (the grammar is complete): the
                # grammar wins, its end is the output's end.
                x = np.array(logits, dtype=np.float64, copy=True)
                x[banned] = -np.inf
                x[n:] = -np.inf
        return x

    def probabilities(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The candidate token ids and their probabilities after temperature, top_k, top_p and
        min_p (non-greedy requests), in draw order. Probabilities sum to 1."""
        p = self.params
        z = self.adjust(logits) / p.temperature
        n = z.shape[-1]
        if 0 < p.top_k < n:
            cand = top_ids(z, p.top_k)
            zc = z[cand]
            probs = np.exp(zc - zc[0])
            probs /= probs.sum()
        else:
            probs = np.exp(z - np.max(z))
            probs /= probs.sum()
            if p.top_p < 1.0 or p.min_p > 0.0:
                cand = np.lexsort((np.arange(n), -z))
                probs = probs[cand]
            else:
                cand = np.arange(n)
        if p.top_p < 1.0 or p.min_p > 0.0:
            keep = len(probs)
            if p.top_p < 1.0:
                # The smallest most-likely set whose mass reaches top_p.
                keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
            if p.min_p > 0.0:
                keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
            cand, probs = cand[:keep], probs[:keep] / probs[:keep].sum()
        return cand, probs

    def sample(self, logits: np.ndarray) -> SampleResult:
        p = self.params
        if p.greedy:
            token = int(np.argmax(self.adjust(logits)))
        else:
            cand, probs = self.probabilities(logits)
            cdf = np.cumsum(probs)
            idx = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
            token = int(cand[min(idx, len(cand) - 1)])
        top: list[tuple[int, float]] = []
        chosen_lp = 0.0
        if p.logprobs is not None:
            lp = log_softmax(logits)
            chosen_lp = float(lp[token])
            if p.logprobs:
                top = [(int(i), float(lp[i])) for i in top_ids(lp, min(p.logprobs, lp.shape[-1]))]
        self._record(token)
        return SampleResult(token, chosen_lp, top)

    def _record(self, token: int) -> None:
        """Count ``token`` as produced and feed it to the constraint."""
        j = self._slot.get(token)
        if self._overlay is not None:
            self._overlay.record(token, j is None, self.params)
        if j is None:
            j = len(self._slot)
            if j == len(self._ids):
                self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
                self._cnt = np.concatenate([self._cnt, np.empty_like(self._cnt)])
            self._slot[token] = j
            self._ids[j] = token
            self._cnt[j] = 0.0
        self._cnt[j] += 1.0
        self.generated += 1
        if self.constraint is not None:
            self.constraint.consume(token)

    def commit(self, token: int, logprob: float, top: list[tuple[int, float]]) -> SampleResult:
        """Take the token device sampling picked (see :func:`~ruvllm.sampling.device_sampling`) and
        update the state like :meth:`sample`; ``logprob`` and ``top`` are kept only as far as the
        request asked."""
        p = self.params
        chosen = 0.0 if p.logprobs is None else float(logprob)
        top = top[: p.logprobs] if p.logprobs else []
        self._record(int(token))
        return SampleResult(int(token), chosen, top)
