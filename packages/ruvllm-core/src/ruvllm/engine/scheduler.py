"""Which sequences run in the next forward step, and on how many of their tokens.

Every step has a token budget (``max_num_batched_tokens``). Running sequences go first, oldest
first: a decoding sequence needs one token, one still prefilling gets the rest of its prompt or as
much as the budget allows (chunked prefill); prompt tokens may have a tighter budget of their own
(``prefill_budget``: the engine sizes it so a step stays within its latency target). Then waiting
sequences are admitted in policy order while the budgets, the free blocks and ``max_num_seqs``
allow. When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed and it waits to be recomputed (its prompt and output so far,
largely from the prefix cache). Nobody fails for lack of blocks; a request that could never fit is
refused when it is added. An X-LoRA request's sequence has a shadow (its scaling pass,
``Sequence.shadow_id``) that takes blocks of its own for the same positions: the two are allocated,
preempted, forked and freed together.

The scheduler speaks block ids and token ids only; it never touches tensors.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ruvllm.block_manager import BlockManager, HybridBlockManager, HybridPrefixHit, PrefixHit
from ruvllm.engine.config import SCHEDULING_POLICIES, EngineConfigError
from ruvllm.engine.sequence import Sequence


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int
    #: Positions the chunk computes (a speculative draft's included).
    num_tokens: int
    #: Draft tokens run after the sequence's last token, to be verified (speculative decoding).
    draft: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        own = self.num_tokens - len(self.draft)
        return self.seq.token_ids[self.start : self.start + own] + self.draft

    @property
    def completes(self) -> bool:
        """This chunk reaches the sequence's last token, so its logits yield the next token."""
        return self.start + self.num_tokens - len(self.draft) == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    #: The windowed layers' pool's copies (a hybrid KV cache).
    local_block_copies: list[tuple[int, int]] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager | HybridBlockManager,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        policy: str = "fcfs",
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise EngineConfigError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        #: Sorted by :meth:`key`, first to be admitted first.
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.prefix_cache_hit_tokens = 0
        self.prefix_cache_queried_tokens = 0

    def key(self, seq: Sequence) -> tuple[int, ...]:
        """Scheduling order: smaller runs first and is preempted last."""
        if self.policy == "priority":
            return (seq.state.request.priority, seq.state.order, seq.index)
        return (seq.state.order, seq.index)

    # ----------------------------------------------------------------------------- membership

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=self.key)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run ``child`` on ``parent``'s blocks (shared until one of them writes into one)."""
        self.block_manager.fork(parent.seq_id, child.seq_id)
        if parent.shadow_id is not None:
            self.block_manager.fork(parent.shadow_id, child.shadow_id)
        child.num_computed = parent.num_computed
        child.num_cached_tokens = parent.num_cached_tokens
        self.running.append(child)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out (finished or aborted) and free its blocks at once."""
        self._free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # ------------------------------------------------------------------------------- schedule

    def schedule(self, prefill_budget: int | None = None) -> SchedulerOutput:
        """The next step. ``prefill_budget``: most prompt tokens (chunks of more than one token) it
        may carry; None: only ``max_num_batched_tokens`` bounds them."""
        out = SchedulerOutput()
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        prompt_left = budget if prefill_budget is None else max(0, prefill_budget)
        if self.policy == "priority":
            self._make_room_for_more_important()
        self.running.sort(key=self.key)

        # Running sequences, oldest first; victims of preemption come from the newest end, which
        # has not been scheduled yet in this loop.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = len(seq.token_ids) - seq.num_computed
            if remaining > 1 and prompt_left <= 0:  # its prompt goes on next step
                i += 1
                continue
            draft = seq.draft[: budget - 1] if remaining == 1 else []
            if draft and self.allocate(seq, seq.num_computed, 1 + len(draft)):
                # A draft runs only where its blocks are free: it never preempts anyone.
                out.chunks.append(ScheduledChunk(seq, seq.num_computed, 1 + len(draft), list(draft)))
                budget -= 1 + len(draft)
                i += 1
                continue
            num_new = min(remaining, budget, prompt_left) if remaining > 1 else 1
            while not self.allocate(seq, seq.num_computed, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.chunks.append(ScheduledChunk(seq, seq.num_computed, num_new))
                budget -= num_new
                if remaining > 1:
                    prompt_left -= num_new
                i += 1

        # Waiting sequences; none while the running ones are short of blocks.
        # An n > 1 request's choices fork off its prompt once it is computed: their seats are kept.
        taken = sum(self._seats(q) for q in self.running)
        while not out.preempted and self.waiting and budget > 0:
            seq = self.waiting[0]
            if taken + self._seats(seq) > self.max_num_seqs:
                break
            hit = bm.get_cached_prefix(seq.token_ids) if seq.reuses_prefix else None
            computed = hit.num_tokens if hit is not None else 0
            remaining = len(seq.token_ids) - computed
            if remaining > 1 and prompt_left <= 0:
                break
            num_new = min(remaining, budget, prompt_left) if remaining > 1 else 1
            if not self.allocate(seq, computed, num_new, hit):
                self._free(seq)  # a shadow that got its blocks gives them back
                break
            self.waiting.pop(0)
            seq.num_computed = computed
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = computed
            self.prefix_cache_queried_tokens += len(seq.token_ids)
            self.prefix_cache_hit_tokens += computed
            self.running.append(seq)
            taken += self._seats(seq)
            out.admitted.append(seq)
            out.chunks.append(ScheduledChunk(seq, computed, num_new))
            budget -= num_new
            if remaining > 1:
                prompt_left -= num_new

        out.block_copies = bm.take_copies()
        if isinstance(bm, HybridBlockManager):
            out.local_block_copies = bm.take_local_copies()
        return out

    def update_after_forward(self, out: SchedulerOutput) -> None:
        """Record the keys/values the step computed and publish newly full blocks to the cache (a
        draft's positions count once verified: :meth:`accept_draft`)."""
        for chunk in out.chunks:
            seq = chunk.seq
            seq.num_computed = chunk.start + chunk.num_tokens - len(chunk.draft)
            if seq.cacheable:
                self.block_manager.commit(seq.seq_id, seq.token_ids, seq.num_computed)

    def accept_draft(self, seq: Sequence, accepted: int) -> None:
        """``accepted`` tokens of ``seq``'s verified draft were kept: their keys/values count as
        computed, and the blocks past them (the refused positions') go back, so the cache holds what
        it would without speculation."""
        seq.num_computed += accepted
        if seq.cacheable:
            self.block_manager.commit(seq.seq_id, seq.token_ids, seq.num_computed)
        self.block_manager.truncate(seq.seq_id, seq.num_computed)

    # ------------------------------------------------------------------------------ internals

    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Seats ``seq`` holds: its request's ``n`` until its choices have forked off, then one."""
        return 1 if seq.state.forked else seq.state.sampling.n

    def recompute(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it to run again from its first token (its adapter changed;
        not counted as a preemption, which is for want of blocks)."""
        if seq in self.running:
            self._requeue(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        self.preemptions += 1

    def allocate(
        self, seq: Sequence, computed: int, num_new: int, hit: PrefixHit | HybridPrefixHit | None = None
    ) -> bool:
        """:meth:`BlockManager.allocate_slots` for ``seq`` and its shadow (first; the shadow never
        reuses cached blocks)."""
        bm = self.block_manager
        if seq.shadow_id is not None and not bm.allocate_slots(seq.shadow_id, computed, num_new):
            return False
        return bm.allocate_slots(seq.seq_id, computed, num_new, hit)

    def _free(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        if seq.shadow_id is not None:
            self.block_manager.free(seq.shadow_id)

    def _requeue(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        self.add(seq)

    def _make_room_for_more_important(self) -> None:
        """Priority policy: preempt less important running sequences while the most important
        waiting one cannot be admitted for lack of a seat or of blocks for its first chunk."""
        bm = self.block_manager
        while self.waiting and self.running:
            head = self.waiting[0]
            worst = max(self.running, key=self.key)
            if self.key(worst) <= self.key(head):
                return
            first_chunk = min(len(head.token_ids), self.max_num_batched_tokens)
            need = bm.blocks_needed(first_chunk) * (1 if head.shadow_id is None else 2)
            if len(self.running) < self.max_num_seqs and bm.num_free_blocks >= need:
                return
            self._preempt(worst)
