"""How many tokens one sequence drafts: fewer while its drafts are mostly refused, none once its
acceptance stays below a threshold (a refused token costs a position of compute and buys nothing)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftLength:
    """Per-sequence draft length. ``k`` (at most ``k_max``) halves when fewer than half of a
    draft's tokens are kept and grows by one when all are; the acceptance rate is an exponential
    average (weight ``alpha``) of each verification's kept fraction, and below ``stop_below`` after
    ``warmup`` drafted tokens the sequence stops drafting for good."""

    k_max: int
    stop_below: float = 0.1
    warmup: int = 16
    alpha: float = 0.25
    k: int = 0
    rate: float = 1.0
    drafted: int = 0
    stopped: bool = False

    def __post_init__(self) -> None:
        self.k = self.k or self.k_max

    def want(self) -> int:
        """Tokens to draft next step (0: none)."""
        return 0 if self.stopped else self.k

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
