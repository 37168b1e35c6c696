"""Step shapes: the policy that pads every batch to one of a small bounded set of compiled shapes, so
a server compiles all of them before traffic (:meth:`ruvllm_jax.runner.JaxModel.precompile`) and
never while serving:

- block tables are as wide as the longest sequence served; attention loops over the key chunks the
  step's contexts reach (:mod:`ruvllm_jax.attention`), so context length is not part of the shape;
- steps with only decoding sequences pad their count to a power of two;
- a step with prompt chunks runs them as one group of 1 chunk (its length padded to a power of two,
  at least :data:`MIN_PREFILL_LEN`) or of :data:`SHORT_GROUP` chunks of at most :data:`SHORT_PREFILL`
  tokens, beside the decoding sequences padded to a power of four; chunks that fit no group together
  run as further parts of the same call, one forward pass each;
- with a fixed token count (option ``batch_invariant`` on XLA's path, see
  :mod:`ruvllm_jax.batch_invariant`) every shape's decode rows are padded to that count less its
  prompt group, so every product has the same number of rows whatever the batch.

Policy only: chunk lengths in, shapes and index lists out; the arrays are built by
:mod:`ruvllm_jax.step_inputs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ruvllm.backend import SequenceChunk
from ruvllm.errors import BackendError
from ruvllm_jax.model import bucket

#: Prompt chunks are padded to a power of two of at least this many tokens.
MIN_PREFILL_LEN = 16
#: Up to SHORT_GROUP prompt chunks of at most SHORT_PREFILL tokens run together in one group.
SHORT_PREFILL = 128
SHORT_GROUP = 4
#: w8a8 steps of at most this many (padded) tokens use the native kernels when they are loaded;
#: larger ones use XLA's integer GEMM, which reuses each weight load across more rows. (w4a8 steps
#: always use the native kernels on CPU: XLA has no fast form of the grouped product.)
NATIVE_MAX_TOKENS = 4


#: Flash decoding (``decode_splits``, :func:`ruvllm_jax.kernels.paged_decode_attention`): a part of a
#: sequence's keys is at least this many key positions of the step's block-table width (two of the
#: kernel's 64-key steps). Each part writes its float32 output, maximum and sum (``G x (D + 2)``
#: floats per kv head) and the merge reads them back: for Llama-3-8B (G = 4, D = 128) 2 KB against
#: the 64 KB of 128 keys' K and V in bf16, 3% more traffic for a part that streams half as long.
SPLIT_MIN_KEYS = 128
#: Streaming multiprocessors assumed when splits are chosen without a device to ask (lowering for
#: CUDA on a CPU machine): an H100's and an H200's 132.
DEFAULT_GPU_CORES = 132


def decode_splits(decode_seqs: int, kv_heads: int, table_keys: int, cores: int) -> int:
    """The parts each decoding sequence's keys are cut into (flash decoding) for a step of
    ``decode_seqs`` (padded) sequences on a GPU of ``cores`` SMs, whose block tables hold
    ``table_keys`` key positions.

    The decode kernel runs one program per (sequence, kv head); fewer programs than SMs leave SMs
    idle (8 programs at batch 1 on Llama-3-8B against 132 SMs), and each program streams its whole
    context alone. Splitting multiplies the programs by the largest power of two that keeps them
    within the SM count (more would queue a second wave on a few SMs, whose time adds to the step's),
    bounded so that each part covers at least :data:`SPLIT_MIN_KEYS` of the table's key positions
    (shorter parts cost more in their partial results and the merge than they save). A step whose
    programs already fill the device keeps one part. Static per compiled shape: the table width is
    the longest sequence served, not the step's contexts."""
    programs = max(1, decode_seqs) * max(1, kv_heads)
    fill = cores // programs
    most = table_keys // SPLIT_MIN_KEYS
    splits = min(fill, most)
    return 1 if splits < 2 else 1 << (splits.bit_length() - 1)


def bucket4(n: int) -> int:
    """Decoding sequences beside a prompt group: 0, 1, 4, 16, 64..."""
    return 0 if n <= 0 else 1 if n == 1 else 1 << (2 * (((n - 1).bit_length() + 1) // 2))


@dataclass(frozen=True)
class StepShape:
    """One compiled step's sizes: decoding sequences, prompt-group chunks and their padded length."""

    decode_seqs: int
    prefill_seqs: int = 0
    prefill_len: int = 1

    @property
    def num_tokens(self) -> int:
        return self.decode_seqs + self.prefill_seqs * self.prefill_len

    def __str__(self) -> str:
        if not self.prefill_seqs:
            return f"decode {self.decode_seqs}"
        return f"decode {self.decode_seqs} + prefill {self.prefill_seqs}x{self.prefill_len}"


def step_shapes(max_num_seqs: int, max_num_batched_tokens: int, tokens: int | None = None) -> list[StepShape]:
    """Every shape a step within these limits is padded to (see the module docstring); ``tokens``:
    each padded to that many tokens (at least :func:`fixed_tokens` of the limits)."""
    shapes = _step_shapes(max_num_seqs, max_num_batched_tokens)
    if tokens is None:
        return shapes
    return list(dict.fromkeys(pad_to(s, tokens) for s in shapes))


def fixed_tokens(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The fewest tokens that every shape within these limits fits: one token count for every step."""
    return max(s.num_tokens for s in _step_shapes(max_num_seqs, max_num_batched_tokens))


def pad_to(shape: StepShape, tokens: int) -> StepShape:
    """``shape`` with its decode rows padded so that it has ``tokens`` tokens."""
    sd = tokens - shape.prefill_seqs * shape.prefill_len
    if sd < shape.decode_seqs:
        raise BackendError(
            f"jax backend: a step of {shape} ({shape.num_tokens} tokens) exceeds the fixed {tokens} tokens of "
            "batch_invariant: precompile for the limits served"
        )
    return dataclasses.replace(shape, decode_seqs=sd)


def _step_shapes(max_num_seqs: int, max_num_batched_tokens: int) -> list[StepShape]:
    shapes = []
    sd = 1
    while sd <= bucket(min(max_num_seqs, max_num_batched_tokens)):
        shapes.append(StepShape(sd))
        sd *= 2
    groups = [(1, q) for q in powers_of_two(MIN_PREFILL_LEN, bucket(max_num_batched_tokens))]
    if max_num_seqs >= 2:
        groups += [(SHORT_GROUP, q) for q in powers_of_two(MIN_PREFILL_LEN, min(SHORT_PREFILL, max_num_batched_tokens))]
    for sp, qb in groups:
        fewest_chunks = 1 if sp == 1 else 2
        # The longest chunk decides the padded length; the others may have as few as 2 tokens.
        fewest_tokens = (2 if qb == MIN_PREFILL_LEN else qb // 2 + 1) + 2 * (fewest_chunks - 1)
        if fewest_tokens > max_num_batched_tokens:
            continue
        sd = 0
        while True:
            fewest_decodes = 0 if sd == 0 else 1 if sd == 1 else sd // 4 + 1
            if fewest_decodes + fewest_chunks > max_num_seqs or fewest_decodes + fewest_tokens > max_num_batched_tokens:
                break
            shapes.append(StepShape(sd, sp, qb))
            sd = 1 if sd == 0 else sd * 4
    return shapes


def powers_of_two(lo: int, hi: int) -> list[int]:
    """``lo``, ``2 lo``, ... up to ``hi`` (at least ``lo`` itself)."""
    out, q = [], lo
    while q <= max(lo, hi):
        out.append(q)
        q *= 2
    return out


def shape_of(lens: Sequence[int], tokens: int | None = None) -> StepShape:
    """The shape one forward pass over chunks of these lengths (one part of :func:`partition`) is
    padded to; ``tokens``: padded to that many tokens (:func:`pad_to`; the decode rows need only fit).
    """
    shape = _shape_of(lens)
    if tokens is None:
        return shape
    return pad_to(dataclasses.replace(shape, decode_seqs=sum(1 for n in lens if n == 1)), tokens)


def _shape_of(lens: Sequence[int]) -> StepShape:
    decode = sum(1 for n in lens if n == 1)
    prompts = [n for n in lens if n > 1]
    if not prompts:
        return StepShape(bucket(decode))
    sp = 1 if len(prompts) == 1 else SHORT_GROUP
    qb = max(MIN_PREFILL_LEN, bucket(max(prompts)))
    if len(prompts) > sp or (sp > 1 and qb > SHORT_PREFILL):
        raise BackendError(f"jax backend: prompt chunks of {prompts} tokens fit no step shape")
    return StepShape(bucket4(decode), sp, qb)


def partition(lens: Sequence[int]) -> list[list[int]]:
    """The chunks (indices) each forward pass of a step runs: the first part holds every decoding
    chunk and the first prompt group; long prompt chunks form groups of one, short ones groups of up
    to :data:`SHORT_GROUP` (a lone short chunk is a group of one)."""
    decode = [i for i, n in enumerate(lens) if n == 1]
    prompts = sorted((i for i, n in enumerate(lens) if n > 1), key=lambda i: -lens[i])
    groups = [[i] for i in prompts if lens[i] > SHORT_PREFILL]
    short = [i for i in prompts if lens[i] <= SHORT_PREFILL]
    groups += [short[k : k + SHORT_GROUP] for k in range(0, len(short), SHORT_GROUP)]
    if not groups:
        return [decode]
    return [decode + groups[0], *groups[1:]]


def runs_native(native: bool, quantization: str, num_tokens: int) -> bool:
    """Whether a step of ``num_tokens`` (padded) tokens runs the quantized products in the native
    kernels, given whether they are loaded for the model (see :data:`NATIVE_MAX_TOKENS`)."""
    return native and (quantization == "w4a8" or num_tokens <= NATIVE_MAX_TOKENS)


def shape_chunks(shape: StepShape, table: np.ndarray, hidden: bool, every: bool = False) -> list[SequenceChunk]:
    """Chunks of one step of ``shape`` (decoding sequences, then prompt chunks), the last asking for
    hidden states when ``hidden`` and for every position's logits when ``every``: what precompiling
    (or lowering) that shape runs."""
    one = SequenceChunk(np.zeros(1, np.int32), 0, table, local_block_table=table)
    chunks = [one] * shape.decode_seqs
    chunks += [dataclasses.replace(one, token_ids=np.zeros(shape.prefill_len, np.int32))] * shape.prefill_seqs
    chunks[-1] = dataclasses.replace(chunks[-1], hidden_states=hidden, all_logits=every)
    return chunks
