"""What draft positions cost at the step's load, measured, and how many a step takes.

A decoding step's time depends on how many rows it runs (one per decoding sequence plus each draft
token) in a way no constant captures: on a CPU a few rows share one read of the weights (a row
costs a fraction of a one-row step), a step of a dozen rows is compute-bound (a row costs about
what each other row does), and a backend that pads rows to compiled shapes (jax: powers of two)
makes rows free up to the next shape and then dear. So the engine measures it: :class:`StepCosts`
keeps the last :data:`RECENT` milliseconds of decode-only steps per row count and takes the least
(other work on a shared CPU only ever adds to a step; a row count's first step, which may have
compiled its shape, is not learnt; measurements are forgotten after :data:`FRESH_STEPS` steps: costs
drift as contexts grow), and estimates a row count it has not
measured from its measured neighbours (linearly between two; beyond the last one by the prior
``1 + position_cost * (rows - 1)``: a row costs ``position_cost`` of a one-row step).

:meth:`StepCosts.allot` then takes draft tokens, most probably kept first (the ``j``-th token of a
sequence whose tokens are each kept with probability ``a`` yields one more token with probability
``a^j``), as long as they raise the step's expected tokens per millisecond: a draft is taken only
where its expected gain beats its cost at this load. Nothing else depends on it: which tokens the
target emits never depends on what was drafted.
"""

from __future__ import annotations

import math
from collections import deque

#: A row count's measurements are used for this many steps after they were taken.
FRESH_STEPS = 256
#: Measurements kept per row count; the least of them is its cost (a shared CPU only adds delays).
RECENT = 8
#: Drafting must promise this much more tokens per millisecond than a plain step (measurements are noisy).
MIN_GAIN = 0.02
#: Every this many steps whose drafts were cut, one takes all it wanted (measuring the larger row count).
EXPLORE_EVERY = 32


class StepCosts:
    """Decode-only step milliseconds by row count, measured online, and the draft allotment they give.
    ``position_cost``: the prior cost of a row beyond those measured, as a fraction of a one-row step."""

    def __init__(self, position_cost: float) -> None:
        self.position_cost = position_cost
        #: rows -> the recent (milliseconds, step) measured
        self._ms: dict[int, deque[tuple[float, int]]] = {}
        #: Row counts stepped at least once (a row count's first step is not learnt).
        self._seen: set[int] = set()
        self.steps = 0
        self._cut_since_explore = 0

    def _prior(self, rows: int) -> float:
        return 1.0 + self.position_cost * (rows - 1)

    def observe(self, rows: int, ms: float) -> None:
        """A decode-only step of ``rows`` rows took ``ms`` milliseconds."""
        self.steps += 1
        if rows <= 0 or not math.isfinite(ms) or ms <= 0:
            return
        if rows not in self._seen:  # its first step may have compiled its shape
            self._seen.add(rows)
            return
        self._ms.setdefault(rows, deque(maxlen=RECENT)).append((ms, self.steps))

    def _fresh(self) -> list[tuple[int, float]]:
        """(rows, milliseconds) of every row count measured within :data:`FRESH_STEPS`, ascending."""
        since = self.steps - FRESH_STEPS
        out = []
        for rows, seen in self._ms.items():
            ms = [m for m, at in seen if at >= since]
            if ms:
                out.append((rows, min(ms)))
        return sorted(out)

    def measured(self, rows: int) -> bool:
        """Whether ``rows`` rows' time was measured within the last :data:`FRESH_STEPS` steps."""
        seen = self._ms.get(rows)
        return seen is not None and seen[-1][1] >= self.steps - FRESH_STEPS

    def estimate(self, rows: int) -> float:
        """Milliseconds of a decode-only step of ``rows`` rows (0: nothing measured yet)."""
        return self._curve(self._fresh(), rows, rows)[0]

    def _curve(self, fresh: list[tuple[int, float]], lo: int, hi: int) -> list[float]:
        """Estimated milliseconds for ``lo..hi`` rows from the ``fresh`` measurements: linear between
        two measured row counts, by the prior beyond them, and never less than a measured smaller
        row count's (more rows do not run faster; noise may say otherwise)."""
        if not fresh:
            return [0.0] * (hi - lo + 1)
        out, j, floor = [], 0, 0.0
        for rows in range(lo, hi + 1):
            while j < len(fresh) and fresh[j][0] <= rows:
                floor = max(floor, fresh[j][1])
                j += 1
            below = fresh[j - 1] if j > 0 else None
            above = fresh[j] if j < len(fresh) else None
            if below is not None and below[0] == rows:
                est = below[1]
            elif below is not None and above is not None:
                (r0, t0), (r1, t1) = below, above
                est = t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
            elif below is not None:
                est = below[1] * self._prior(rows) / self._prior(below[0])
            else:
                assert above is not None
                est = above[1] * self._prior(rows) / self._prior(above[0])
            out.append(max(est, floor))
        return out

    def allot(self, num_decode: int, rates: list[float], lengths: list[int]) -> list[int]:
        """Draft tokens each of ``num_decode`` decoding sequences' drafts keeps this step: sequence
        ``i`` offers ``lengths[i]`` tokens, each kept with probability ``rates[i]``. All of them
        before any step was measured; none while the plain step of ``num_decode`` rows is unmeasured
        (a plain step measures it, and never loses to the plain engine)."""
        wanted = sum(lengths)
        if wanted == 0 or not self._ms:
            return list(lengths)
        if not self.measured(num_decode):
            return [0] * len(lengths)
        # The j-th token of a sequence: its gain decreases with j, so the best first is a prefix of each.
        offers = sorted(
            ((rates[i] ** j, j, i) for i in range(len(lengths)) for j in range(1, lengths[i] + 1)),
            key=lambda o: (-o[0], o[1]),
        )
        cost = self._curve(self._fresh(), num_decode, num_decode + len(offers))
        plain = num_decode / cost[0]
        best_d, best, gain = 0, plain * (1.0 + MIN_GAIN), 0.0
        for d, (g, _, _) in enumerate(offers, 1):
            gain += g
            rate = (num_decode + gain) / cost[d]
            if rate > best:
                best_d, best = d, rate
        if best_d < wanted:
            self._cut_since_explore += 1
            if self._cut_since_explore >= EXPLORE_EVERY and not self.measured(num_decode + wanted):
                self._cut_since_explore = 0
                return list(lengths)  # measure what all of it costs: the prior may be too dear
        keep = [0] * len(lengths)
        for _, _, i in offers[:best_d]:
            keep[i] += 1
        return keep
