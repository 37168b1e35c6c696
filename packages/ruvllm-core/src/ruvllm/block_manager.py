"""Paged KV-cache bookkeeping: which fixed-size blocks each sequence owns, shared and cached.

The block manager speaks only block ids and token ids; the backend owns the tensors. Every sequence
has a block table (slot ``p`` of the sequence lives in ``table[p // block_size]``). The blocks come
from a :class:`~ruvllm.block_pool.BlockPool` (reference counts, the free queue, the prefix cache's
hash map); the manager holds the policy over it: which blocks a sequence takes, shares and releases.
Blocks carry a reference count, so sequences can share them:

* **Prefix caching.** Once a block is full and its keys/values are computed, it is registered under
  a hash of (hash of the previous block, the block's token ids). A later sequence whose prompt starts
  with the same full blocks takes those blocks instead of recomputing them. Only exact hash-chain
  matches of full blocks hit, so a sequence never sees keys/values of tokens it does not have.
* **Reuse and eviction.** A cached block nobody references stays cached until its slot is needed;
  then the least recently used one is evicted (``lfu`` and ``fifo`` are selectable).
* **Copy-on-write.** ``fork`` shares a sequence's blocks with a new one (``n > 1`` choices share
  their prompt). The first write into a block that someone else still references copies it to a
  fresh block first; the (src, dst) pairs are handed to the backend with the next forward step.
* **Sliding windows.** For a model whose every layer attends over the last ``sliding_window``
  positions only, a block whose positions all lie before the window of the sequence's next token is
  never read again: it is released as the sequence grows (its table entry becomes :data:`NO_BLOCK`),
  so a sequence holds about ``window / block_size + 1`` blocks whatever its length. A released block
  that is cached stays cached for prefix hits (a later prompt with the same start takes it again).
  Models that interleave windowed and global layers (Gemma 3: five local to one global) keep two
  groups of blocks, as vLLM's hybrid KV cache manager does (:class:`HybridBlockManager`): one pool
  for the global layers, which keep every block, and one for the windowed layers, whose blocks are
  released as above; each sequence has a table in each. A backend that stores the groups apart
  (``Capabilities.hybrid_kv``) reads the windowed layers through the second table.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ruvllm.backend import NO_BLOCK  # the table entry of a block that fell out of the window
from ruvllm.block_pool import EVICTION_POLICIES, BlockManagerError, BlockPool

__all__ = [
    "EVICTION_POLICIES",
    "NO_BLOCK",
    "BlockManager",
    "BlockManagerError",
    "BlockPool",
    "HybridBlockManager",
    "HybridPrefixHit",
    "PrefixHit",
    "block_hash",
]


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of a full block: the parent's hash chained with this block's token ids (128-bit)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class PrefixHit:
    """Cached blocks that hold the keys/values of a token sequence's leading full blocks."""

    block_ids: list[int]
    hashes: list[bytes]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids) * self.block_size


@dataclass
class _SequenceBlocks:
    table: list[int] = field(default_factory=list)
    #: Hash chain of the sequence's leading full, computed blocks (registered or not).
    hashes: list[bytes] = field(default_factory=list)


class BlockManager:
    """Owns the pool of ``num_blocks`` KV blocks of ``block_size`` tokens and every block table."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        eviction: str = "lru",
        sliding_window: int = 0,
    ) -> None:
        if block_size < 1:
            raise BlockManagerError(f"block_size must be at least 1, got {block_size}")
        if sliding_window < 0:
            raise BlockManagerError(f"sliding_window must be 0 (none) or positive, got {sliding_window}")
        #: The blocks (reference counts, free queue, prefix cache) this manager hands out.
        self.pool = BlockPool(num_blocks, eviction)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.eviction = eviction
        self._seqs: dict[Hashable, _SequenceBlocks] = {}
        self._pending_copies: list[tuple[int, int]] = []

    # ----------------------------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty ones plus unreferenced cached ones)."""
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    @property
    def evictions(self) -> int:
        """Cached blocks evicted to be handed out again."""
        return self.pool.evictions

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's blocks in position order; :data:`NO_BLOCK` where one fell out of the window."""
        return self._entry(seq_id).table

    def ref_count(self, block_id: int) -> int:
        return self.pool.ref_count(block_id)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def peak_blocks(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks one sequence of ``num_tokens`` holds at once when it is computed in steps
        of at most ``chunk_tokens`` (with a sliding window: the window before a step plus the step)."""
        whole = self.blocks_needed(num_tokens)
        if not self.sliding_window:
            return whole
        return min(whole, self.blocks_needed(self.sliding_window - 1 + chunk_tokens) + 1)

    def first_live_block(self, num_computed: int) -> int:
        """Index of the first block a sequence's next token (at ``num_computed``) or any later one can
        read: with a sliding window ``w`` that is the block of position ``num_computed - w + 1``."""
        if not self.sliding_window:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def get_cached_prefix(self, token_ids: Sequence[int]) -> PrefixHit:
        """The cached blocks matching the leading full blocks of ``token_ids`` (nothing is taken).

        At least the last token is always left to compute, because its logits are what the caller
        needs from the forward step.
        """
        hit = PrefixHit([], [], self.block_size)
        if not self.enable_prefix_caching:
            return hit
        bs = self.block_size
        parent = b""
        for i in range((len(token_ids) - 1) // bs):
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self.pool.cached_block(h)
            if block is None:
                break
            hit.block_ids.append(block)
            hit.hashes.append(h)
            parent = h
        return hit

    # ------------------------------------------------------------------------------- allocation

    def allocate_slots(
        self, seq_id: Hashable, num_computed: int, num_new: int, prefix: PrefixHit | None = None
    ) -> bool:
        """Make ``seq_id``'s table cover slots ``0 .. num_computed + num_new`` and make the slots
        from ``num_computed`` on writable (copy-on-write of shared blocks).

        A sequence's first call may pass a ``prefix`` from :meth:`get_cached_prefix`; its blocks
        become the start of the table and ``num_computed`` must equal ``prefix.num_tokens``.
        Returns False, changing nothing, when there are not enough free blocks.
        """
        need_new, to_copy, taken_from_pool = self._plan(seq_id, num_computed, num_new, prefix)
        if need_new + len(to_copy) + taken_from_pool > self.num_free_blocks:
            return False
        pool = self.pool
        entry = self._seqs.get(seq_id)
        table = entry.table if entry is not None else []
        if entry is None:
            entry = self._seqs[seq_id] = _SequenceBlocks()
            table = entry.table
        if prefix is not None and prefix.block_ids:
            for b in prefix.block_ids:
                if b != NO_BLOCK:  # (a windowed group's hit: blocks before the window are not needed)
                    pool.take(b, hit=True)
            table.extend(prefix.block_ids)
            entry.hashes = list(prefix.hashes)
        for i in to_copy:
            src = table[i]
            dst = pool.allocate()
            self._pending_copies.append((src, dst))
            table[i] = dst
            pool.release(src)
        for _ in range(need_new):
            table.append(pool.allocate())
        self._release_out_of_window(entry, num_computed)  # a prefix hit may reach past the window
        return True

    def blocks_to_take(self, seq_id: Hashable, num_computed: int, num_new: int, prefix: PrefixHit | None = None) -> int:
        """Blocks :meth:`allocate_slots` with these arguments would take from the free ones (it
        succeeds when this is at most :attr:`num_free_blocks`)."""
        need_new, to_copy, taken_from_pool = self._plan(seq_id, num_computed, num_new, prefix)
        return need_new + len(to_copy) + taken_from_pool

    def _plan(
        self, seq_id: Hashable, num_computed: int, num_new: int, prefix: PrefixHit | None
    ) -> tuple[int, list[int], int]:
        """(new blocks, table indices to copy on write, cached blocks taken out of the pool) of an
        allocation; releases the sequence's blocks that fell out of its window first."""
        entry = self._seqs.get(seq_id)
        if entry is not None:
            self._release_out_of_window(entry, num_computed)
        if prefix is not None and prefix.block_ids:
            if entry is not None and entry.table:
                raise BlockManagerError(f"sequence {seq_id!r} already has blocks; a prefix only starts a table")
            if num_computed != prefix.num_tokens:
                raise BlockManagerError("num_computed must equal the prefix hit's token count")
        table = entry.table if entry is not None else []
        have = len(table) + (len(prefix.block_ids) if prefix is not None else 0)
        need_new = max(0, self.blocks_needed(num_computed + num_new) - have)
        first, last = num_computed // self.block_size, self.blocks_needed(num_computed + num_new)
        pool = self.pool
        to_copy = [i for i in range(first, min(last, len(table))) if pool.must_copy(table[i])]
        taken_from_pool = sum(
            1 for b in (prefix.block_ids if prefix else ()) if b != NO_BLOCK and pool.ref_count(b) == 0
        )
        return need_new, to_copy, taken_from_pool

    def cached_block(self, block_hash_: bytes) -> int | None:
        """The block cached under a hash, if any."""
        return self.pool.cached_block(block_hash_) if self.enable_prefix_caching else None

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the sequence's full blocks whose keys/values are now all computed, so later
        sequences can reuse them. ``token_ids`` are the sequence's tokens (at least ``num_computed``)."""
        if not self.enable_prefix_caching:
            return
        entry = self._entry(seq_id)
        bs = self.block_size
        full = min(num_computed // bs, len(entry.table))
        for i in range(len(entry.hashes), full):
            parent = entry.hashes[i - 1] if i else b""
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            entry.hashes.append(h)
            b = entry.table[i]
            if b != NO_BLOCK:
                self.pool.cache(b, h)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Give ``child_id`` the same blocks as ``parent_id`` (shared until one of them writes)."""
        if child_id in self._seqs:
            raise BlockManagerError(f"sequence {child_id!r} already has blocks")
        parent = self._entry(parent_id)
        for b in parent.table:
            if b != NO_BLOCK:
                self.pool.take(b)
        self._seqs[child_id] = _SequenceBlocks(list(parent.table), list(parent.hashes))

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence's references; blocks nobody references return to the pool. Unknown
        ids are ignored (a sequence that never got a block has nothing to free)."""
        entry = self._seqs.pop(seq_id, None)
        if entry is None:
            return
        # Tail first: under LRU the tail of a sequence is then evicted before its head, which
        # more future prompts share.
        for b in reversed(entry.table):
            if b != NO_BLOCK:
                self.pool.release(b)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` slots (a speculative draft's refused
        positions): the table then covers what it would had only ``num_tokens`` slots been allocated."""
        entry = self._entry(seq_id)
        keep = max(self.blocks_needed(num_tokens), len(entry.hashes))
        while len(entry.table) > keep:
            b = entry.table.pop()
            if b != NO_BLOCK:
                self.pool.release(b)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies owed to the backend since the last call."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that nobody references."""
        self.pool.reset_prefix_cache()

    # -------------------------------------------------------------------------------- internals

    def _entry(self, seq_id: Hashable) -> _SequenceBlocks:
        entry = self._seqs.get(seq_id)
        if entry is None:
            raise BlockManagerError(f"sequence {seq_id!r} has no blocks")
        return entry

    def _release_out_of_window(self, entry: _SequenceBlocks, num_computed: int) -> None:
        table = entry.table
        for i in range(min(self.first_live_block(num_computed), len(table))):
            if table[i] != NO_BLOCK:
                self.pool.release(table[i])
                table[i] = NO_BLOCK


@dataclass
class HybridPrefixHit:
    """A prefix hit in both groups of a :class:`HybridBlockManager`: every block for the global
    layers, the window's blocks for the windowed ones (:data:`NO_BLOCK` before it)."""

    full: PrefixHit
    local: PrefixHit

    @property
    def num_tokens(self) -> int:
        return self.full.num_tokens


class HybridBlockManager:
    """Two block groups for a model whose layers are partly windowed: ``full`` (``num_blocks``, the
    global layers: every block kept) and ``local`` (``local_blocks``, the windowed layers: blocks out
    of the window released), with the :class:`BlockManager` interface the scheduler uses. An
    allocation happens in both or in neither; a prefix hit counts where both groups hold what the
    hit needs (all its blocks for the global layers, the last window's for the windowed ones)."""

    def __init__(
        self,
        num_blocks: int,
        local_blocks: int,
        block_size: int,
        sliding_window: int,
        *,
        enable_prefix_caching: bool = True,
        eviction: str = "lru",
    ) -> None:
        if sliding_window < 1:
            raise BlockManagerError(f"a hybrid block manager needs a sliding window, got {sliding_window}")
        kw = dict(enable_prefix_caching=enable_prefix_caching, eviction=eviction)
        self.full = BlockManager(num_blocks, block_size, **kw)
        self.local = BlockManager(local_blocks, block_size, sliding_window=sliding_window, **kw)
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching

    # -- queries ------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks + self.local.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the scarcer group, relative to what a sequence needs of it: the global
        group's count unless the windowed group has fewer."""
        return min(self.full.num_free_blocks, self.local.num_free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.full.num_used_blocks + self.local.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.full.num_cached_blocks

    @property
    def evictions(self) -> int:
        return self.full.evictions + self.local.evictions

    def has(self, seq_id: Hashable) -> bool:
        return self.full.has(seq_id)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.full.block_table(seq_id)

    def local_block_table(self, seq_id: Hashable) -> list[int]:
        return self.local.block_table(seq_id)

    def blocks_needed(self, num_tokens: int) -> int:
        return self.full.blocks_needed(num_tokens)

    def peak_blocks(self, num_tokens: int, chunk_tokens: int) -> tuple[int, int]:
        """(global, windowed) blocks one sequence holds at most."""
        return self.full.peak_blocks(num_tokens, chunk_tokens), self.local.peak_blocks(num_tokens, chunk_tokens)

    def get_cached_prefix(self, token_ids: Sequence[int]) -> HybridPrefixHit:
        full = self.full.get_cached_prefix(token_ids)
        bs = self.block_size
        for k in range(len(full.block_ids), 0, -1):
            lo = self.local.first_live_block(k * bs)
            window = [self.local.cached_block(h) for h in full.hashes[lo:k]]
            if all(b is not None for b in window):
                local = PrefixHit([NO_BLOCK] * lo + window, list(full.hashes[:k]), bs)  # type: ignore[operator]
                return HybridPrefixHit(PrefixHit(full.block_ids[:k], full.hashes[:k], bs), local)
        return HybridPrefixHit(PrefixHit([], [], bs), PrefixHit([], [], bs))

    # -- allocation ---------------------------------------------------------------------------------

    def allocate_slots(
        self, seq_id: Hashable, num_computed: int, num_new: int, prefix: HybridPrefixHit | None = None
    ) -> bool:
        fp, lp = (prefix.full, prefix.local) if prefix is not None else (None, None)
        if self.full.blocks_to_take(seq_id, num_computed, num_new, fp) > self.full.num_free_blocks:
            return False
        if self.local.blocks_to_take(seq_id, num_computed, num_new, lp) > self.local.num_free_blocks:
            return False
        ok = self.full.allocate_slots(seq_id, num_computed, num_new, fp)
        ok = self.local.allocate_slots(seq_id, num_computed, num_new, lp) and ok
        assert ok, "both groups had the blocks"
        return True

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        self.full.commit(seq_id, token_ids, num_computed)
        self.local.commit(seq_id, token_ids, num_computed)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        self.full.fork(parent_id, child_id)
        self.local.fork(parent_id, child_id)

    def free(self, seq_id: Hashable) -> None:
        self.full.free(seq_id)
        self.local.free(seq_id)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        self.full.truncate(seq_id, num_tokens)
        self.local.truncate(seq_id, num_tokens)

    def take_copies(self) -> list[tuple[int, int]]:
        return self.full.take_copies()

    def take_local_copies(self) -> list[tuple[int, int]]:
        return self.local.take_copies()

    def reset_prefix_cache(self) -> None:
        self.full.reset_prefix_cache()
        self.local.reset_prefix_cache()
