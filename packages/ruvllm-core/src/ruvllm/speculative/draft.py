"""The draft-model proposer: a second model (a smaller one, or the target's own checkpoint in a
cheaper form) sharing the target's tokenizer, with a paged KV cache and block tables of its own,
drafting for every sequence of a step in one batched forward pass per draft position.

The draft's cache follows each sequence lazily: before drafting, the tokens it fed that the sequence
no longer has (refused drafts) are dropped by giving back its block table's tail, and what the
sequence gained since (kept tokens, the target's own) is fed in the first pass with the sequence's
last token. Sequences that left the engine give their blocks back at the next proposal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ruvllm.backend import ForwardBatch, RestrictsHead, SequenceChunk
from ruvllm.block_manager import BlockManager
from ruvllm.engine.batch import block_table
from ruvllm.errors import RuvllmError

if TYPE_CHECKING:
    from ruvllm.runtime import LoadedModel
    from ruvllm.sampling import SamplingParams


class DraftModelError(RuvllmError):
    """The draft model cannot draft for this target (another tokenizer, another vocabulary)."""


def check_same_tokenizer(draft: LoadedModel, target: LoadedModel) -> None:
    """Refuse, by name, a draft whose tokens mean something else than the target's."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise DraftModelError(
            f"draft model {draft.name!r} has a vocabulary of {draft.config.vocab_size} tokens, the target "
            f"{target.name!r} {target.config.vocab_size}; a draft must share the target's tokenizer"
        )
    if draft.tokenizer.inner.get_vocab() != target.tokenizer.inner.get_vocab():
        raise DraftModelError(
            f"draft model {draft.name!r} has another tokenizer than the target {target.name!r}; "
            "a draft must share the target's tokenizer"
        )


#: A reduced draft head's row count is rounded up to this (the jax backend's panel layout).
HEAD_ROWS_MULTIPLE = 16


def draft_vocabulary(vocab_size: int, keep: int, special: list[int]) -> np.ndarray:
    """The token ids a reduced draft head keeps: the first ``keep`` ids (a BPE vocabulary lists its
    tokens in merge order: the lowest ids are the commonest pieces) and the ``special`` ones (EOS and
    other added tokens, which end a draft's answer), ``keep`` rounded up to a multiple of
    :data:`HEAD_ROWS_MULTIPLE` rows in all."""
    ids = sorted({i for i in special if 0 <= i < vocab_size})
    want = -(-(keep + len(ids)) // HEAD_ROWS_MULTIPLE) * HEAD_ROWS_MULTIPLE
    chosen = set(ids)
    for i in range(vocab_size):
        if len(chosen) >= want:
            break
        chosen.add(i)
    return np.asarray(sorted(chosen), dtype=np.int64)


#: The vocabulary each loaded draft's head was cut to (by ``id`` of its backend model): a head is cut
#: once, in place, so engines sharing a draft must ask for the same vocabulary.
_CUT_HEADS: dict[int, np.ndarray] = {}


def _cut_head(model: LoadedModel, vocab: np.ndarray) -> None:
    if not isinstance(model.model, RestrictsHead):
        raise DraftModelError(
            f"backend {model.backend.name!r} cannot cut its output head to some tokens; "
            "draft_vocab_size needs one that can"
        )
    done = _CUT_HEADS.get(id(model.model))
    if done is not None:
        if not np.array_equal(done, vocab):
            raise DraftModelError(f"draft model {model.name!r} was cut to another vocabulary by another engine")
        return
    model.model.restrict_head(vocab)
    _CUT_HEADS[id(model.model)] = vocab


@dataclass
class _Fed:
    """What the draft cache holds of one sequence: the tokens fed (their keys/values are written)."""

    tokens: list[int] = field(default_factory=list)


@dataclass
class DraftRequest:
    """One sequence to draft for: its id, its tokens, how many to draft, its sampling parameters."""

    seq_id: Any
    token_ids: list[int]
    k: int
    params: SamplingParams
    rng: np.random.Generator


class DraftProposer:
    """Drafts with ``model`` on a cache of ``num_blocks`` blocks of ``block_size`` tokens; ``vocab``:
    the only token ids it drafts (its output head cut to their rows, :class:`RestrictsHead`), None:
    every token. The target verifies over its whole vocabulary whatever the draft offers."""

    def __init__(
        self,
        model: LoadedModel,
        *,
        num_blocks: int,
        block_size: int,
        max_chunk: int = 2048,
        vocab: np.ndarray | None = None,
    ) -> None:
        self.model = model
        self.vocab = vocab
        self.vocab_size = model.config.vocab_size
        if vocab is not None:
            _cut_head(model, vocab)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.cache = model.allocate_cache(num_blocks, block_size)
        self.max_chunk = max_chunk
        self._fed: dict[Any, _Fed] = {}
        #: Milliseconds of each forward pass that fed one token per sequence, since the engine last
        #: took them (it prices the draft model's tokens by them).
        self.pass_ms: list[float] = []

    def propose(self, requests: list[DraftRequest], live: set[Any]) -> dict[Any, tuple[list[int], np.ndarray | None]]:
        """Each request's draft tokens and, for a sampled request, the draft's probabilities at each
        drafted position (``[len(draft), vocab]``; None for greedy: a deterministic draft). ``live``:
        the ids of every sequence still in the engine (the others' blocks go back)."""
        bm = self.block_manager
        for sid in [s for s in self._fed if s not in live]:
            bm.free(sid)
            del self._fed[sid]
        out: dict[Any, tuple[list[int], list[np.ndarray]]] = {}
        pending: list[tuple[DraftRequest, list[int]]] = []  # (request, tokens to feed now)
        for r in requests:
            fed = self._fed.setdefault(r.seq_id, _Fed())
            keep = _common_prefix(fed.tokens, r.token_ids)
            keep = min(keep, len(r.token_ids) - 1)  # the last token is fed again: its logits are needed
            if bm.has(r.seq_id):
                bm.truncate(r.seq_id, keep)
            fed.tokens = fed.tokens[:keep]
            need = len(r.token_ids) - keep
            if not bm.allocate_slots(r.seq_id, keep, need + r.k - 1):
                continue  # no room in the draft cache: this sequence does not draft this step
            pending.append((r, r.token_ids[keep:]))
            out[r.seq_id] = ([], [])
        while any(len(feed) > self.max_chunk for _, feed in pending):  # long catch-ups first, in pieces
            part = [(r, feed[: self.max_chunk]) for r, feed in pending if len(feed) > self.max_chunk]
            self._feed(part)
            pending = [(r, feed[self.max_chunk :] if len(feed) > self.max_chunk else feed) for r, feed in pending]
        for step in range(max((r.k for r, _ in pending), default=0)):
            batch = [(r, feed) for r, feed in pending if step < r.k]
            if not batch:
                break
            logits = self._feed(batch)
            pending = []
            for row, (r, _) in enumerate(batch):
                token, q = _draw(logits[row], r.params, r.rng)
                if self.vocab is not None:  # the reduced head's column -> the token id
                    token = int(self.vocab[token])
                    if q is not None:
                        full = np.zeros(self.vocab_size)
                        full[self.vocab] = q
                        q = full
                tokens, probs = out[r.seq_id]
                tokens.append(token)
                if q is not None:
                    probs.append(q)
                pending.append((r, [token]))
        return {sid: (tokens, np.stack(probs) if probs else None) for sid, (tokens, probs) in out.items()}

    def _feed(self, batch: list[tuple[DraftRequest, list[int]]]) -> np.ndarray:
        """Run each sequence's ``tokens`` in one forward pass; returns each one's last logits row."""
        bm = self.block_manager
        chunks = []
        for r, tokens in batch:
            fed = self._fed[r.seq_id]
            table = block_table(bm.block_table(r.seq_id))
            chunks.append(SequenceChunk(np.asarray(tokens, dtype=np.int32), len(fed.tokens), table))
            fed.tokens.extend(tokens)
        t0 = time.perf_counter()
        result = self.model.forward(ForwardBatch(chunks, bm.block_size), self.cache)
        logits = np.asarray(result.logits, dtype=np.float64)
        if all(len(tokens) == 1 for _, tokens in batch):
            self.pass_ms.append(1000.0 * (time.perf_counter() - t0))
        return logits


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _draw(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> tuple[int, np.ndarray | None]:
    """The draft's token: its argmax for a greedy request; for a sampled one a draw from its
    temperature-scaled distribution, returned as ``q`` (rejection sampling keeps the target's
    distribution whatever ``q`` is, as long as the token was drawn from it)."""
    if params.greedy:
        return int(np.argmax(logits)), None
    z = logits / params.temperature
    q = np.exp(z - z.max())
    q /= q.sum()
    cdf = np.cumsum(q)
    return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(q) - 1), q
