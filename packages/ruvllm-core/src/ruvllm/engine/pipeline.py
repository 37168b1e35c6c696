"""The pipelined decode step (``EngineConfig.pipeline_decode``): step N+1 is launched before step N's
outputs are made.

A backend whose steps run asynchronously (:class:`ruvllm.backend.PreparesSteps`: jax dispatches a
step and returns) lets the engine plan step N+1 while step N runs: the same sequences one position
on, their blocks allocated, the backend's inputs built with the tokens left blank. Once step N's
logits are read they are sampled, step N+1 is launched with those tokens, and only then are step
N's tokens appended, detokenized, checked for stop strings and turned into outputs (and streamed by
the server), all while step N+1 runs. Outputs are the same as without it: sampling still reads step
N's logits before step N+1 starts, so penalties, seeds and grammars see every earlier token; a
sequence that finishes on step N's token by eos, a stop string or its grammar still has a row in step
N+1 (row results do not depend on their neighbours), which is dropped; one that reaches
``max_tokens`` or the context's end is left out when the step is planned.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from ruvllm.block_manager import HybridBlockManager
from ruvllm.engine.scheduler import ScheduledChunk, SchedulerOutput
from ruvllm.engine.step_executor import InFlight

if TYPE_CHECKING:
    from ruvllm.engine.llm_engine import LLMEngine
    from ruvllm.engine.types import RequestOutput


class DecodePipeline:
    """The launched step of ``engine`` (at most one) and the planning of the step after it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        #: The step launched and not collected yet.
        self.flight: InFlight | None = None
        #: Steps launched while the step before them ran (``EngineStats.pipelined_steps``).
        self.steps = 0
        #: Block copies a planning took that no launched step carried (the full pool's, the windowed
        #: pool's): they go with the next scheduled step.
        self._owed: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])

    def pay_owed_copies(self, sched: SchedulerOutput) -> None:
        """Put the copies a planning owed in front of ``sched``'s own."""
        owed, owed_local = self._owed
        if owed or owed_local:
            sched.block_copies[:0], sched.local_block_copies[:0] = owed, owed_local
            self._owed = ([], [])

    def eligible(self, sched: SchedulerOutput) -> bool:
        """Whether ``sched`` may run launched, with its next step planned while it runs: every chunk
        decodes one token of a plain request sampled on the host (no draft, fork, adapter, router or
        X-LoRA shadow), no block is copied, and the chunks are every running sequence."""
        e = self.engine
        if (
            not e.config.pipeline_decode
            or e.speculator is not None
            or e.device_sampling
            or sched.block_copies
            or sched.local_block_copies
            or len(sched.chunks) != len(e.scheduler.running)
        ):
            return False
        for c in sched.chunks:
            seq, st = c.seq, c.seq.state
            if (
                c.num_tokens != 1
                or c.draft
                or not c.completes
                or seq.shadow_id is not None
                or st.adapter is not None
                or st.sampling.n != 1
                or e.router.wants(c)
            ):
                return False
        return True

    def launch(self, sched: SchedulerOutput) -> bool:
        """Launch ``sched`` (scheduled as usual, its tokens known) where it is :meth:`eligible` and the
        backend prepares it; then :meth:`advance` collects it."""
        if not self.eligible(sched):
            return False
        executor = self.engine.executor
        prepared = executor.prepare(sched)
        if prepared is None:
            return False
        tokens = np.fromiter((c.seq.token_ids[c.start] for c in sched.chunks), np.int32, len(sched.chunks))
        self.flight = executor.launch(sched, prepared, tokens)
        return self.flight is not None

    def live(self, c: ScheduledChunk) -> bool:
        """``c`` (a launched decoding chunk) is still wanted: its request runs, its sequence has not
        finished, and neither its tokens nor its cache moved since the chunk was planned."""
        seq = c.seq
        return (
            not seq.finished
            and seq.state.request.request_id in self.engine._requests
            and seq.num_computed == c.start
            and len(seq.token_ids) == c.start + 1
        )

    def plan_next(self, live: list[ScheduledChunk]) -> SchedulerOutput | None:
        """The step after the launched one whose :meth:`live` chunks are ``live`` (their tokens not
        sampled yet): their sequences one position on, their blocks allocated; those that finish on
        this token (``max_tokens``, the model's length) are left out. None when the next step must be
        scheduled as usual: requests wait, a sequence needs a block none is free for, or the chunks are
        not every running sequence."""
        e = self.engine
        if e.scheduler.waiting or len(live) != len(e.scheduler.running):
            return None
        nxt = SchedulerOutput()
        for c in live:
            seq = c.seq
            p, length = seq.state.sampling, len(seq.token_ids) + 1
            if length - seq.num_prompt_tokens >= p.max_tokens or length >= e.max_model_len:
                continue
            if not e.scheduler.allocate(seq, c.start + 1, 1):
                return None  # (what was allocated stays: the scheduler allocates the same slots next)
            nxt.chunks.append(ScheduledChunk(seq, c.start + 1, 1))
        bm = e.block_manager
        copies = bm.take_copies()
        local = bm.take_local_copies() if isinstance(bm, HybridBlockManager) else []
        if copies or local:  # (sequences that share their last block fork: none of those pipeline)
            self._owed = (self._owed[0] + copies, self._owed[1] + local)
            return None
        return nxt if nxt.chunks else None

    def advance(self) -> list[RequestOutput]:
        """Collect the launched step, sample its tokens, launch the step after it with them (planned
        and prepared while this one ran) and only then append the tokens and build the outputs."""
        e, flight, self.flight = self.engine, self.flight, None
        assert flight is not None
        live = [i for i, c in enumerate(flight.sched.chunks) if self.live(c)]
        nxt = self.plan_next([flight.sched.chunks[i] for i in live])
        prepared = e.executor.prepare(nxt) if nxt is not None else None
        ran = e.executor.collect(flight, live)
        if e.broken is not None:
            return []
        if e.step_budget is not None and len(ran) == len(live):  # what the step took, launch to logits
            e.step_budget.observe(len(flight.sched.chunks), 0, 1000 * (time.perf_counter() - flight.started))
        drawn = e._draw(ran)
        if nxt is not None and prepared is not None:
            picks = {id(targets[0]): p[0] for _, targets, p in drawn if targets}
            tokens = np.fromiter(
                (getattr(picks.get(id(c.seq)), "token_id", 0) for c in nxt.chunks), np.int32, len(nxt.chunks)
            )
            self.flight = e.executor.launch(nxt, prepared, tokens)
            if self.flight is not None:
                self.steps += 1
        e.scheduler.update_after_forward(SchedulerOutput(chunks=[c for c, _ in ran]))
        now = time.monotonic()
        return e._emit(e._commit(drawn), now)
