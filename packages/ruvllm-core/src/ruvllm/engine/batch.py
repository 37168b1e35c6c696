"""A scheduled step as the backend sees it: one :class:`ForwardBatch` of token chunks and block tables."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.block_manager import BlockManager, HybridBlockManager
from ruvllm.engine.scheduler import ScheduledChunk, SchedulerOutput


def block_table(ids: list[int]) -> np.ndarray:
    """A block table for the backend: blocks released out of a sliding window read as block 0
    (never unmasked)."""
    return np.maximum(np.asarray(ids, dtype=np.int32), 0)


def forward_batch(
    sched: SchedulerOutput,
    bm: BlockManager | HybridBlockManager,
    adapters: Mapping[int, Any],
    all_logits: Callable[[ScheduledChunk], bool],
    hidden_states: Callable[[ScheduledChunk], bool],
    *,
    tokens_pending: bool = False,
) -> ForwardBatch:
    """The batch of ``sched``'s chunks, each with its request's adapter unless ``adapters`` has one
    for its index (X-LoRA's mix); ``all_logits`` and ``hidden_states`` say which chunks return
    every position's logits and their hidden states. ``tokens_pending``: decoding chunks whose token
    is sampled later and given at launch (:class:`ruvllm.backend.PreparedStep`); their ids read 0 here."""
    hybrid = isinstance(bm, HybridBlockManager)
    chunks = [
        SequenceChunk(
            token_ids=np.zeros(1, np.int32) if tokens_pending else np.asarray(c.token_ids, dtype=np.int32),
            start_pos=c.start,
            block_table=block_table(bm.block_table(c.seq.seq_id)),
            adapter=adapters.get(i, c.seq.state.adapter),
            all_logits=all_logits(c),
            hidden_states=hidden_states(c),
            local_block_table=block_table(bm.local_block_table(c.seq.seq_id)) if hybrid else None,
            verify=bool(c.draft),
        )
        for i, c in enumerate(sched.chunks)
    ]
    return ForwardBatch(
        chunks=chunks,
        block_size=bm.block_size,
        block_copies=sched.block_copies,
        local_block_copies=sched.local_block_copies,
    )
