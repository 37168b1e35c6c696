"""Which proposer drafts for a sequence at a step, and how many tokens: ``speculative="ngram+draft"``.

Each sequence keeps an n-gram index and one :class:`~ruvllm.speculative.adaptive.DraftLength` per
proposer (their acceptance differs: a prompt-lookup draft is kept nearly whole or not at all, a draft
model's decays token by token). At each step both are priced in units of a plain target step: ``k``
drafted tokens cost the verification of ``k`` more rows (``verify(k)``, measured) and, for the draft
model, ``k`` of its own passes (``draft_cost`` each, measured against a target step). The proposal
that yields the most tokens per cost is drafted; none when neither beats a plain step. The n-gram
lookup costs nothing to ask, so it is asked first; the draft model runs only when it wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ruvllm.speculative.adaptive import PROBE_AFTER, DraftLength, expected_tokens
from ruvllm.speculative.ngram import NgramIndex

#: The two proposers' names (``SequenceDrafting.source``).
NGRAM = "ngram"
MODEL = "draft"
#: Drafting must promise this much more than a plain step per unit of cost (costs are measured, noisily).
MIN_GAIN = 0.02


def best_length(length: DraftLength, cap: int, cost: Callable[[int], float]) -> tuple[int, float]:
    """The draft length up to ``min(length.k, cap)`` that yields most tokens per ``cost(k)`` (a plain
    step costs 1 and yields 1) at ``length``'s acceptance rate, and that yield (0 and 1.0: none)."""
    best_k, best = 0, 1.0
    if length.stopped:
        return best_k, best
    for k in range(1, min(length.k, cap) + 1):
        per_cost = expected_tokens(length.rate, k) / cost(k)
        if per_cost > best:
            best_k, best = k, per_cost
    return best_k, best


@dataclass
class SequenceDrafting:
    """One sequence's drafting state: its n-gram index, each proposer's acceptance and length, and
    which proposer made the draft now being verified."""

    index: NgramIndex
    ngram: DraftLength
    model: DraftLength
    source: str = NGRAM
    #: Steps in a row where no proposal paid (one token is then drafted again, to measure).
    skipped: int = 0

    @property
    def length(self) -> DraftLength:
        """The length tracker of the proposer that drafted last."""
        return self.ngram if self.source == NGRAM else self.model

    def observe(self, drafted: int, accepted: int) -> None:
        """The last draft (``drafted`` tokens, of :attr:`source`) kept ``accepted`` of them."""
        self.length.observe(drafted, accepted)

    def choose(
        self, token_ids: list[int], cap: int, verify: Callable[[int], float], draft_cost: float
    ) -> tuple[str, int, list[int]]:
        """The proposer, draft length and (for the n-gram lookup) tokens for this step, at most
        ``cap`` tokens: the prompt lookup's proposal when it matches and yields most per cost, the
        draft model's otherwise, nothing when neither beats a plain step (``(source, 0, [])``)."""
        self.index.sync(token_ids)
        found = self.index.propose(min(self.ngram.k, cap)) if not self.ngram.stopped else []
        best = (MODEL, 0, [], 1.0 + MIN_GAIN)
        if found:
            k, per_cost = best_length(self.ngram, len(found), verify)
            if per_cost > best[3]:
                best = (NGRAM, k, found[:k], per_cost)
        k, per_cost = best_length(self.model, cap, lambda n: verify(n) + draft_cost * n)
        if per_cost > best[3]:
            best = (MODEL, k, [], per_cost)
        source, k, tokens, _ = best
        if k == 0:
            self.skipped += 1
            if self.skipped < PROBE_AFTER or cap < 1:
                return source, 0, []
            # Acceptance may have changed since: measure it again with one token.
            self.skipped = 0
            if found and not self.ngram.stopped:
                return NGRAM, 1, found[:1]
            return (MODEL, 1, []) if not self.model.stopped else (MODEL, 0, [])
        self.skipped = 0
        return source, k, tokens


@dataclass
class DraftPassCosts:
    """The draft model's recent milliseconds per drafting pass (one token per sequence); the least
    of them is its cost (a shared CPU only ever adds to a pass)."""

    recent: list[float] = field(default_factory=list)
    keep: int = 8

    def observe(self, ms: float) -> None:
        self.recent.append(ms)
        del self.recent[: -self.keep]

    def ms(self) -> float:
        """Milliseconds of one drafting pass (0: none measured)."""
        return min(self.recent) if self.recent else 0.0
