"""Sampling: every decoding parameter is applied here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ruvllm.errors import RequestError


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
    logprob: float
    top_logprobs: list[tuple[int, float]]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x)
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted)))


class Sampler:
    """Per-sequence sampling state: its random generator and the counts of tokens it produced."""

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int] | None = None, eos_token_ids=()) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.eos_token_ids = tuple(eos_token_ids)
        self._prompt_ids = np.unique(np.asarray(prompt_token_ids or [], dtype=np.int64))
        self._counts: dict[int, int] = {}
        self.generated = 0

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        """Logits after bias, penalties and the min_tokens/eos rule (before temperature)."""
        p = self.params
        x = np.array(logits, dtype=np.float32, copy=True)
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64)
            x[ids] += np.fromiter(p.logit_bias.values(), dtype=np.float32)
        if p.repetition_penalty != 1.0:
            seen = np.union1d(self._prompt_ids, np.fromiter(self._counts.keys(), dtype=np.int64))
            if seen.size:
                v = x[seen]
                x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if self._counts and (p.presence_penalty or p.frequency_penalty):
            ids = np.fromiter(self._counts.keys(), dtype=np.int64)
            cnt = np.fromiter(self._counts.values(), dtype=np.float32)
            x[ids] -= p.frequency_penalty * cnt + p.presence_penalty
        if self.generated < p.min_tokens:
            for e in (*self.eos_token_ids, *p.stop_token_ids):
                x[e] = -np.inf
        return x

    def sample(self, logits: np.ndarray) -> SampleResult:
        p = self.params
        x = self.adjust(logits)
        if p.greedy:
            token = int(np.argmax(x))
        else:
            z = x / p.temperature
            order = np.argsort(-z, kind="stable")
            if p.top_k > 0:
                order = order[: p.top_k]
            zs = z[order]
            probs = np.exp(zs - zs[0])
            probs /= probs.sum()
            keep = len(order)
            if p.top_p < 1.0:
                keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            if p.min_p > 0.0:
                keep = min(keep, max(1, int(np.sum(probs >= p.min_p * probs[0]))))
            probs = probs[:keep] / probs[:keep].sum()
            token = int(order[self.rng.choice(keep, p=probs)])
        lp = _log_softmax(np.asarray(logits, dtype=np.float64)) if p.logprobs is not None else None
        top: list[tuple[int, float]] = []
        chosen_lp = 0.0
        if lp is not None:
            chosen_lp = float(lp[token])
            if p.logprobs:
                idx = np.argpartition(-lp, p.logprobs)[: p.logprobs]
                idx = idx[np.argsort(-lp[idx], kind="stable")]
                top = [(int(i), float(lp[i])) for i in idx]
        self._counts[token] = self._counts.get(token, 0) + 1
        self.generated += 1
        return SampleResult(token, chosen_lp, top)
