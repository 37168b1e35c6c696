"""Sampling: every decoding parameter is applied here and nowhere else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, overload

import numpy as np

from ruvllm.errors import RequestError

if TYPE_CHECKING:
    from ruvllm.backend import DeviceSampling
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
    #: Log-probabilities of the prompt's tokens under the model (the first has none), with this many
    #: top alternatives each; None: not computed. Such a request recomputes its whole prompt (no
    #: prefix-cache hits: cached positions have no logits).
    prompt_logprobs: int | None = None
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
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
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
    with :func:`sample_batch`, which gives the same tokens.
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
        #: Device sampling's overlay (ids, rep flags, additions), built on first use (see _device_row).
        self._overlay: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def produced(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct tokens produced so far and how often each was (float64), as views."""
        n = len(self._slot)
        return self._ids[:n], self._cnt[:n]

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
            self._overlay_record(token, j is None)
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
        """Take the token device sampling picked (see :func:`device_sampling`) and update the state
        like :meth:`sample`; ``logprob`` and ``top`` are kept only as far as the request asked."""
        p = self.params
        chosen = 0.0 if p.logprobs is None else float(logprob)
        top = top[: p.logprobs] if p.logprobs else []
        self._record(int(token))
        return SampleResult(int(token), chosen, top)

    def _device_row(self, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, float]:
        """This step's row of :class:`ruvllm.backend.DeviceSampling`: overlay ids (sorted), rep
        flags and additions, the allowed-token bits (None: all) and the repetition penalty.

        The overlay of penalties and bias is built once (prompt, produced tokens, bias) and then kept
        up to date by :meth:`_record` one token at a time, so a step costs O(width) copies per row
        however long the prompt; the step's bans are applied to a copy."""
        p = self.params
        if self._overlay is None:
            self._overlay = self._build_overlay()
        ids, rep, add = self._overlay
        penalty = p.repetition_penalty
        banned = np.asarray(self._banned(vocab) if self.generated < p.min_tokens else [], np.int64)
        bits = None
        if self.constraint is not None:
            allowed = np.zeros(vocab, bool)
            a = self.constraint.allowed()
            allowed[: min(len(a), vocab)] = a[:vocab]
            bits = np.packbits(allowed, bitorder="little")
            if banned.size and not np.setdiff1d(np.flatnonzero(allowed), banned).size:
                # Only what the min_tokens ban removed is allowed: the grammar wins, on the raw logits.
                empty = np.zeros(0, np.int32)
                return empty, np.zeros(0, bool), np.zeros(0, np.float32), bits, 1.0
        if banned.size:
            pos = np.searchsorted(ids, banned)
            hit = np.zeros(len(banned), bool)
            if len(ids):
                hit = (pos < len(ids)) & (ids[np.minimum(pos, len(ids) - 1)] == banned)
            add = add.copy()
            add[pos[hit]] = -np.inf
            new = np.unique(banned[~hit])
            if new.size:
                at = np.searchsorted(ids, new)
                ids, rep = np.insert(ids, at, new), np.insert(rep, at, False)
                add = np.insert(add, at, -np.inf)
        return ids, rep, add.astype(np.float32), bits, penalty

    def _build_overlay(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        p = self.params
        keys: list[np.ndarray] = [np.zeros(0, np.int64)]
        add: list[np.ndarray] = [np.zeros(0)]
        rep: list[np.ndarray] = [np.zeros(0, bool)]
        ids, cnt = self.produced()
        if p.repetition_penalty != 1.0:
            seen = np.union1d(self._prompt_ids, ids)
            keys.append(seen)
            add.append(np.zeros(len(seen)))
            rep.append(np.ones(len(seen), bool))
        if ids.size and (p.presence_penalty or p.frequency_penalty):
            keys.append(ids)
            add.append(-(p.frequency_penalty * cnt + p.presence_penalty))
            rep.append(np.zeros(len(ids), bool))
        if p.logit_bias:
            keys.append(np.fromiter((int(t) for t in p.logit_bias), dtype=np.int64))
            add.append(np.fromiter(p.logit_bias.values(), dtype=np.float64))
            rep.append(np.zeros(len(p.logit_bias), bool))
        k = np.concatenate(keys)
        uk, inv = np.unique(k, return_inverse=True)
        total = np.zeros(len(uk))
        np.add.at(total, inv, np.concatenate(add))
        flags = np.zeros(len(uk), bool)
        np.logical_or.at(flags, inv, np.concatenate(rep))
        return uk.astype(np.int32), flags, total

    def _overlay_record(self, token: int, first: bool) -> None:
        """Keep the device overlay up to date with one produced ``token`` (``first``: its first time)."""
        p = self.params
        rep_on = p.repetition_penalty != 1.0
        delta = -(p.frequency_penalty + (p.presence_penalty if first else 0.0))
        if not rep_on and not delta:
            return
        assert self._overlay is not None
        ids, rep, add = self._overlay
        pos = int(np.searchsorted(ids, token))
        if pos < len(ids) and ids[pos] == token:
            rep[pos] |= rep_on
            add[pos] += delta
        else:
            self._overlay = (np.insert(ids, pos, token), np.insert(rep, pos, rep_on), np.insert(add, pos, delta))

    def _commit(self, pick: _Pick, raw: np.ndarray) -> SampleResult:
        """Draw from what the batch pass decided for this row and update the state like :meth:`sample`."""
        if pick.cdf is not None:
            cdf = pick.cdf
            idx = min(int(cdf.searchsorted(self.rng.random() * cdf[-1], side="right")), len(cdf) - 1)
            token = idx if pick.ids is None else int(pick.ids[idx])
        elif pick.whole is not None:
            token = pick.whole.draw(self.rng.random())
        else:
            token = pick.token
        chosen_lp = 0.0 if pick.lse is None else float(raw[token]) - pick.lse
        self._record(token)
        return SampleResult(token, chosen_lp, pick.top)


# ----------------------------------------------------------------------------- device sampling

#: Overlay widths of :func:`device_sampling` below the vocabulary's (a backend that compiles per
#: shape compiles each).
OVERLAY_WIDTHS = (16, 256, 4096)


def overlay_width(n: int, vocab: int) -> int:
    """The overlay width of a batch whose longest row has ``n`` entries: the smallest of
    :data:`OVERLAY_WIDTHS` that holds it, else the vocabulary rounded up to a multiple of the
    largest (a row has at most one entry per token)."""
    for w in OVERLAY_WIDTHS:
        if n <= w:
            return w
    step = OVERLAY_WIDTHS[-1]
    return -(-max(n, vocab) // step) * step


def overlay_widths(vocab: int) -> list[int]:
    """Every width :func:`overlay_width` gives for this vocabulary."""
    return sorted({overlay_width(n, vocab) for n in (0, *(w + 1 for w in OVERLAY_WIDTHS)) if n <= vocab})


def device_sampling(samplers: Sequence[Sampler | None], vocab: int) -> DeviceSampling:
    """The :class:`ruvllm.backend.DeviceSampling` rows of ``samplers`` for this step (None: a row
    that samples nothing, e.g. a prompt chunk that does not end its prompt). Draws each non-greedy
    sampler's uniform from its generator, as :meth:`Sampler.sample` would; pass the returned tokens
    to :meth:`Sampler.commit`. The same seed thus gives the same tokens as host sampling, but for
    float32 rounding at a CDF boundary or between near-equal logits. Raises what a row's grammar
    raises, having drawn nothing."""
    from ruvllm.backend import DeviceSampling

    b = len(samplers)
    greedy = np.ones(b, bool)
    temperature = np.ones(b, np.float32)
    top_k = np.zeros(b, np.int32)
    top_p = np.ones(b, np.float32)
    min_p = np.zeros(b, np.float32)
    penalty = np.ones(b, np.float32)
    uniform = np.zeros(b, np.float32)
    # Every row first (a grammar may raise): a failed build has drawn from no generator.
    rows = [None if s is None else s._device_row(vocab) for s in samplers]
    top = 0
    for i, (s, row) in enumerate(zip(samplers, rows, strict=True)):
        if s is None or row is None:
            continue
        p = s.params
        penalty[i] = row[4]
        if p.logprobs:
            top = max(top, min(p.logprobs, vocab))
        if p.greedy:
            continue
        greedy[i] = False
        temperature[i] = p.temperature
        top_k[i] = p.top_k if 0 < p.top_k < vocab else 0
        top_p[i], min_p[i] = p.top_p, p.min_p
        uniform[i] = s.rng.random()
    width = overlay_width(max((len(r[0]) for r in rows if r is not None), default=0), vocab)
    ids = np.full((b, width), vocab, np.int32)
    rep = np.zeros((b, width), bool)
    add = np.zeros((b, width), np.float32)
    masked = any(r is not None and r[3] is not None for r in rows)
    allowed = np.full((b, -(-vocab // 8)), 0xFF, np.uint8) if masked else None
    for i, r in enumerate(rows):
        if r is None:
            continue
        n = len(r[0])
        ids[i, :n], rep[i, :n], add[i, :n] = r[0], r[1], r[2]
        if r[3] is not None and allowed is not None:
            allowed[i] = r[3]
    return DeviceSampling(
        greedy=greedy,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=penalty,
        uniform=uniform,
        overlay_ids=ids,
        overlay_rep=rep,
        overlay_add=add,
        allowed=allowed,
        top_logprobs=top,
    )


# ------------------------------------------------------------------------------ batch sampling

#: Entries per group in the batch sampler's partial selection. Token ``t`` is in group ``t % groups``
#: (strided), so all group maxima of a [batch, vocab] matrix are one fast reduction.
_GROUP = 32
#: Candidates tried first for a top_p row without top_k (most nuclei are smaller).
_NUCLEUS_FIRST = 64
#: Rows without top_k are processed this many at a time (their float64 rows then stay in cache).
_WHOLE_ROWS = 4
#: Tokens per block of an unfiltered row's CDF.
_BLOCK = 512


@dataclass(slots=True)
class _WholeRow:
    """An unfiltered row's draw over the whole vocabulary in id order, by inverse CDF of the weights
    exp((logit - top) * scale): the pass keeps the cumulative weight per _BLOCK tokens only, and the
    draw recomputes the weights of the block it lands in (the same operations on the same values,
    so the same numbers)."""

    row: np.ndarray  # raw (or masked) float32 row
    tok: np.ndarray  # its overlay entries, by token
    val: np.ndarray
    top: float
    scale: float
    blocks: np.ndarray
    vocab: int

    def weights(self, lo: int, hi: int) -> np.ndarray:
        w = self.row[lo:hi].astype(np.float64)
        a, b = np.searchsorted(self.tok, [lo, hi])
        w[self.tok[a:b] - lo] = self.val[a:b]
        w -= self.top
        w *= self.scale
        return np.exp(w, out=w)

    def draw(self, u: float) -> int:
        v = u * self.blocks[-1]
        b = min(int(self.blocks.searchsorted(v, side="right")), len(self.blocks) - 1)
        while True:
            lo = b * _BLOCK
            local = (self.blocks[b - 1] if b else 0.0) + np.cumsum(self.weights(lo, min(lo + _BLOCK, self.vocab)))
            idx = int(local.searchsorted(v, side="right"))
            if idx < len(local) or b == len(self.blocks) - 1:
                return min(lo + idx, self.vocab - 1)
            b += 1  # rounding put v past this block's own sum


@dataclass(slots=True)
class _Pick:
    """What the vectorised pass decided for one row. The draw and every state update are left to
    :meth:`Sampler._commit`, so a pass that fails has changed no sampler."""

    #: The choice of a greedy row.
    token: int = 0
    #: Filtered rows: the candidates in draw order and their CDF.
    ids: np.ndarray | None = None
    cdf: np.ndarray | None = None
    #: Unfiltered rows: a draw over the whole vocabulary in id order.
    whole: _WholeRow | None = None
    #: log-sum-exp of the raw logits (rows that ask for logprobs).
    lse: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


@overload
def sample_batch(
    samplers: Sequence[Sampler], logits: np.ndarray | Sequence[np.ndarray], *, return_exceptions: Literal[False] = ...
) -> list[SampleResult]: ...


@overload
def sample_batch(
    samplers: Sequence[Sampler], logits: np.ndarray | Sequence[np.ndarray], *, return_exceptions: Literal[True]
) -> list[SampleResult | Exception]: ...


def sample_batch(
    samplers: Sequence[Sampler], logits: np.ndarray | Sequence[np.ndarray], *, return_exceptions: bool = False
) -> list[SampleResult] | list[SampleResult | Exception]:
    """Sample one token for each sampler from its row of ``logits`` ([batch, vocab], or one row per
    sampler; rows may repeat), in one vectorised pass: the same tokens, logprobs and state updates as
    calling each ``samplers[i].sample(logits[i])``, at a fraction of the cost.

    The raw rows are read as they are (one pass of partial selection: no copy, no sort of the
    vocabulary); the entries penalties, bias and bans change are kept aside with the reference's
    float64 values, and probabilities are computed in float64 over the candidates (over whole rows
    only for rows without top_k, which normalise over the vocabulary). The draws then equal the
    reference's for float32 (or narrower) logits, up to float64 rounding. Each sampler's random
    draw and state update happen after the pass, so a pass that fails changes no sampler. With
    ``return_exceptions`` an exception tied to one row (its constraint, its data) is returned in that
    row's place and the other rows are sampled as usual; without it, it is raised.
    """
    n = len(samplers)
    if len(logits) != n:
        raise ValueError(f"{n} samplers but {len(logits)} logits rows")
    out: list[SampleResult | Exception | None] = [None] * n
    masks: list[np.ndarray | None] = [None] * n
    for i, s in enumerate(samplers):
        if s.constraint is not None:
            try:
                masks[i] = np.asarray(s.constraint.allowed(), dtype=bool)
            except Exception as exc:
                if not return_exceptions:
                    raise
                out[i] = exc
    live = [i for i in range(n) if out[i] is None]
    if return_exceptions:
        picks = _plan_isolating(samplers, logits, masks, live, out)
    else:
        planned = _plan([samplers[i] for i in live], [logits[i] for i in live], [masks[i] for i in live])
        picks = dict(zip(live, planned, strict=True))
    for i, pick in picks.items():
        try:
            out[i] = samplers[i]._commit(pick, logits[i])
        except Exception as exc:
            if not return_exceptions:
                raise
            out[i] = exc
    return out  # type: ignore[return-value]  # every row is filled


def _plan_isolating(
    samplers: Sequence[Sampler],
    logits: np.ndarray | Sequence[np.ndarray],
    masks: list[np.ndarray | None],
    rows: list[int],
    out: list[SampleResult | Exception | None],
) -> dict[int, _Pick]:
    """:func:`_plan` of ``rows``; when it fails, of each half again, so an error that comes from one
    row is put in ``out`` for that row alone (planning changes no state, so retrying is safe)."""
    if not rows:
        return {}
    try:
        planned = _plan([samplers[i] for i in rows], [logits[i] for i in rows], [masks[i] for i in rows])
        return dict(zip(rows, planned, strict=True))
    except Exception as exc:
        if len(rows) == 1:
            out[rows[0]] = exc
            return {}
    half = len(rows) // 2
    return _plan_isolating(samplers, logits, masks, rows[:half], out) | _plan_isolating(
        samplers, logits, masks, rows[half:], out
    )


def _pad(
    r: np.ndarray, tok: np.ndarray, key: np.ndarray, n: int, limit: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidates of ``n`` rows in canonical order (``key`` descending, token ascending), at most
    ``limit`` per row, laid out [n, width]: (index into the inputs, valid mask, count per row)."""
    counts = np.bincount(r, minlength=n)
    take = counts if limit is None else np.minimum(counts, limit)
    j = np.arange(max(int(take.max()), 1))
    valid = j < take[:, None]
    if not r.size:
        return np.zeros(valid.shape, np.int64), valid, take
    starts = np.cumsum(counts) - counts
    src = _canonical(r, tok, key)[np.minimum(starts[:, None] + j, r.size - 1)]
    return src, valid, take


def _need(take: np.ndarray) -> None:
    """Sampled rows need a candidate: a row whose adjusted logits are all -inf fails."""
    if not take.all():
        raise FloatingPointError("no token has a finite logit")


def _truncate(
    probs: np.ndarray, take: np.ndarray, top_p: np.ndarray, min_p: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """top_p and min_p on candidate probabilities in canonical order ([rows, width], 0 past ``take``):
    (kept count, CDF of the renormalised kept probabilities, whether each top_p cut fell inside the
    candidates). Rows filtered by neither keep their probabilities as they are, like the reference."""
    keep = take.copy()
    reached = np.ones(len(take), bool)
    has_p, has_m = top_p < 1.0, min_p > 0.0
    if has_p.any():
        inside = (np.cumsum(probs, axis=1) < top_p[:, None]).sum(axis=1)
        reached = ~has_p | (inside < take)
        keep = np.where(has_p, np.minimum(keep, inside + 1), keep)
    if has_m.any():
        above = np.maximum(1, (probs >= (min_p * probs[:, 0])[:, None]).sum(axis=1))
        keep = np.where(has_m, np.minimum(keep, above), keep)
    cut = has_p | has_m
    if cut.any():
        kept = np.where(np.arange(probs.shape[1]) < keep[:, None], probs, 0.0)
        probs = np.where(cut[:, None], kept / kept.sum(axis=1, keepdims=True), probs)
    return keep, np.cumsum(probs, axis=1), reached


class _Overlay:
    """The entries of a step's rows that differ from the raw logits: keys ``row * width + token``
    (sorted), the reference's float64 adjusted values there (-inf where banned) and the raw ones."""

    def __init__(self, keys: np.ndarray, values: np.ndarray, raw: np.ndarray, width: int) -> None:
        self.keys, self.values, self.raw, self.width = keys, values, raw, width

    def subset(self, keep: np.ndarray) -> _Overlay:
        return _Overlay(self.keys[keep], self.values[keep], self.raw[keep], self.width)

    def patch(self, keys: np.ndarray, raw: np.ndarray) -> np.ndarray:
        """float64 values at ``keys``: the adjusted ones where there are, else ``raw``."""
        if not self.keys.size:
            return raw.astype(np.float64)
        pos = np.minimum(np.searchsorted(self.keys, keys), self.keys.size - 1)
        return np.where(self.keys[pos] == keys, self.values[pos], raw)

    def row(self, j: int, raw: np.ndarray) -> np.ndarray:
        """Row ``j`` of the adjusted logits in float64, from its raw values ``raw``."""
        out = raw.astype(np.float64)
        lo, hi = np.searchsorted(self.keys, [j * self.width, (j + 1) * self.width])
        out[self.keys[lo:hi] - j * self.width] = self.values[lo:hi]
        return out

    def of_rows(self, rows: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Entries of ``rows`` (of ``n`` rows): (position of the row in ``rows``, token, value, raw value)."""
        at = np.full(n, -1)
        at[rows] = np.arange(len(rows))
        r = at[self.keys // self.width]
        mine = r >= 0
        return r[mine], self.keys[mine] % self.width, self.values[mine], self.raw[mine]


def _plan(samplers: Sequence[Sampler], logits: Sequence[np.ndarray], masks: Sequence[np.ndarray | None]) -> list[_Pick]:
    """The vectorised part of :func:`sample_batch`: everything but the draws and the state updates.

    The adjusted logits are never materialised: the raw rows are read as they are, and the few
    entries penalties, bias and bans change are an :class:`_Overlay` of exact float64 values. Only
    rows under a grammar mask are copied (masked); rows without top_k are expanded to float64."""
    b = len(samplers)
    picks = [_Pick() for _ in range(b)]
    if not b:
        return picks
    vocab = int(np.shape(logits[0])[-1])
    groups = -(-vocab // _GROUP)
    width = groups * _GROUP
    rows = _Rows(logits, vocab, width)
    params = [s.params for s in samplers]

    # Logprobs: of the raw logits.
    lp_rows = np.array([j for j, p in enumerate(params) if p.logprobs is not None], np.int64)
    lse: dict[int, float] = {}
    if lp_rows.size:
        raw = rows.take(lp_rows)[:, :vocab]
        m = raw.max(axis=1)
        sums = np.exp(raw - m[:, None]).sum(axis=1, dtype=np.float64)
        lse = dict(zip(lp_rows.tolist(), (m + np.log(sums)).tolist(), strict=True))
        for j, shift in lse.items():
            picks[j].lse = shift
    top_rows = np.array([j for j in lp_rows.tolist() if params[j].logprobs], np.int64)
    if top_rows.size:
        k = np.array([min(params[j].logprobs or 0, vocab) for j in top_rows.tolist()])
        none = _Overlay(np.empty(0, np.int64), np.empty(0), np.empty(0, np.float32), width)
        r, tok, v = _top_candidates(rows, top_rows, k, none, vocab)
        src, _, take = _pad(r, tok, v, len(top_rows), k)
        for i, j in enumerate(top_rows.tolist()):
            s = src[i, : take[i]]
            picks[j].top = [(t, x - lse[j]) for t, x in zip(tok[s].tolist(), v[s].tolist(), strict=True)]

    overlay = _adjustments(samplers, params, rows, vocab)
    if any(mask is not None for mask in masks):
        overlay = _apply_masks(rows, masks, overlay, vocab)

    greedy = np.array([j for j, p in enumerate(params) if p.greedy], np.int64)
    with_k = [not p.greedy and 0 < p.top_k < vocab for p in params]
    sampled_k = np.flatnonzero(with_k)
    sampled_n = np.array([j for j, p in enumerate(params) if not p.greedy and not with_k[j]], np.int64)
    temp = np.array([p.temperature for p in params], np.float64)
    top_p = np.array([p.top_p for p in params], np.float64)
    min_p = np.array([p.min_p for p in params], np.float64)

    if greedy.size:
        for j, token in zip(greedy.tolist(), _argmax(rows, greedy, overlay, vocab).tolist(), strict=True):
            picks[j].token = token

    if sampled_k.size:
        # top_k: candidates by partial selection, ordered by their exact logits, cut to k.
        k = np.array([params[j].top_k for j in sampled_k.tolist()])
        r, tok, v = _top_candidates(rows, sampled_k, k, overlay, vocab)
        z = v / temp[sampled_k][r]
        src, valid, take = _pad(r, tok, z, len(sampled_k), k)
        _need(take)
        zs = np.where(valid, z[src], -np.inf)
        probs = np.exp(zs - zs[:, :1])
        probs /= probs.sum(axis=1, keepdims=True)
        keep, cdf, _ = _truncate(probs, take, top_p[sampled_k], min_p[sampled_k])
        ids = tok[src]
        for i, (j, n) in enumerate(zip(sampled_k.tolist(), keep.tolist(), strict=True)):
            picks[j].ids, picks[j].cdf = ids[i, :n], cdf[i, :n]

    if sampled_n.size:
        _plan_whole_rows(rows, sampled_n, overlay, temp, top_p, min_p, vocab, picks)
    return picks


class _Rows:
    """A step's logits rows as float32 arrays of ``width`` entries, and as one [rows, width] matrix
    view where they are equally spaced rows of one array (the engine's rows usually are: rows of
    the model's output), so that the passes over them are single operations instead of a loop."""

    def __init__(self, logits: Sequence[np.ndarray], vocab: int, width: int) -> None:
        self.rows = [_row32(row, vocab, width) for row in logits]
        self.width, self.groups = width, width // _GROUP
        self.matrix = _matrix_view(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def at(self, keys: np.ndarray) -> np.ndarray:
        """The entries at sorted ``keys`` (row * width + token)."""
        if self.matrix is not None:
            return self.matrix[keys // self.width, keys % self.width]
        out = np.empty(len(keys), np.float32)
        bounds = np.searchsorted(keys, np.arange(len(self.rows) + 1) * self.width)
        for j in np.flatnonzero(np.diff(bounds)).tolist():
            out[bounds[j] : bounds[j + 1]] = self.rows[j][keys[bounds[j] : bounds[j + 1]] - j * self.width]
        return out

    def take(self, sel: np.ndarray) -> np.ndarray:
        """The rows ``sel`` as one [len(sel), width] array (a view when it is the whole matrix)."""
        if self.matrix is not None:
            return self.matrix if len(sel) == len(self.rows) else self.matrix[sel]
        return np.stack([self.rows[j] for j in sel.tolist()])

    def argmax(self, sel: np.ndarray) -> np.ndarray:
        """The first largest raw entry of each row in ``sel``."""
        if self.matrix is not None and len(sel) == len(self.rows):
            return self.matrix.argmax(axis=1)
        return np.array([self.rows[j].argmax() for j in sel.tolist()], np.int64)

    def replace(self, j: int, row: np.ndarray) -> None:
        self.rows[j] = row
        self.matrix = None

    def group_max(self, sel: np.ndarray) -> np.ndarray:
        """[len(sel), groups]: the maximum of each group (token t is in group t % groups)."""
        if self.matrix is not None and 2 * len(sel) > len(self.rows):
            m3 = self.matrix.reshape(len(self.rows), _GROUP, self.groups)
            return (m3 if len(sel) == len(self.rows) else m3[sel]).max(axis=1)
        out = np.empty((len(sel), self.groups), np.float32)
        for i, j in enumerate(sel.tolist()):
            np.max(self.rows[j].reshape(_GROUP, self.groups), axis=0, out=out[i])
        return out

    def gather(self, sel: np.ndarray, hit_r: np.ndarray, hit_g: np.ndarray) -> np.ndarray:
        """[len(hit_r), _GROUP]: the members of group ``hit_g[i]`` of row ``sel[hit_r[i]]``."""
        if self.matrix is not None:
            return self.matrix.reshape(len(self.rows), _GROUP, self.groups)[sel[hit_r], :, hit_g]
        bounds = np.searchsorted(hit_r, np.arange(len(sel) + 1))
        return np.concatenate(
            [
                self.rows[j].reshape(_GROUP, self.groups)[:, hit_g[bounds[i] : bounds[i + 1]]].T
                for i, j in enumerate(sel.tolist())
            ]
        )


def _matrix_view(rows: list[np.ndarray]) -> np.ndarray | None:
    """The rows as one [n, width] view when they are equally spaced float32 rows of one array (each
    row is a view of it, so the view stays inside its memory); else None."""
    first = rows[0]
    base = first.base
    if base is None or first.dtype != np.float32 or not first.flags.c_contiguous:
        return None
    start = first.ctypes.data
    step = rows[1].ctypes.data - start if len(rows) > 1 else first.nbytes
    if step < first.nbytes:
        return None
    for i, row in enumerate(rows):
        if row.base is not base or row.dtype != np.float32 or row.ctypes.data != start + i * step:
            return None
        if not row.flags.c_contiguous:
            return None
    # Not marked read-only (argmax of read-only arrays takes a path three times slower); never written.
    return np.lib.stride_tricks.as_strided(first, shape=(len(rows), first.size), strides=(step, first.itemsize))


def _row32(row: np.ndarray, vocab: int, width: int) -> np.ndarray:
    """A logits row as float32 of ``width`` entries (-inf past the vocabulary): the row itself when it
    already is one, else a converted or padded copy."""
    if np.shape(row) != (vocab,):
        raise ValueError(f"a logits row has shape {np.shape(row)}, expected ({vocab},)")
    if width == vocab:
        return np.ascontiguousarray(row, dtype=np.float32)
    out = np.full(width, -np.inf, np.float32)
    out[:vocab] = row
    return out


def _adjustments(samplers: Sequence[Sampler], params: list[SamplingParams], rows: _Rows, vocab: int) -> _Overlay:
    """Penalties, logit bias and the min_tokens ban as an overlay: the reference's float64 arithmetic
    on the entries they touch, in its order (repetition, presence/frequency, bias, ban)."""
    rep_keys: list[np.ndarray] = []
    rep_len: list[int] = []
    rep_pen: list[float] = []
    pf_keys: list[np.ndarray] = []
    pf_cnt: list[np.ndarray] = []
    pf_len: list[int] = []
    pf_freq: list[float] = []
    pf_pres: list[float] = []
    bias_keys: list[np.ndarray] = []
    bias_vals: list[np.ndarray] = []
    ban_keys: list[int] = []
    width = rows.width
    rep_rows: list[int] = []
    pf_rows: list[int] = []
    bias_rows: list[int] = []
    for j, (s, p) in enumerate(zip(samplers, params, strict=True)):
        ids, cnt = s.produced()
        if p.repetition_penalty != 1.0:
            prompt = s._prompt_ids
            if prompt.size and (prompt[0] < 0 or prompt[-1] >= vocab):
                raise IndexError(f"prompt token ids outside the vocabulary (0..{vocab - 1})")
            rep_keys += [prompt, ids]
            rep_rows += [j, j]
            rep_len.append(prompt.size + ids.size)
            rep_pen.append(p.repetition_penalty)
        if ids.size and (p.presence_penalty or p.frequency_penalty):
            pf_keys.append(ids)
            pf_rows.append(j)
            pf_cnt.append(cnt)
            pf_len.append(ids.size)
            pf_freq.append(p.frequency_penalty)
            pf_pres.append(p.presence_penalty)
        if p.logit_bias:
            bias_ids = np.fromiter((int(t) for t in p.logit_bias), np.int64, len(p.logit_bias))
            if bias_ids.min() < 0 or bias_ids.max() >= vocab:
                raise IndexError(f"logit_bias token ids outside the vocabulary (0..{vocab - 1})")
            bias_keys.append(bias_ids)
            bias_rows.append(j)
            bias_vals.append(np.fromiter(p.logit_bias.values(), np.float64, len(p.logit_bias)))
        if s.generated < p.min_tokens:
            ban_keys += [j * width + t for t in s._banned(vocab)]

    def keyed(tokens: list[np.ndarray], rows: list[int]) -> np.ndarray:
        """Token ids as keys row * width + token (``tokens[i]`` belongs to row ``rows[i]``)."""
        if not tokens:
            return np.empty(0, np.int64)
        return np.concatenate(tokens) + np.repeat(np.array(rows, np.int64) * width, [len(t) for t in tokens])

    every = np.concatenate(
        [keyed(rep_keys, rep_rows), keyed(pf_keys, pf_rows), keyed(bias_keys, bias_rows), np.array(ban_keys, np.int64)]
    )
    if not every.size:
        return _Overlay(every, np.empty(0), np.empty(0, np.float32), width)
    # Sorted unique keys, and where each listed key went (one sort instead of a search per list).
    order = np.argsort(every)
    ranked = every[order]
    new = np.concatenate(([True], ranked[1:] != ranked[:-1]))
    keys = ranked[new]
    where = np.empty(len(every), np.int64)
    where[order] = np.cumsum(new) - 1
    raw = rows.at(keys)
    values = raw.astype(np.float64)
    at = 0
    if rep_keys:
        n = sum(rep_len)
        pos = where[at : at + n]
        v = values[pos]
        pen = np.repeat(np.array(rep_pen), rep_len)
        values[pos] = np.where(v > 0, v / pen, v * pen)
        at += n
    if pf_keys:
        n = sum(pf_len)
        freq, pres = np.repeat(np.array(pf_freq), pf_len), np.repeat(np.array(pf_pres), pf_len)
        values[where[at : at + n]] -= freq * np.concatenate(pf_cnt) + pres
        at += n
    if bias_keys:
        n = sum(len(k) for k in bias_keys)
        values[where[at : at + n]] += np.concatenate(bias_vals)
        at += n
    values[where[at:]] = -np.inf
    return _Overlay(keys, values, raw, width)


def _apply_masks(rows: _Rows, masks: Sequence[np.ndarray | None], overlay: _Overlay, vocab: int) -> _Overlay:
    """The grammar's masks: masked rows become masked copies; where the mask and the min_tokens ban
    leave nothing, the grammar alone decides (the row's penalties and ban are dropped, like the
    reference's fallback). Overlay entries the mask removes are dropped."""
    width = overlay.width
    keep = np.ones(overlay.keys.size, bool)
    for j, mask in enumerate(masks):
        if mask is None:
            continue
        allowed = np.zeros(width, bool)
        n = min(len(mask), vocab)
        allowed[:n] = mask[:n]
        lo, hi = np.searchsorted(overlay.keys, [j * width, (j + 1) * width])
        tok = overlay.keys[lo:hi] - j * width
        usable = allowed & np.isfinite(rows.rows[j])
        usable[tok[np.isneginf(overlay.values[lo:hi])]] = False
        keep[lo:hi] = allowed[tok] if usable.any() else False
        rows.replace(j, np.where(allowed, rows.rows[j], np.float32(-np.inf)))
    return overlay.subset(keep)


class _Selection:
    """Partial selection over the adjusted logits of the rows ``sel`` (raw rows plus the overlay),
    from one float32 pass over each raw row.

    Token ``t`` is in group ``t % groups``. A group's raw maximum, raised by the overlay values in it,
    bounds it from above; from below, its raw maximum if the overlay touches nothing in it, else the
    largest overlay value in it. A threshold reached by the k-th largest lower bound is reached by k
    distinct entries, so every one of the k largest is at or above it; only groups whose upper
    bound reaches a threshold are read again (a few dozen per row instead of the vocabulary)."""

    def __init__(self, rows: _Rows, sel: np.ndarray, overlay: _Overlay, vocab: int) -> None:
        self.rows, self.sel, self.overlay, self.vocab = rows, sel, overlay, vocab
        groups = rows.groups
        # float32 (fast partial selection): overlay values rounded down into lower bounds, up into upper.
        self.high = rows.group_max(sel)
        self.low = self.high.copy()
        self.o_r, self.o_tok, self.o_val, self.o_raw = overlay.of_rows(sel, len(rows))
        if self.o_r.size:
            g = self.o_r * groups + self.o_tok % groups
            v32 = self.o_val.astype(np.float32)
            down = np.where(v32 > self.o_val, np.nextafter(v32, np.float32(-np.inf)), v32)
            up = np.where(v32 < self.o_val, np.nextafter(v32, np.float32(np.inf)), v32)
            self.low.reshape(-1)[g] = -np.inf
            np.maximum.at(self.low.reshape(-1), g, down)
            np.maximum.at(self.high.reshape(-1), g, up)

    def kth(self, k: np.ndarray) -> np.ndarray:
        """Per row, a threshold at or below its k-th largest adjusted logit."""
        groups, width = self.rows.groups, self.rows.width
        thr = np.empty(len(self.sel))
        small = 4 * k <= groups
        for kk in np.unique(k[small]).tolist():  # usually one k for all rows
            if small.all() and (k == kk).all():
                thr[:] = np.partition(self.low, groups - kk, axis=1)[:, groups - kk]
            else:
                at = small & (k == kk)
                thr[at] = np.partition(self.low[at], groups - kk, axis=1)[:, groups - kk]
        for i in np.flatnonzero(~small).tolist():  # k not small against the groups: the exact k-th largest
            j = int(self.sel[i])
            row = self.overlay.row(j, self.rows.rows[j])
            thr[i] = np.partition(row, width - k[i])[width - k[i]]
        return thr

    def collect(self, thr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The finite entries at or above ``thr`` (per row; +inf skips a row) as (position in
        ``sel``, token, float64 adjusted logit)."""
        groups, width = self.rows.groups, self.rows.width
        # (np.flatnonzero and divmod: np.nonzero of a 2-d array is several times slower)
        hit_r, hit_g = divmod(np.flatnonzero(self.high >= thr[:, None]), groups)
        if 4 * len(hit_r) > self.high.size:  # most groups reach thr: compare whole rows instead
            full = self.rows.take(self.sel)
            r, tok = divmod(np.flatnonzero(full >= thr[:, None]), width)
            raw = full[r, tok]
        else:
            v32 = self.rows.gather(self.sel, hit_r, hit_g)  # [hits, _GROUP]
            hi, lane = divmod(np.flatnonzero(v32 >= thr[hit_r, None]), _GROUP)
            r, tok, raw = hit_r[hi], lane * groups + hit_g[hi], v32[hi, lane]
        # Entries whose raw value reaches thr (their adjusted value decides), and overlay entries
        # raised to it from below.
        v = self.overlay.patch(self.sel[r] * width + tok, raw)
        o_r, o_val = self.o_r, self.o_val
        raised = (o_val >= thr[o_r]) & (self.o_raw < thr[o_r])
        if raised.any():
            r, tok = np.concatenate((r, o_r[raised])), np.concatenate((tok, self.o_tok[raised]))
            v = np.concatenate((v, o_val[raised]))
        ok = (v >= thr[r]) & (v > -np.inf) & (tok < self.vocab)
        return r[ok], tok[ok], v[ok]


def _top_candidates(
    rows: _Rows, sel: np.ndarray, k: np.ndarray, overlay: _Overlay, vocab: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A superset of the ``k`` largest adjusted logits of each row in ``sel`` (ties included), as
    (position in ``sel``, token, float64 value)."""
    selection = _Selection(rows, sel, overlay, vocab)
    return selection.collect(selection.kth(k))


def _argmax(rows: _Rows, sel: np.ndarray, overlay: _Overlay, vocab: int) -> np.ndarray:
    """Greedy rows: the first largest adjusted logit, like np.argmax of the reference's row. The raw
    argmax stands unless the overlay changed it or an overlay entry beats it; rows where the overlay
    changed it go through partial selection."""
    width = rows.width
    token = rows.argmax(sel)
    o_r, o_tok, o_val, _ = overlay.of_rows(sel, len(rows))
    if not o_r.size:
        return token
    keys = sel * width + token
    best = rows.at(keys).astype(np.float64)
    pos = np.minimum(np.searchsorted(overlay.keys, keys), overlay.keys.size - 1)
    hard = overlay.keys[pos] == keys
    beat = (o_val > best[o_r]) | ((o_val == best[o_r]) & (o_tok < token[o_r]))
    beat &= ~hard[o_r]
    if beat.any():
        r, t, v = o_r[beat], o_tok[beat], o_val[beat]
        order = np.lexsort((t, -v, r))
        first = order[np.concatenate(([True], r[order][1:] != r[order][:-1]))]
        token[r[first]] = t[first]
    if hard.any():
        at = np.flatnonzero(hard)
        one = np.ones(len(at), np.int64)
        r, t, v = _top_candidates(rows, sel[at], one, overlay, vocab)
        src, _, take = _pad(r, t, v, len(at), one)
        _need(take)
        token[at] = t[src[:, 0]]
    return token


def _plan_whole_rows(
    rows: _Rows,
    sel: np.ndarray,
    overlay: _Overlay,
    temp: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    vocab: int,
    picks: list[_Pick],
) -> None:
    """Sampled rows without top_k: their probabilities are normalised over the whole vocabulary,
    whose weights exp((logit - max) / T) are therefore computed for whole rows, in float64 from the
    exact adjusted logits (float32 would move the CDF by 1e-7, and with it draws), a few rows at a
    time in one buffer (float64 rows of a large vocabulary do not stay in cache by the dozen). This
    differs from the reference's exp(logit / T - max / T) by rounding far below a float32 ulp."""
    width = rows.width
    cut = (top_p < 1.0) | (min_p > 0.0)
    plain, nucleus = sel[~cut[sel]], sel[cut[sel]]
    starts = np.arange(0, vocab, _BLOCK)
    buf = np.empty((min(_WHOLE_ROWS, len(sel)), width))
    bounds = np.searchsorted(overlay.keys, np.arange(len(rows) + 1) * width)

    def weights(chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = buf[: len(chunk)]
        for i, j in enumerate(chunk.tolist()):
            w[i] = rows.rows[j]
            lo, hi = bounds[j], bounds[j + 1]
            w[i, overlay.keys[lo:hi] - j * width] = overlay.values[lo:hi]
        top = w.max(axis=1)
        w -= top[:, None]
        w *= (1.0 / temp[chunk])[:, None]
        return np.exp(w, out=w), top

    for start in range(0, len(plain), _WHOLE_ROWS):
        chunk = plain[start : start + _WHOLE_ROWS]
        w, top = weights(chunk)
        blocks = np.cumsum(np.add.reduceat(w[:, :vocab], starts, axis=1), axis=1)
        for i, j in enumerate(chunk.tolist()):
            lo, hi = bounds[j], bounds[j + 1]
            tok, val = overlay.keys[lo:hi] - j * width, overlay.values[lo:hi]
            picks[j].whole = _WholeRow(rows.rows[j], tok, val, float(top[i]), 1.0 / temp[j], blocks[i], vocab)
    if not nucleus.size:
        return
    mass, top = np.empty(len(nucleus)), np.empty(len(nucleus))
    for start in range(0, len(nucleus), _WHOLE_ROWS):
        w, top[start : start + _WHOLE_ROWS] = weights(nucleus[start : start + _WHOLE_ROWS])
        mass[start : start + _WHOLE_ROWS] = w.sum(axis=1)
    _plan_nucleus(rows, nucleus, overlay, mass, top, temp[nucleus], top_p[nucleus], min_p[nucleus], vocab, picks)


def _plan_nucleus(
    rows: _Rows,
    sel: np.ndarray,
    overlay: _Overlay,
    mass: np.ndarray,
    top: np.ndarray,
    temp: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    vocab: int,
    picks: list[_Pick],
) -> None:
    """top_p / min_p rows without top_k: only tokens that can be kept are sorted, found by partial
    selection; ``mass`` is the sum of the row's weights exp((logit - top) / T).

    min_p keeps p >= min_p * p_max: logit >= top + T log(min_p). For top_p the 64 most likely tokens
    are tried first (most nuclei are smaller); then tokens with p < (1 - top_p) / (2 * vocab) hold
    less than half of the mass top_p leaves out, so those above reach top_p: logit >= top + T
    log(that * mass). Bounds are loosened by 1e-6 (rounding); a row whose top_p cut still falls
    outside them (it cannot, bar rounding) is sorted whole."""
    with np.errstate(divide="ignore"):
        by_p = np.where(top_p < 1.0, top + temp * (np.log(0.5 * (1.0 - top_p) / vocab * mass) - 1e-6), -np.inf)
        by_m = np.where(min_p > 0.0, top + temp * (np.log(min_p) - 1e-6), -np.inf)
    selection = _Selection(rows, sel, overlay, vocab)
    first = selection.kth(np.full(len(sel), min(_NUCLEUS_FIRST, vocab)))
    pending = np.arange(len(sel))
    for thr in (np.where(min_p > 0.0, by_m, first), np.maximum(by_p, by_m)):
        skip = np.full(len(sel), np.inf)
        skip[pending] = thr[pending]
        r, tok, v = selection.collect(skip)
        at = np.zeros(len(sel), np.int64)
        at[pending] = np.arange(len(pending))
        z, r = v / temp[r], at[r]  # rows renumbered among the pending ones
        src, valid, take = _pad(r, tok, z, len(pending))
        _need(take)
        i_ = pending[r]
        probs = np.where(valid, (np.exp((v - top[i_]) * (1.0 / temp[i_])) / mass[i_])[src], 0.0)
        keep, cdf, reached = _truncate(probs, take, top_p[pending], min_p[pending])
        done = reached | (min_p[pending] > 0.0)
        ids = tok[src]
        for i in np.flatnonzero(done).tolist():
            pick = picks[int(sel[pending[i]])]
            pick.ids, pick.cdf = ids[i, : keep[i]], cdf[i, : keep[i]]
        pending = pending[~done]
        if not pending.size:
            return
    for i in pending.tolist():
        j = int(sel[i])
        a = overlay.row(j, rows.rows[j])[:vocab]
        order = _canonical_order(a / temp[i])
        p = np.exp((a[order] - top[i]) * (1.0 / temp[i])) / mass[i]
        order = order[: int(np.count_nonzero(p))]  # zero probabilities come last
        keep, cdf, _ = _truncate(p[None, : len(order)], np.array([len(order)]), top_p[i : i + 1], min_p[i : i + 1])
        picks[j].ids, picks[j].cdf = order[: keep[0]], cdf[0, : keep[0]]


def _canonical_order(values: np.ndarray) -> np.ndarray:
    """All ids of a row by value descending, ties by id ascending."""
    return _canonical(np.zeros(len(values), np.int64), np.arange(len(values)), values)


def _canonical(r: np.ndarray, tok: np.ndarray, key: np.ndarray) -> np.ndarray:
    """The order by row, then key descending, then token: two fast (unstable, SIMD) sorts, one of
    the keys and one of unique integers packing (row, rank of the key, token), where np.lexsort's
    three stable sorts cost ten times as much. Many candidates are sorted row by row (sorts that
    stay in cache)."""
    if len(key) > 1 << 15 and r.max() > r.min():
        by_row = np.argsort(r, kind="stable")
        parts = np.split(by_row, np.flatnonzero(np.diff(r[by_row])) + 1)
        return np.concatenate([p[_canonical(np.zeros(len(p), np.int64), tok[p], key[p])] for p in parts])
    by_key = np.argsort(-key)
    sk = key[by_key]
    rank = np.empty(len(key), np.int64)
    rank[by_key] = np.concatenate(([0], np.cumsum(sk[1:] != sk[:-1])))
    tok_bits, rank_bits = int(tok.max()).bit_length(), len(key).bit_length()
    if tok_bits + rank_bits + int(r.max()).bit_length() > 62:
        return np.lexsort((tok, rank, r))
    return np.argsort((r.astype(np.int64) << (rank_bits + tok_bits)) | (rank << tok_bits) | tok)
