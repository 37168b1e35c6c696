"""Rejection sampling (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative
Decoding"): a draft token ``x`` drawn from ``q`` is kept with probability ``min(1, p(x) / q(x))``;
when it is not, the token is drawn from ``max(0, p - q)`` renormalised. Every emitted token is then
distributed as the target's ``p``, whatever ``q`` is. A deterministic proposal (n-gram lookup) is the
one-hot ``q``: ``x`` is kept with probability ``p(x)``, else the token is drawn from ``p`` without ``x``.
"""

from __future__ import annotations

import numpy as np


def accept_or_resample(p: np.ndarray, token: int, q: np.ndarray | None, rng: np.random.Generator) -> tuple[bool, int]:
    """One position: ``(accepted, token to emit)`` for the draft ``token`` under the target
    probabilities ``p`` (a vector over the vocabulary, summing to 1) and the draft's ``q`` (same
    shape; None: the draft was deterministic, a one-hot ``q``)."""
    p = np.asarray(p, dtype=np.float64)
    px = float(p[token]) if 0 <= token < len(p) else 0.0
    qx = 1.0 if q is None else float(q[token])
    if px > 0.0 and (qx <= px or rng.random() * qx < px):
        return True, int(token)
    if q is None:
        residual = p.copy()
        if 0 <= token < len(p):
            residual[token] = 0.0
    else:
        residual = np.maximum(p - np.asarray(q, dtype=np.float64), 0.0)
    total = residual.sum()
    if not total > 0.0:  # p and q agree (rounding): any draw from p serves
        residual, total = p, p.sum()
    cdf = np.cumsum(residual)
    idx = int(np.searchsorted(cdf, rng.random() * total, side="right"))
    return False, min(idx, len(p) - 1)


def rejection_sample(
    p_rows: np.ndarray, draft: list[int], q_rows: np.ndarray | None, rng: np.random.Generator
) -> list[int]:
    """The tokens one verification emits: ``p_rows`` are the target's probabilities at the ``k + 1``
    positions of a draft of ``k`` tokens (row ``i`` after the first ``i`` draft tokens), ``q_rows`` the
    draft's at its ``k`` positions (None: a deterministic draft). Returns the accepted draft prefix
    and one more token: the resampled one where a draft token was rejected, else a draw from the
    last row (the bonus token)."""
    out: list[int] = []
    for i, token in enumerate(draft):
        ok, emitted = accept_or_resample(p_rows[i], token, None if q_rows is None else q_rows[i], rng)
        out.append(emitted)
        if not ok:
            return out
    last = np.asarray(p_rows[len(draft)], dtype=np.float64)
    cdf = np.cumsum(last)
    out.append(min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(last) - 1))
    return out
