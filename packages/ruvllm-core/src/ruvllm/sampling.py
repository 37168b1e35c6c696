"""Sampling: every decoding parameter is applied here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ruvllm.errors import RequestError

if TYPE_CHECKING:
    from ruvllm.structured import Constraint, StructuredOutput


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # number of top logprobs to return per token (0 = chosen token only)
    #: Leave special tokens (``<|im_start|>``...) out of the output text; token ids keep them.
    skip_special_tokens: bool = True
    #: Output must match this (JSON schema, regex, choice, grammar); see :mod:`ruvllm.structured`.
    structured: StructuredOutput | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(msg: str) -> None:
            raise RequestError(msg)

        if self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            bad(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad(f"stop strings must be non-empty strings, got {s!r}")
        for tok in self.stop_token_ids:
            if vocab_size is not None and not 0 <= int(tok) < vocab_size:
                bad(f"stop token id {tok} is outside the vocabulary (0..{vocab_size - 1})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        for tok, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= int(tok) < vocab_size:
                bad(f"logit_bias token id {tok} is outside the vocabulary (0..{vocab_size - 1})")
            if not -100.0 <= bias <= 100.0:
                bad(f"logit_bias values must be in [-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


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


class Sampler:
    """Per-choice sampling state: its random generator and the counts of the tokens it produced.

    Order of operations on a logits row: repetition penalty (prompt and output tokens), presence and
    frequency penalties (output tokens), logit bias, the min_tokens ban on eos/stop tokens, the
    structured-output mask (tokens the grammar does not allow next); then greedy argmax, or
    temperature followed by top_k, top_p and min_p filtering and a draw.
    Logprobs are those of the model's raw logits (what the model predicted, before any of this).
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
        self._counts: dict[int, int] = {}
        self.generated = 0

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        """Logits after penalties, bias and the min_tokens ban (before temperature), float64."""
        p = self.params
        x = np.array(logits, dtype=np.float64, copy=True)
        if p.repetition_penalty != 1.0:
            seen = np.union1d(self._prompt_ids, np.fromiter(self._counts.keys(), dtype=np.int64))
            if seen.size:
                v = x[seen]
                x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if self._counts and (p.presence_penalty or p.frequency_penalty):
            ids = np.fromiter(self._counts.keys(), dtype=np.int64)
            cnt = np.fromiter(self._counts.values(), dtype=np.float64)
            x[ids] -= p.frequency_penalty * cnt + p.presence_penalty
        if p.logit_bias:
            ids = np.fromiter((int(t) for t in p.logit_bias), dtype=np.int64)
            x[ids] += np.fromiter(p.logit_bias.values(), dtype=np.float64)
        if self.generated < p.min_tokens:
            banned = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if 0 <= t < x.shape[-1]]
            x[banned] = -np.inf
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
        min_p (non-greedy requests). Probabilities sum to 1."""
        p = self.params
        z = self.adjust(logits) / p.temperature
        if 0 < p.top_k < z.shape[-1]:
            cand = np.argpartition(-z, p.top_k - 1)[: p.top_k]
        else:
            cand = np.arange(z.shape[-1])
        zc = z[cand]
        probs = np.exp(zc - np.max(zc))
        probs /= probs.sum()
        if p.top_p < 1.0 or p.min_p > 0.0:
            order = np.argsort(-probs, kind="stable")
            cand, probs = cand[order], probs[order]
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
                k = min(p.logprobs, lp.shape[-1])
                idx_top = np.argpartition(-lp, k - 1)[:k]
                idx_top = idx_top[np.argsort(-lp[idx_top], kind="stable")]
                top = [(int(i), float(lp[i])) for i in idx_top]
        self._counts[token] = self._counts.get(token, 0) + 1
        self.generated += 1
        if self.constraint is not None:
            self.constraint.consume(token)
        return SampleResult(token, chosen_lp, top)
