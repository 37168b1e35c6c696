"""What a step leaves on the host: its outputs gathered across processes, and the device-sampled rows
of a batch run in several parts put back in the batch's order."""

from __future__ import annotations

import jax
import numpy as np

from ruvllm.backend import SampledRows


def to_host(a: jax.Array) -> np.ndarray:
    """A step's output on this host: across processes (a mesh spanning several), sharded outputs are
    gathered from all of them (every process runs this, as it runs the step)."""
    if a.is_fully_addressable or a.is_fully_replicated:
        return np.asarray(a)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def merge_sampled(parts: list[tuple[list[int], SampledRows]], n: int) -> SampledRows:
    if len(parts) == 1 and parts[0][0] == list(range(n)):
        return parts[0][1]
    k = max(p.top_ids.shape[1] for _, p in parts)
    out = SampledRows(
        tokens=np.zeros(n, np.int32),
        logprobs=np.zeros(n, np.float32),
        top_ids=np.zeros((n, k), np.int32),
        top_logprobs=np.full((n, k), -np.inf, np.float32),
        finite=np.zeros(n, bool),
    )
    for idx, p in parts:
        out.tokens[idx], out.logprobs[idx], out.finite[idx] = p.tokens, p.logprobs, p.finite
        out.top_ids[idx, : p.top_ids.shape[1]] = p.top_ids
        out.top_logprobs[idx, : p.top_ids.shape[1]] = p.top_logprobs
    return out
