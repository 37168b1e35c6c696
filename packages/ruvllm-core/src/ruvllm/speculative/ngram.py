"""The n-gram proposer (prompt lookup): the tokens that followed the latest earlier occurrence of the
sequence's longest matching suffix, tried from ``n_max`` tokens down to ``n_min``.

No model and no memory beyond one index per sequence: for each n, the n-gram ending just before a
position maps to that position (the latest occurrence wins, as recent text predicts best), updated as
tokens are appended, so a proposal is one dictionary look-up per n.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """One sequence's n-gram index over its prompt and output."""

    def __init__(self, n_min: int = 1, n_max: int = 4) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        # _follow[n - n_min][ngram] = index of the token that followed its latest occurrence.
        self._follow: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max - n_min + 1)]

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` (the sequence's next tokens, in order)."""
        toks = self.tokens
        for t in tokens:
            i = len(toks)
            for n in range(self.n_min, min(self.n_max, i) + 1):
                self._follow[n - self.n_min][tuple(toks[i - n : i])] = i
            toks.append(int(t))

    def sync(self, token_ids: list[int]) -> None:
        """Catch up with ``token_ids`` (the sequence's tokens; the index holds a prefix of them)."""
        if len(token_ids) > len(self.tokens):
            self.extend(token_ids[len(self.tokens) :])

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix seen before (none when no suffix of
        ``n_min`` tokens or more occurred earlier)."""
        toks = self.tokens
        if k <= 0:
            return []
        for n in range(min(self.n_max, len(toks) - 1), self.n_min - 1, -1):
            j = self._follow[n - self.n_min].get(tuple(toks[len(toks) - n :]))
            if j is not None:
                return toks[j : j + k]
        return []
