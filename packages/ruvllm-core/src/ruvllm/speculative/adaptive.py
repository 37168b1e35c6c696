"""How many tokens one sequence drafts: as many as pay for themselves. A draft of ``k`` tokens whose
tokens are each kept with probability ``a`` yields ``(1 - a^(k+1)) / (1 - a)`` tokens per step, and
the step's ``k`` more positions cost ``row_cost * k`` of a step (decoding on a CPU reads the weights
once for all positions, so a position costs a fraction of a step); a sequence drafts the ``k`` that
yields most per cost, none when no draft beats a plain step, and stops for good once its acceptance
stays below a threshold."""

from __future__ import annotations

from dataclasses import dataclass

#: Steps a sequence skips drafting (no draft paid off) before it tries one token again.
PROBE_AFTER = 16


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a step yields with a draft of ``k`` tokens each kept with probability ``rate``."""
    return float(k + 1) if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


@dataclass
class DraftLength:
    """Per-sequence draft length. ``k`` (at most ``k_max``) is the bound: it halves when fewer than
    half of a draft's tokens are kept and grows by one when all are; below it the length that yields
    most tokens per cost (``row_cost``, see the module doc) is drafted. The acceptance rate is an
    exponential average (weight ``alpha``) of each verification's kept fraction; below ``stop_below``
    after ``warmup`` drafted tokens the sequence stops drafting for good."""

    k_max: int
    stop_below: float = 0.1
    warmup: int = 16
    alpha: float = 0.25
    row_cost: float = 0.0
    k: int = 0
    rate: float = 1.0
    drafted: int = 0
    stopped: bool = False
    skipped: int = 0

    def __post_init__(self) -> None:
        self.k = self.k or self.k_max

    def want(self) -> int:
        """Tokens to draft next step (0: none)."""
        if self.stopped:
            return 0
        best_k, best = 0, 1.0
        for k in range(1, self.k + 1):
            per_cost = expected_tokens(self.rate, k) / (1.0 + self.row_cost * k)
            if per_cost > best:
                best_k, best = k, per_cost
        if best_k == 0:
            self.skipped += 1
            if self.skipped >= PROBE_AFTER:  # acceptance may have changed: measure it again
                self.skipped = 0
                return 1
        return best_k

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification of ``drafted`` tokens kept ``accepted`` of them."""
        if drafted <= 0:
            return
        self.drafted += drafted
        self.rate += self.alpha * (accepted / drafted - self.rate)
        if accepted == drafted:
            self.k = min(self.k_max, self.k + 1)
        elif 2 * accepted < drafted:
            self.k = max(1, self.k // 2)
        if self.drafted >= self.warmup and self.rate < self.stop_below:
            self.stopped = True
