"""The pool of KV blocks: reference counts, the free queue and the prefix cache's hash map.

A block is in exactly one of three states: referenced by at least one sequence, free (unreferenced,
holding nothing worth keeping), or evictable (unreferenced but cached under the hash of its tokens,
so a later prompt with the same start may take it again). Free blocks are handed out first; when
there are none, the evictable block the eviction policy ranks first is uncached and handed out.

The pool knows block ids and hashes only; which sequence holds which block, windows and
copy-on-write are the block manager's policy (:mod:`ruvllm.block_manager`).
"""

from __future__ import annotations

import heapq
from collections import deque

from ruvllm.errors import RuvllmError

EVICTION_POLICIES = ("lru", "lfu", "fifo")


class BlockManagerError(RuvllmError):
    """The block manager was asked for something inconsistent (unknown sequence, bad sizes)."""


class BlockPool:
    """``num_blocks`` KV blocks with reference counts; unreferenced cached blocks are evicted by
    ``eviction`` (``lru``: least recently released first, ``lfu``: fewest prefix hits, then least
    recently released, ``fifo``: first cached first)."""

    def __init__(self, num_blocks: int, eviction: str = "lru") -> None:
        if num_blocks < 1:
            raise BlockManagerError(f"num_blocks must be at least 1, got {num_blocks}")
        if eviction not in EVICTION_POLICIES:
            raise BlockManagerError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {eviction!r}")
        self.num_blocks = num_blocks
        self.eviction = eviction
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._last_used = [0] * num_blocks
        self._hits = [0] * num_blocks
        self._cached_at = [0] * num_blocks
        self._clock = 0
        #: Unreferenced blocks holding nothing worth keeping: handed out first.
        self._free: deque[int] = deque(range(num_blocks))
        #: Unreferenced cached blocks, evicted by policy; heap entries go stale when a block is taken.
        self._evictable: dict[int, int] = {}  # block id -> version of its live heap entry
        self._heap: list[tuple[tuple[int, ...], int, int]] = []  # (policy key, version, block id)
        self._version = 0
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        #: Cached blocks evicted to be handed out again.
        self.evictions = 0

    # ----------------------------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty ones plus unreferenced cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block cached under ``block_hash``, if any."""
        return self._cached.get(block_hash)

    def must_copy(self, block: int) -> bool:
        """Whether writing into ``block`` needs a copy first: someone else references it, or it is
        registered in the cache (its contents must stay what its hash says)."""
        return self._ref[block] > 1 or self._hash[block] is not None

    # ---------------------------------------------------------------------------------- changes

    def allocate(self) -> int:
        """A block with one reference: a free one, else an evicted one. The caller checks
        :attr:`num_free_blocks` first."""
        if self._free:
            block = self._free.popleft()
        else:
            block = self._evict()
        self._ref[block] = 1
        return block

    def take(self, block: int, hit: bool = False) -> None:
        """One more reference to ``block`` (out of the evictable ones if it was unreferenced);
        ``hit``: a prefix-cache hit, which ``lfu`` counts."""
        if self._ref[block] == 0:
            self._evictable.pop(block, None)
        self._ref[block] += 1
        if hit:
            self._hits[block] += 1

    def release(self, block: int) -> None:
        """One reference fewer; a block nobody references becomes free, or evictable if cached."""
        self._ref[block] -= 1
        if self._ref[block] > 0:
            return
        self._clock += 1
        self._last_used[block] = self._clock
        if self._hash[block] is None:
            self._free.append(block)
            return
        self._version += 1
        self._evictable[block] = self._version
        heapq.heappush(self._heap, (self._eviction_key(block), self._version, block))
        if len(self._heap) > 2 * len(self._evictable) + 64:
            # Taking a cached block leaves its heap entry behind; rebuild before they pile up.
            self._heap = [e for e in self._heap if self._evictable.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register ``block`` under ``block_hash``, unless an identical block is cached already (the
        first is kept) or ``block`` is cached under another hash (it is shared)."""
        if block_hash in self._cached or self._hash[block] is not None:
            return
        self._hash[block] = block_hash
        self._cached[block_hash] = block
        self._clock += 1
        self._cached_at[block] = self._clock
        self._hits[block] = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that nobody references."""
        for b in list(self._evictable):
            del self._evictable[b]
            self._uncache(b)
            self._free.append(b)
        self._heap.clear()

    # -------------------------------------------------------------------------------- internals

    def _eviction_key(self, block: int) -> tuple[int, ...]:
        if self.eviction == "lru":
            return (self._last_used[block],)
        if self.eviction == "lfu":
            return (self._hits[block], self._last_used[block])
        return (self._cached_at[block],)

    def _evict(self) -> int:
        while self._heap:
            _, version, block = heapq.heappop(self._heap)
            if self._evictable.get(block) == version:
                del self._evictable[block]
                self._uncache(block)
                self.evictions += 1
                return block
        raise BlockManagerError("no free KV block (the caller must check free blocks first)")

    def _uncache(self, block: int) -> None:
        h = self._hash[block]
        if h is not None and self._cached.get(h) == block:
            del self._cached[h]
        self._hash[block] = None
