"""Encoder models through the backends: the protocol a backend implements to run the encoder pass
(:mod:`ruvllm.modeling.encoder`) and :func:`load_encoder`, the encoder's :func:`~ruvllm.runtime.load_model`.

An encoder pass reads whole sequences at once and keeps nothing: no KV cache, no blocks, no scheduler.
A backend opts in by giving its backend object a ``load_encoder(checkpoint, options)`` method that
returns an :class:`EncoderModel`; a backend without one is refused by name."""

from __future__ import annotations

import os
from collections.abc import Sequence
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


def padded_batch(
    batch: EncodeBatch, order: Sequence[int], length: int, rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sequences ``order`` right-padded into ``rows x length`` arrays: ids, token types, valid."""
    ids = np.zeros((rows, length), dtype=np.int32)
    types = np.zeros((rows, length), dtype=np.int32)
    valid = np.zeros((rows, length), dtype=bool)
    for r, i in enumerate(order):
        n = len(batch.token_ids[i])
        ids[r, :n] = batch.token_ids[i]
        if batch.token_types is not None:
            types[r, :n] = batch.token_types[i]
        valid[r, :n] = True
    return ids, types, valid


def length_groups(lengths: Sequence[int], max_tokens: int, bucket: Any = None) -> list[list[int]]:
    """Indices grouped by length (longest first) so that each group's padded size, ``rows x length``
    with ``length`` the group's longest (``bucket(length)`` where given), stays within ``max_tokens``
    (a group has at least one sequence)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            longest = lengths[groups[-1][0]]
            padded = bucket(longest) if bucket else longest
            if padded * (len(groups[-1]) + 1) <= max_tokens:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups
