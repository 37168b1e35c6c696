"""The two-tier KV cache's float slots (issue 14): every block's keys and values are stored as int8
codes, and the recent blocks of each sequence also in float, in a small pool of slots
(:attr:`ruvllm_jax.kv_state.KVState.hot_k`). Attention reads a recent block through its slot and every
older one through its codes, so a sequence keeps its last ``recent`` full blocks and the block being
filled at full precision while the cache holds every block at int8's size.

The engine knows sequences; the backend sees only block tables. So :class:`HotSlots` keys slots by
block id and keeps one invariant: a block that holds a slot has there the float values of every
position written in its current use. A block gets a slot only when a step writes its first position
(a fresh block), every later write to it goes to the slot as well, and copy-on-write copies the slot
with the block (or takes the destination's away). A block that falls out of every sequence's recent
range gives its slot back; when none is free, the least recently needed slot goes to the fresh
block. A recent block without a slot (a prefix hit on a block whose slot went, a destination copied
from a block without one) is read from its codes: a little less precise, never wrong.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np


class HotSlots:
    """Which blocks of one pool have a float slot, and which slot (host bookkeeping)."""

    def __init__(self, slots: int, recent: int, block_size: int) -> None:
        self.slots = slots
        self.recent = recent
        self.block_size = block_size
        self._slot: OrderedDict[int, int] = OrderedDict()  # block -> slot, least recently needed first
        self._free = list(range(slots - 1, -1, -1))

    @property
    def assigned(self) -> dict[int, int]:
        return dict(self._slot)

    def recent_range(self, end_pos: int) -> range:
        """Indices of a sequence's recent blocks when it has ``end_pos`` tokens: the one being filled
        and the ``recent`` full blocks behind it."""
        last = (end_pos - 1) // self.block_size
        return range(max(0, last - self.recent), last + 1)

    def plan(self, chunks: Iterable[tuple[Sequence[int], int, int]]) -> dict[int, int]:
        """Slots for one forward pass over ``chunks`` (each its block table, start and end position):
        blocks that left every chunk's recent range give theirs back, recent blocks written from
        their first position here take one. Returns block -> slot for the pass."""
        bs = self.block_size
        needed: dict[int, None] = {}
        fresh: list[int] = []
        aged: list[int] = []
        for table, start, end in chunks:
            recent = self.recent_range(end)
            for i in recent:
                b = int(table[i])
                needed[b] = None
                if i * bs >= start:
                    fresh.append(b)
            before = self.recent_range(start).start if start > 0 else 0
            aged.extend(int(table[i]) for i in range(before, recent.start))
        for b in aged:
            if b not in needed and b in self._slot:
                self._free.append(self._slot.pop(b))
        for b in needed:
            if b in self._slot:
                self._slot.move_to_end(b)
        for b in fresh:
            if b not in self._slot:
                slot = self._take(needed)
                if slot is not None:
                    self._slot[b] = slot
        return self._slot

    def copy(self, src: int, dst: int) -> tuple[int, int] | None:
        """Copy-on-write of block ``src`` into ``dst``: the (source slot, destination slot) to copy,
        or None when ``src`` has no slot (``dst`` then holds none either)."""
        s = self._slot.get(src)
        if s is None:
            if dst in self._slot:
                self._free.append(self._slot.pop(dst))
            return None
        d = self._slot.get(dst)
        if d is None:
            d = self._take({src: None})
            if d is None:
                return None
            self._slot[dst] = d
        return s, d

    def _take(self, keep: dict[int, None]) -> int | None:
        if self._free:
            return self._free.pop()
        for b in self._slot:  # least recently needed first
            if b not in keep:
                return self._slot.pop(b)
        return None


def hot_inputs(
    hot: HotSlots,
    tables: Sequence[np.ndarray],
    starts: Sequence[int],
    ends: Sequence[int],
    token_rows: Sequence[int],
    groups: Sequence[tuple[Sequence[int], int]],
    num_tokens: int,
    width: int,
    plan_only: bool = False,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The step's slot arrays for one pool: each token's write slot (``hot.slots``: none) and, per
    group of rows (``(chunk indices, rows)``: decode, prefill), each table entry's slot to read (-1:
    the codes; only recent blocks are read from slots). ``plan_only``: no slots (precompiling)."""
    bs = hot.block_size
    slot_of = {} if plan_only else hot.plan(zip(tables, starts, ends, strict=True))
    write = np.full(num_tokens, hot.slots, np.int32)
    for table, start, end, row in zip(tables, starts, ends, token_rows, strict=True):
        blocks = np.asarray(table)[np.arange(start, end) // bs]
        write[row : row + end - start] = [slot_of.get(int(b), hot.slots) for b in blocks]
    out = []
    for idx, rows in groups:
        read = np.full((rows, width), -1, np.int32)
        for r, i in enumerate(idx):
            for j in hot.recent_range(ends[i]):
                read[r, j] = slot_of.get(int(tables[i][j]), -1)
        out.append(read)
    return write, out
