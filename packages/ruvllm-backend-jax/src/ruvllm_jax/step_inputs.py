"""Step inputs: the padded int32 arrays (:class:`ruvllm_jax.model.StepInputs`) and the static plan
(:class:`ruvllm_jax.model.StepPlan`) of one forward pass over a part of a core
:class:`~ruvllm.backend.ForwardBatch` (one part of :func:`ruvllm_jax.step_shapes.partition`).

NumPy only, nothing compiled: the runner hands the result to the compiled step for its plan.
Layout: real tokens first (decoding ones, then each prompt chunk's), padding after, so the native
kernels skip the padding rows (``live_tokens``). Padding entries point past the end (the token count,
the block count), so the step's scatters drop them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ruvllm.backend import NO_BLOCK, SequenceChunk
from ruvllm.errors import RequestError
from ruvllm_jax.model import LoraFactors, LoraPlan, ModelSpec, StepInputs, StepPlan, bucket, gathers_lora
from ruvllm_jax.step_shapes import runs_native, shape_of
from ruvllm_jax.two_tier import HotSlots, hot_inputs

#: ``(chunks, lens, num_tokens, starts, gathered) -> (plan, each token's slot, factors, each token's
#: weights)``: the adapters of a step (see :func:`ruvllm_jax.lora.plan_adapters`; ``gathered``: the
#: step applies them through the native kernel); all None for a step without adapters.
AdapterPlanner = Callable[
    [Sequence[SequenceChunk], list[int], int, np.ndarray, bool],
    tuple[LoraPlan | None, np.ndarray | None, LoraFactors | None, np.ndarray | None],
]


@dataclass
class StepRows:
    """Where each chunk's results sit in the step's outputs: its last position's logits row
    (``last``), and for chunks that asked, every position's logits rows and hidden-state rows."""

    last: np.ndarray
    all_logits: dict[int, slice] = field(default_factory=dict)
    hidden: dict[int, slice] = field(default_factory=dict)


def step_inputs(
    chunks: Sequence[SequenceChunk],
    *,
    block_size: int,
    num_blocks: int,
    local_blocks: int = 0,
    table_tokens: int = 1,
    attention: str = "reference",
    native: bool = False,
    native_attention: bool = False,
    quantization: str = "none",
    unroll_layers: bool = False,
    adapters: AdapterPlanner | None = None,
    hot: HotSlots | None = None,
    local_hot: HotSlots | None = None,
    plan_only: bool = False,
    step_tokens: int | None = None,
) -> tuple[StepInputs, StepPlan, StepRows, LoraFactors | None]:
    """Inputs, plan, result rows and adapter factors of one forward pass over ``chunks`` on a cache of
    ``num_blocks`` blocks of ``block_size`` (``local_blocks``: a hybrid cache's windowed pool; ``hot``,
    ``local_hot``: a two-tier cache's float slots, whose bookkeeping this advances unless
    ``plan_only``). Block tables are ``table_tokens`` wide at least. ``native``: the model's native
    kernels are loaded (whether this step runs them follows from its size and ``quantization``);
    ``native_attention``: every step attends through them.
    ``adapters``: plans the step's adapters (None: the chunks' adapters are not looked at).
    ``step_tokens``: every step padded to that many tokens, and its logit rows to as many (twice as many
    when a chunk asks for every position's): option ``batch_invariant`` on XLA's path."""
    bs, nb = block_size, num_blocks
    lens = [len(c.token_ids) for c in chunks]
    # A verification chunk's positions run as decoding rows (the numbers a token-at-a-time run gets);
    # not on a two-tier cache, whose slots are kept per chunk (the engine does not verify there).
    rows_of = [as_decode_rows(c, hot) for c in chunks]
    decode = [i for i, n in enumerate(lens) if n == 1 or rows_of[i]]
    prefill = [i for i, n in enumerate(lens) if n > 1 and not rows_of[i]]
    decode_rows = [(i, j) for i in decode for j in range(lens[i])]
    shape = shape_of([1] * len(decode_rows) + [lens[i] for i in prefill], step_tokens)
    sd, sp, qb, t = shape.decode_seqs, shape.prefill_seqs, shape.prefill_len, shape.num_tokens
    starts = np.zeros(len(chunks), np.int64)
    nxt = 0
    for i in decode:
        starts[i] = nxt
        nxt += lens[i]
    for i in prefill:
        starts[i] = nxt
        nxt += lens[i]
    native_step = runs_native(native, quantization, t)
    if adapters is None:
        lora_plan, lora_slot, lora, lora_weight = None, None, None, None
    else:
        gathered = gathers_lora(native_step, t)
        lora_plan, lora_slot, lora, lora_weight = adapters(chunks, lens, t, starts, gathered)
    tokens = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    write_block = np.full(t, nb, np.int32)
    write_offset = np.zeros(t, np.int32)
    hybrid = local_blocks > 0
    local_write = np.full(t, local_blocks, np.int32) if hybrid else None
    for c, s0, n in zip(chunks, starts, lens, strict=True):
        pos = c.start_pos + np.arange(n)
        tokens[s0 : s0 + n] = c.token_ids
        positions[s0 : s0 + n] = pos
        write_block[s0 : s0 + n] = np.asarray(c.block_table)[pos // bs]
        write_offset[s0 : s0 + n] = pos % bs
        if hybrid:
            local_write[s0 : s0 + n] = np.asarray(c.local_block_table)[pos // bs]

    # One table width for every step: the longest sequence served (attention loops over the key
    # chunks the contexts reach, so the width costs nothing).
    width = max(-(-table_tokens // bs), bucket(max(-(-c.end_pos // bs) for c in chunks)))

    def tables(idx: list[int], rows: int, local: bool = False) -> np.ndarray:
        out = np.zeros((rows, width), np.int32)
        for row, i in enumerate(idx):
            need = -(-chunks[i].end_pos // bs)
            out[row, :need] = (chunks[i].local_block_table if local else chunks[i].block_table)[:need]
        # Blocks released behind a window: any real block, never read (attention starts at the window).
        return np.where(out == NO_BLOCK, 0, out) if local else out

    decode_token = np.full(sd, t, np.int32)
    decode_context = np.zeros(sd, np.int32)
    for row, (i, j) in enumerate(decode_rows):
        decode_token[row] = starts[i] + j
        decode_context[row] = chunks[i].start_pos + j + 1
    prefill_token = np.full((sp, qb), t, np.int32)
    prefill_start = np.zeros(sp, np.int32)
    prefill_context = np.zeros(sp, np.int32)
    for row, i in enumerate(prefill):
        prefill_token[row, : lens[i]] = starts[i] + np.arange(lens[i])
        prefill_start[row] = chunks[i].start_pos
        prefill_context[row] = chunks[i].end_pos

    logit_rows = [int(starts[i]) + lens[i] - 1 for i in range(len(chunks))]
    rows = StepRows(last=np.arange(len(chunks)))
    for i, c in enumerate(chunks):
        if c.all_logits:
            rows.all_logits[i] = slice(len(logit_rows), len(logit_rows) + lens[i])
            logit_rows.extend(range(int(starts[i]), int(starts[i]) + lens[i]))
        if c.hidden_states:
            rows.hidden[i] = slice(int(starts[i]), int(starts[i]) + lens[i])
    # A step that returns every position's logits returns as many rows as the shape can need (one
    # per chunk and one per token): one such variant per shape, which precompile can compile.
    if step_tokens is not None:  # the LM head's rows fixed too: 2 counts, whatever the batch
        g = 2 * t if any(c.all_logits for c in chunks) else t
    else:
        g = sd + sp if len(logit_rows) <= sd + sp else sd + sp + t
    logit_idx = np.zeros(g, np.int32)
    logit_idx[: len(logit_rows)] = logit_rows

    plan = StepPlan(
        num_tokens=t,
        decode_seqs=sd,
        decode_blocks=width,
        prefill_seqs=sp,
        prefill_len=qb,
        prefill_blocks=width,
        logit_rows=g,
        return_hidden=bool(rows.hidden),
        attention=attention,
        lora=lora_plan,
        native=native_step,
        native_attention=native_attention,
        unroll_layers=unroll_layers,
    )
    inputs = StepInputs(
        tokens=tokens,
        positions=positions,
        write_block=write_block,
        write_offset=write_offset,
        decode_token=decode_token,
        decode_tables=tables([i for i, _ in decode_rows], sd),
        decode_context=decode_context,
        prefill_token=prefill_token,
        prefill_tables=tables(prefill, sp),
        prefill_start=prefill_start,
        prefill_context=prefill_context,
        logit_rows=logit_idx,
        lora_slot=lora_slot,
        lora_weight=lora_weight,
        live_tokens=np.int32(sum(lens)),
        live_logits=np.int32(len(logit_rows)),
        local_write_block=local_write,
        decode_local_tables=tables([i for i, _ in decode_rows], sd, local=True) if hybrid else None,
        prefill_local_tables=tables(prefill, sp, local=True) if hybrid else None,
    )
    if hot is not None:  # two tiers: which blocks each token writes and each row reads in float
        pools = [("", hot, [c.block_table for c in chunks])]
        if hybrid:
            pools.append(("local_", local_hot, [c.local_block_table for c in chunks]))
        slots_in = {}
        for prefix, slots, pool_tables in pools:
            write, (dec, pre) = hot_inputs(
                slots,
                pool_tables,
                [c.start_pos for c in chunks],
                [c.end_pos for c in chunks],
                [int(x) for x in starts],
                [(decode, sd), (prefill, sp)],
                t,
                width,
                plan_only,
            )
            slots_in |= {
                f"{prefix}hot_write": write,
                f"decode_{prefix}hot_tables": dec,
                f"prefill_{prefix}hot_tables": pre,
            }
        inputs = dataclasses.replace(inputs, **slots_in)
    return inputs, plan, rows, lora


def as_decode_rows(chunk: SequenceChunk, hot: HotSlots | None) -> bool:
    """Whether ``chunk``'s positions run as decoding rows: a verification chunk (see
    :attr:`ruvllm.backend.SequenceChunk.verify`) on a cache without float slots."""
    return chunk.verify and hot is None


def check_chunks(
    chunks: Sequence[SequenceChunk], block_size: int, num_blocks: int, local_blocks: int, spec: ModelSpec
) -> None:
    """Refuse (:class:`RequestError`) chunks a step of ``spec`` on a cache of ``num_blocks`` blocks of
    ``block_size`` (``local_blocks``: a hybrid cache's windowed pool) cannot run: no tokens, token ids
    outside the vocabulary, block tables too short or naming blocks the cache lacks."""
    bs, nb, vocab = block_size, num_blocks, spec.vocab_size
    for i, c in enumerate(chunks):
        if len(c.token_ids) == 0:
            raise RequestError(f"chunk {i} has no tokens")
        if c.start_pos < 0:
            raise RequestError(f"chunk {i}: start_pos {c.start_pos} is negative")
        need = -(-c.end_pos // bs)
        if len(c.block_table) < need:
            raise RequestError(f"chunk {i}: {len(c.block_table)} blocks cannot hold positions up to {c.end_pos}")
        table = np.asarray(c.block_table[:need])
        if table.size and (table.min() < 0 or table.max() >= nb):
            raise RequestError(f"chunk {i}: block table refers to blocks outside 0..{nb - 1}")
        if local_blocks:
            if c.local_block_table is None or len(c.local_block_table) < need:
                raise RequestError(f"chunk {i}: a hybrid cache needs a local_block_table up to position {c.end_pos}")
            local = np.asarray(c.local_block_table[:need])
            live = local[local != NO_BLOCK]
            if live.size and (live.min() < 0 or live.max() >= local_blocks):
                raise RequestError(f"chunk {i}: local block table refers to blocks outside 0..{local_blocks - 1}")
            # The chunk writes its tokens' keys there, and its first query reads its window.
            lo = max(0, c.start_pos - max(spec.layer_windows) + 1) // bs
            if (local[lo:] == NO_BLOCK).any():
                raise RequestError(f"chunk {i}: local block table has no block in the window it reads")
        ids = np.asarray(c.token_ids)
        if ids.min() < 0 or ids.max() >= vocab:
            raise RequestError(f"chunk {i}: token ids must be in 0..{vocab - 1}")
