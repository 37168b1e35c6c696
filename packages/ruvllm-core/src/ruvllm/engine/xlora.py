"""X-LoRA in the engine: each X-LoRA sequence has a shadow (``Sequence.shadow_id``) that runs the
scaling pass over the same tokens into KV blocks of its own, ahead of the real pass.

The scheduler allocates, forks, preempts and frees a shadow together with its sequence; this module
holds what the engine adds: the shadow's share of the KV blocks a request needs, and the scaling pass
that turns the shadows' hidden states into the real pass's expert weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ruvllm.adapters import AdapterMix, XLoraAdapter
from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.block_manager import BlockManager, HybridBlockManager
from ruvllm.engine.batch import block_table
from ruvllm.errors import BackendError

if TYPE_CHECKING:
    from ruvllm.engine.scheduler import SchedulerOutput
    from ruvllm.runtime import LoadedModel


def with_shadow(needs: tuple[int, ...], adapter: Any) -> tuple[int, ...]:
    """The KV blocks (per pool) a request with ``adapter`` needs, given what its sequence needs:
    an X-LoRA request's shadow sequence takes as many again."""
    if isinstance(adapter, XLoraAdapter):
        return tuple(2 * n for n in needs)
    return needs


def scaling_pass(
    model: LoadedModel, cache: Any, bm: BlockManager | HybridBlockManager, part: SchedulerOutput
) -> dict[int, AdapterMix]:
    """X-LoRA's first pass: the shadow sequences of the X-LoRA chunks of ``part`` run the same
    tokens with the scaling pass's adapters (every expert weighted ``scaling_pass_value``) into
    their own blocks; the classifier turns their final hidden states into each token's expert
    weights. Returns chunk index (in ``part``) -> the real pass's :class:`AdapterMix` (empty, and
    nothing run, when ``part`` has no X-LoRA chunk). The pass carries the step's block copies."""
    rows = [i for i, c in enumerate(part.chunks) if c.seq.shadow_id is not None]
    if not rows:
        return {}
    hybrid = isinstance(bm, HybridBlockManager)
    chunks = []
    for i in rows:
        c = part.chunks[i]
        xl = c.seq.state.adapter
        chunks.append(
            SequenceChunk(
                token_ids=np.asarray(c.token_ids, dtype=np.int32),
                start_pos=c.start,
                block_table=block_table(bm.block_table(c.seq.shadow_id)),
                adapter=xl.scaling_pass(c.num_tokens),
                hidden_states=True,
                local_block_table=block_table(bm.local_block_table(c.seq.shadow_id)) if hybrid else None,
            )
        )
    batch = ForwardBatch(
        chunks=chunks,
        block_size=bm.block_size,
        block_copies=part.block_copies,
        local_block_copies=part.local_block_copies,
    )
    result = model.forward(batch, cache)
    mixes = {}
    for row, i in enumerate(rows):
        hidden = result.hidden_states.get(row)
        if hidden is None:
            raise BackendError("the backend returned no hidden states for an X-LoRA scaling pass")
        mixes[i] = part.chunks[i].seq.state.adapter.mix(np.asarray(hidden, np.float32))
    return mixes
