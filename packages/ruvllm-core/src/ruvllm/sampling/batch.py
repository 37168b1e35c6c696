"""The batch sampler: one token for every sequence of a step in one vectorised pass, the same tokens
as :meth:`Sampler.sample <ruvllm.sampling.reference.Sampler.sample>` gives each row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, overload

import numpy as np

from ruvllm.sampling.reference import Sampler, SampleResult
from ruvllm.sampling.selection import (
    GROUP,
    Overlay,
    Rows,
    Selection,
    adjustments,
    apply_masks,
    argmax_adjusted,
    canonical_order,
    need,
    pad,
    top_candidates,
    unlocked,
)

#: Candidates tried first for a top_p row without top_k (most nuclei are smaller).
_NUCLEUS_FIRST = 64
#: Rows without top_k are processed this many at a time (their float64 rows then stay in cache).
_WHOLE_ROWS = 4
#: Tokens per block of an unfiltered row's CDF.
_BLOCK = 512
#: What a row with an infinite or NaN logit gets under ``sample_batch(check_finite=True)``.
NON_FINITE = "the model produced non-finite logits for this sequence"


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
    :func:`_draw`, so a pass that fails has changed no sampler."""

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
    samplers: Sequence[Sampler],
    logits: np.ndarray | Sequence[np.ndarray],
    *,
    return_exceptions: Literal[False] = ...,
    check_finite: bool = ...,
) -> list[SampleResult]: ...


@overload
def sample_batch(
    samplers: Sequence[Sampler],
    logits: np.ndarray | Sequence[np.ndarray],
    *,
    return_exceptions: Literal[True],
    check_finite: bool = ...,
) -> list[SampleResult | Exception]: ...


def sample_batch(
    samplers: Sequence[Sampler],
    logits: np.ndarray | Sequence[np.ndarray],
    *,
    return_exceptions: bool = False,
    check_finite: bool = False,
) -> list[SampleResult] | list[SampleResult | Exception]:
    """Sample one token for each sampler from its row of ``logits`` ([batch, vocab], or one row per
    sampler; rows may repeat), in one vectorised pass: the same tokens, logprobs and state updates as
    calling each ``samplers[i].sample(logits[i])``, at a fraction of the cost.

    The raw rows are read as they are (one pass of partial selection: no copy, no sort of the
    vocabulary); the entries penalties, bias and bans change are kept aside with the reference's
    float64 values, and probabilities are computed in float64 over the candidates (over whole rows
    only for rows without top_k, which normalise over the vocabulary). The draws then equal the
    reference's for float32 (or narrower) logits, up to float64 rounding. Greedy rows that nothing
    adjusts and that ask for no logprobs take the argmax of their raw row, nothing more. Each
    sampler's random draw and state update happen after the pass, so a pass that fails changes no
    sampler. With ``return_exceptions`` an exception tied to one row (its constraint, its data) is
    returned in that row's place and the other rows are sampled as usual; without it, it is raised.
    With ``check_finite`` a row holding an infinite or NaN logit is such an exception
    (FloatingPointError), found in the same pass over the row as its argmax.
    """
    n = len(samplers)
    if len(logits) != n:
        raise ValueError(f"{n} samplers but {len(logits)} logits rows")
    out: list[SampleResult | Exception | None] = [None] * n
    vocab = int(np.shape(logits[0])[-1]) if n else 0
    plain = [s.raw_argmax(vocab) for s in samplers]
    picks: dict[int, _Pick] = {}
    if check_finite or any(plain):
        for i, token in _scan(logits, plain, check_finite, vocab).items():
            if token is None:
                if not return_exceptions:
                    raise FloatingPointError(NON_FINITE)
                out[i] = FloatingPointError(NON_FINITE)
            elif plain[i]:
                picks[i] = _Pick(token=token)
    masks: list[np.ndarray | None] = [None] * n
    for i, s in enumerate(samplers):
        if s.constraint is not None and out[i] is None:
            try:
                masks[i] = np.asarray(s.constraint.allowed(), dtype=bool)
            except Exception as exc:
                if not return_exceptions:
                    raise
                out[i] = exc
    live = [i for i in range(n) if out[i] is None and i not in picks]
    if return_exceptions:
        picks |= _plan_isolating(samplers, logits, masks, live, out)
    else:
        planned = _plan([samplers[i] for i in live], [logits[i] for i in live], [masks[i] for i in live])
        picks |= dict(zip(live, planned, strict=True))
    for i in sorted(picks):
        try:
            out[i] = _draw(samplers[i], picks[i], logits[i])
        except Exception as exc:
            if not return_exceptions:
                raise
            out[i] = exc
    return out  # type: ignore[return-value]  # every row is filled


def _scan(
    logits: np.ndarray | Sequence[np.ndarray], plain: list[bool], check_finite: bool, vocab: int
) -> dict[int, int | None]:
    """One pass over each row that is plain greedy (its argmax) or checked (whether it is all
    finite), the row read once while it is in cache: row index -> its argmax (of a checked row that
    is not plain, any int), or None for a checked row that is not all finite. A repeated row is read
    once. Rows of another shape or dtype are left to the full pass (which refuses a bad shape), bar
    the finite check."""
    found: dict[int, int | None] = {}
    wanted = [i for i in range(len(plain)) if plain[i] or check_finite]
    if not wanted:
        return found
    # Read-only rows are read through writeable aliases (NumPy's argmax would copy each first); the
    # engine's rows are writeable already (see StepExecutor.run).
    rows = unlocked(logits) if isinstance(logits, np.ndarray) else logits
    done: dict[int, int | None] = {}
    for i in wanted:
        # Rows of a list are the list's objects (a fork's repeat one); a matrix's are all distinct.
        key = i if isinstance(logits, np.ndarray) else id(logits[i])
        if key in done:
            found[i] = done[key]
            continue
        row = rows[i]
        if not (isinstance(row, np.ndarray) and row.dtype == np.float32 and row.shape == (vocab,)):
            if check_finite and not np.isfinite(row).all():
                done[key] = found[i] = None
            elif plain[i]:
                plain[i] = False  # the full pass samples it (and refuses a bad shape)
            continue
        if not row.flags.writeable:
            row = unlocked(row)
        token = int(row.argmax())
        # The argmax is the first NaN if there is one, else +inf if there is one: with the minimum
        # (-inf), every non-finite value is seen.
        if check_finite and not (np.isfinite(row[token]) and np.isfinite(row.min())):
            token = None
        done[key] = found[i] = token
    return found


def _draw(sampler: Sampler, pick: _Pick, raw: np.ndarray) -> SampleResult:
    """Draw from what the batch pass decided for ``sampler``'s row and update its state like
    :meth:`Sampler.sample`."""
    if pick.cdf is not None:
        cdf = pick.cdf
        idx = min(int(cdf.searchsorted(sampler.rng.random() * cdf[-1], side="right")), len(cdf) - 1)
        token = idx if pick.ids is None else int(pick.ids[idx])
    elif pick.whole is not None:
        token = pick.whole.draw(sampler.rng.random())
    else:
        token = pick.token
    chosen_lp = 0.0 if pick.lse is None else float(raw[token]) - pick.lse
    sampler._record(token)
    return SampleResult(token, chosen_lp, pick.top)


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


def _plan(samplers: Sequence[Sampler], logits: Sequence[np.ndarray], masks: Sequence[np.ndarray | None]) -> list[_Pick]:
    """The vectorised part of :func:`sample_batch`: everything but the draws and the state updates.

    The adjusted logits are never materialised: the raw rows are read as they are, and the few
    entries penalties, bias and bans change are an :class:`Overlay` of exact float64 values. Only
    rows under a grammar mask are copied (masked); rows without top_k are expanded to float64."""
    b = len(samplers)
    picks = [_Pick() for _ in range(b)]
    if not b:
        return picks
    vocab = int(np.shape(logits[0])[-1])
    groups = -(-vocab // GROUP)
    width = groups * GROUP
    rows = Rows(logits, vocab, width)
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
        none = Overlay(np.empty(0, np.int64), np.empty(0), np.empty(0, np.float32), width)
        r, tok, v = top_candidates(rows, top_rows, k, none, vocab)
        src, _, take = pad(r, tok, v, len(top_rows), k)
        for i, j in enumerate(top_rows.tolist()):
            s = src[i, : take[i]]
            picks[j].top = [(t, x - lse[j]) for t, x in zip(tok[s].tolist(), v[s].tolist(), strict=True)]

    overlay = adjustments(samplers, params, rows, vocab)
    if any(mask is not None for mask in masks):
        overlay = apply_masks(rows, masks, overlay, vocab)

    greedy = np.array([j for j, p in enumerate(params) if p.greedy], np.int64)
    with_k = [not p.greedy and 0 < p.top_k < vocab for p in params]
    sampled_k = np.flatnonzero(with_k)
    sampled_n = np.array([j for j, p in enumerate(params) if not p.greedy and not with_k[j]], np.int64)
    temp = np.array([p.temperature for p in params], np.float64)
    top_p = np.array([p.top_p for p in params], np.float64)
    min_p = np.array([p.min_p for p in params], np.float64)

    if greedy.size:
        for j, token in zip(greedy.tolist(), argmax_adjusted(rows, greedy, overlay, vocab).tolist(), strict=True):
            picks[j].token = token

    if sampled_k.size:
        # top_k: candidates by partial selection, ordered by their exact logits, cut to k.
        k = np.array([params[j].top_k for j in sampled_k.tolist()])
        r, tok, v = top_candidates(rows, sampled_k, k, overlay, vocab)
        z = v / temp[sampled_k][r]
        src, valid, take = pad(r, tok, z, len(sampled_k), k)
        need(take)
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


def _plan_whole_rows(
    rows: Rows,
    sel: np.ndarray,
    overlay: Overlay,
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
    rows: Rows,
    sel: np.ndarray,
    overlay: Overlay,
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
    selection = Selection(rows, sel, overlay, vocab)
    first = selection.kth(np.full(len(sel), min(_NUCLEUS_FIRST, vocab)))
    pending = np.arange(len(sel))
    for thr in (np.where(min_p > 0.0, by_m, first), np.maximum(by_p, by_m)):
        skip = np.full(len(sel), np.inf)
        skip[pending] = thr[pending]
        r, tok, v = selection.collect(skip)
        at = np.zeros(len(sel), np.int64)
        at[pending] = np.arange(len(pending))
        z, r = v / temp[r], at[r]  # rows renumbered among the pending ones
        src, valid, take = pad(r, tok, z, len(pending))
        need(take)
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
        order = canonical_order(a / temp[i])
        p = np.exp((a[order] - top[i]) * (1.0 / temp[i])) / mass[i]
        order = order[: int(np.count_nonzero(p))]  # zero probabilities come last
        keep, cdf, _ = _truncate(p[None, : len(order)], np.array([len(order)]), top_p[i : i + 1], min_p[i : i + 1])
        picks[j].ids, picks[j].cdf = order[: keep[0]], cdf[0, : keep[0]]
