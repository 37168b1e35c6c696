"""Encoder models through the backends: the protocol a backend implements to run the encoder pass
(:mod:`ruvllm.modeling.encoder`) and :func:`load_encoder`, the encoder's :func:`~ruvllm.runtime.load_model`.

An encoder pass reads whole sequences at once and keeps nothing: no KV cache, no blocks, no scheduler.
A backend opts in by giving its backend object a ``load_encoder(checkpoint, options)`` method that
returns an :class:`EncoderModel`; a backend without one is refused by name."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import structlog

from ruvllm.backend import DTYPE_CHOICES, Backend, LoadOptions
from ruvllm.errors import BackendError

if TYPE_CHECKING:
    from ruvllm.checkpoint import Checkpoint
    from ruvllm.plugins import PluginHost

log = structlog.get_logger("ruvllm.encoder")


@dataclass(frozen=True)
class EncodeBatch:
    """Whole sequences to encode: ``token_ids[i]`` int32 ``[n_i]`` and, for models with token types
    (BERT's segments), ``token_types[i]`` the same length (None: all zero)."""

    token_ids: Sequence[np.ndarray]
    token_types: Sequence[np.ndarray] | None = None


@runtime_checkable
class EncoderModel(Protocol):
    """A loaded encoder: ``encode`` gives each sequence's final hidden states, float32 ``[n_i, hidden]``.
    It may be called from several threads at once."""

    options: LoadOptions

    def encode(self, batch: EncodeBatch) -> list[np.ndarray]: ...


@runtime_checkable
class LoadsEncoders(Protocol):
    """A backend object that runs encoder passes."""

    def load_encoder(self, checkpoint: Checkpoint, options: LoadOptions) -> EncoderModel: ...


@dataclass
class LoadedEncoder:
    """A checkpoint's encoder loaded by one backend."""

    checkpoint: Checkpoint
    backend: Backend
    model: EncoderModel

    def encode(self, batch: EncodeBatch) -> list[np.ndarray]:
        return self.model.encode(batch)


def load_encoder(
    checkpoint: Checkpoint,
    *,
    backend: str | None = None,
    options: LoadOptions | None = None,
    host: PluginHost | None = None,
) -> LoadedEncoder:
    """Have the chosen backend (``backend``, else the available one of highest priority that runs
    encoders) load ``checkpoint``'s encoder."""
    from ruvllm.plugins import load_plugins

    host = host or load_plugins()
    options = options or LoadOptions()
    if options.dtype not in DTYPE_CHOICES:
        raise BackendError(f"unknown dtype {options.dtype!r} (choose from {', '.join(DTYPE_CHOICES)})")
    backend = backend or os.environ.get("RUVLLM_BACKEND") or None
    if backend is None:
        chosen: Any = host.choose_backend(None)
        if not isinstance(chosen, LoadsEncoders):
            runs = [b for b in host.backends.values() if isinstance(b, LoadsEncoders) and b.available()]
            if not runs:
                raise BackendError(f"no available backend runs encoder models (the default, {chosen.name!r}, does not)")
            chosen = max(runs, key=lambda b: b.priority)
    else:
        chosen = host.choose_backend(backend)
        if not isinstance(chosen, LoadsEncoders):
            raise BackendError(
                f"backend {chosen.name!r} does not run encoder models (embeddings, cross-encoders): "
                "it has no load_encoder; candle-compat and jax do"
            )
    model = chosen.load_encoder(checkpoint, options)
    if not isinstance(model, EncoderModel):
        raise BackendError(f"backend {chosen.name!r} loaded {type(model).__name__}, which lacks encode")
    log.debug("encoder loaded", backend=chosen.name, architecture=checkpoint.config.architecture)
    return LoadedEncoder(checkpoint, chosen, model)


@dataclass(frozen=True)
class PackedPass:
    """Sequences packed end to end into ``rows x length`` arrays for one pass: ``ids``, ``types``,
    ``segments`` (which sequence of its row a position holds, from 1; 0 is padding, read by no query)
    and ``positions`` (from 0 at each sequence's start), all int32; ``places`` gives each sequence's
    ``(index in the batch, row, start)``."""

    ids: np.ndarray
    types: np.ndarray
    segments: np.ndarray
    positions: np.ndarray
    places: list[tuple[int, int, int]]


def packed_passes(
    batch: EncodeBatch,
    max_tokens: int,
    *,
    bucket: Callable[[int], int] | None = None,
    pack_length: int = 0,
    row_count: Callable[[int], int] | None = None,
) -> list[PackedPass]:
    """``batch`` in passes of at most about ``max_tokens`` positions, longest sequences first, each
    sequence whole in one row and several short ones sharing a row (first fit, longest first), so
    little of a pass is padding. A pass's row length is ``bucket`` of its longest sequence, raised to
    ``pack_length`` (``bucket`` of the tokens left, if fewer) so short sequences share rows; its rows
    are ``row_count`` of those used. ``bucket`` and ``row_count`` bound the shapes a jitted pass meets."""
    lengths = [len(t) for t in batch.token_ids]
    left = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    size = bucket or (lambda n: n)
    passes: list[PackedPass] = []
    while left:
        length = size(lengths[left[0]])
        if pack_length:
            length = max(length, min(pack_length, size(sum(lengths[i] for i in left))))
        most_rows = max(1, max_tokens // length)
        rows: list[list[int]] = []
        free: list[int] = []
        later: list[int] = []
        for i in left:
            n = lengths[i]
            row = next((r for r, f in enumerate(free) if f >= n), None)
            if row is None and len(rows) < most_rows:
                rows.append([])
                free.append(length)
                row = len(rows) - 1
            if row is None:
                later.append(i)
                continue
            rows[row].append(i)
            free[row] -= n
        passes.append(_pack(batch, rows, length, row_count(len(rows)) if row_count else len(rows)))
        left = later
    return passes


def _pack(batch: EncodeBatch, rows: list[list[int]], length: int, n_rows: int) -> PackedPass:
    shape = (n_rows, length)
    ids, types = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    segments, positions = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    places: list[tuple[int, int, int]] = []
    for r, members in enumerate(rows):
        start = 0
        for s, i in enumerate(members, 1):
            n = len(batch.token_ids[i])
            end = start + n
            ids[r, start:end] = batch.token_ids[i]
            if batch.token_types is not None:
                types[r, start:end] = batch.token_types[i]
            segments[r, start:end] = s
            positions[r, start:end] = np.arange(n)
            places.append((i, r, start))
            start = end
    return PackedPass(ids, types, segments, positions, places)
