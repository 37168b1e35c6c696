"""Sampling on the device, after the step, on the logits the step left there.

:func:`sample_rows` implements :class:`ruvllm.backend.DeviceSampling` (its doc states the rules) in
jnp: penalties, bias and bans from the row's overlay, the allowed-token bits, greedy argmax, or
temperature with top_k, top_p and min_p and an inverse-CDF draw at the host's uniform. It is jitted
per (rows, overlay width, sorted): the whole-vocabulary sort that top_k, top_p and min_p need is
compiled only into the variant whose batch has such a row. The allowed-token bits are always an
input (all set where no row has a grammar) and the top 20 log-probabilities are always computed:
fewer variants to compile before traffic, for work that is small next to the sort on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ruvllm.backend import DeviceSampling, SampledRows

#: Top log-probabilities computed (the most a request may ask for, OpenAI's 20).
TOP_LOGPROBS = 20


class SamplingInputs(NamedTuple):
    greedy: jax.Array  # bool [R]
    temperature: jax.Array  # float32 [R]
    top_k: jax.Array  # int32 [R]
    top_p: jax.Array  # float32 [R]
    min_p: jax.Array  # float32 [R]
    repetition_penalty: jax.Array  # float32 [R]
    uniform: jax.Array  # float32 [R]
    overlay_ids: jax.Array  # int32 [R, W]
    overlay_rep: jax.Array  # bool [R, W]
    overlay_add: jax.Array  # float32 [R, W]
    allowed: jax.Array  # uint8 [R, ceil(V / 8)]


def variant(ds: DeviceSampling) -> tuple[int, bool]:
    """(overlay width, sorted) of a batch's sampling function."""
    filtered = bool(np.any(~ds.greedy & ((ds.top_k > 0) | (ds.top_p < 1) | (ds.min_p > 0))))
    return ds.overlay_ids.shape[1], filtered


def pad_inputs(ds: DeviceSampling, rows: int, vocab: int, everything: jax.Array | None = None) -> SamplingInputs:
    """``ds`` padded to ``rows`` rows (the step's logit rows; padding rows are greedy and unread);
    ``everything``: the all-allowed bits to pass when no row has a grammar (kept on the device)."""
    b = len(ds.greedy)

    def pad(a: np.ndarray, fill) -> np.ndarray:
        out = np.full((rows, *a.shape[1:]), fill, a.dtype)
        out[:b] = a
        return out

    return SamplingInputs(
        greedy=pad(ds.greedy, True),
        temperature=pad(ds.temperature, 1.0),
        top_k=pad(ds.top_k, 0),
        top_p=pad(ds.top_p, 1.0),
        min_p=pad(ds.min_p, 0.0),
        repetition_penalty=pad(ds.repetition_penalty, 1.0),
        uniform=pad(ds.uniform, 0.0),
        overlay_ids=pad(ds.overlay_ids, vocab),
        overlay_rep=pad(ds.overlay_rep, False),
        overlay_add=pad(ds.overlay_add, 0.0),
        allowed=(everything if everything is not None else all_allowed(rows, vocab))
        if ds.allowed is None
        else pad(ds.allowed, 0xFF),
    )


def all_allowed(rows: int, vocab: int) -> np.ndarray:
    return np.full((rows, -(-vocab // 8)), 0xFF, np.uint8)


def abstract_inputs(rows: int, vocab: int, width: int) -> SamplingInputs:
    """Shapes of :class:`SamplingInputs` (for compiling before traffic)."""

    def s(shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    r = (rows,)
    return SamplingInputs(
        s(r, np.bool_),
        s(r, np.float32),
        s(r, np.int32),
        s(r, np.float32),
        s(r, np.float32),
        s(r, np.float32),
        s(r, np.float32),
        s((rows, width), np.int32),
        s((rows, width), np.bool_),
        s((rows, width), np.float32),
        s((rows, -(-vocab // 8)), np.uint8),
    )


def sample_rows(
    logits: jax.Array, inp: SamplingInputs, *, sort: bool
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Tokens int32 [R], their raw log-probabilities [R], the :data:`TOP_LOGPROBS` most likely ids
    and log-probabilities [R, K], and whether each row's logits were finite [R]."""
    raw = logits.astype(jnp.float32)
    r, v = raw.shape
    finite = jnp.isfinite(raw).all(-1)
    lse = jax.nn.logsumexp(raw, axis=-1)
    x = raw
    if inp.overlay_ids.shape[1]:  # (tests pass width 0)
        ids = inp.overlay_ids
        cur = jnp.take_along_axis(x, jnp.minimum(ids, v - 1), axis=-1)
        rp = inp.repetition_penalty[:, None]
        new = jnp.where(inp.overlay_rep, jnp.where(cur > 0, cur / rp, cur * rp), cur) + inp.overlay_add
        x = x.at[jnp.arange(r)[:, None], ids].set(new, mode="drop")
    col = jnp.arange(v)
    bits = (inp.allowed[:, col // 8] >> (col % 8).astype(jnp.uint8)) & 1
    x = jnp.where(bits.astype(bool), x, -jnp.inf)
    greedy_token = jnp.argmax(x, axis=-1).astype(jnp.int32)
    z = x / inp.temperature[:, None]
    # Unfiltered rows: the whole vocabulary in id order.
    w = jnp.exp(z - z.max(-1, keepdims=True))
    cdf = jnp.cumsum(w, axis=-1)
    u = inp.uniform[:, None] * cdf[:, -1:]
    token = jnp.minimum(jnp.sum(cdf <= u, axis=-1), v - 1).astype(jnp.int32)
    if sort:
        # Filtered rows: canonical order (adjusted logit descending, id ascending).
        iota = jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (r, v))
        neg, order = jax.lax.sort((-z, iota), dimension=1, num_keys=2)
        pos = jnp.arange(v)[None, :]
        p = jnp.exp(-neg + neg[:, :1])
        k = jnp.where(inp.top_k > 0, inp.top_k, v)[:, None]
        p = jnp.where(pos < k, p, 0.0)
        p = p / p.sum(-1, keepdims=True)
        keep = k[:, 0]
        keep_p = jnp.sum(jnp.cumsum(p, axis=-1) < inp.top_p[:, None], axis=-1) + 1
        keep = jnp.where(inp.top_p < 1.0, jnp.minimum(keep, keep_p), keep)
        keep_m = jnp.maximum(1, jnp.sum(p >= inp.min_p[:, None] * p[:, :1], axis=-1))
        keep = jnp.where(inp.min_p > 0.0, jnp.minimum(keep, keep_m), keep)
        q = jnp.where(pos < keep[:, None], p, 0.0)
        qcdf = jnp.cumsum(q, axis=-1)
        at = inp.uniform * jnp.take_along_axis(qcdf, (keep - 1)[:, None], axis=-1)[:, 0]
        idx = jnp.minimum(jnp.sum(qcdf <= at[:, None], axis=-1), keep - 1)
        picked = jnp.take_along_axis(order, idx[:, None], axis=-1)[:, 0]
        filtered = (inp.top_k > 0) | (inp.top_p < 1.0) | (inp.min_p > 0.0)
        token = jnp.where(filtered, picked, token)
    token = jnp.where(inp.greedy, greedy_token, token)
    chosen = jnp.take_along_axis(raw, token[:, None], axis=-1)[:, 0] - lse
    top_values, top_ids = jax.lax.top_k(raw, min(TOP_LOGPROBS, v))
    top_lp = top_values - lse[:, None]
    return token, chosen, top_ids.astype(jnp.int32), top_lp, finite


def to_host(out: tuple[jax.Array, ...], n: int, fetch: Callable[[jax.Array], Any] = jax.device_get) -> SampledRows:
    """The first ``n`` rows of :func:`sample_rows`' results, on the host (``fetch``: how one array
    comes to this host; across processes, a gather)."""
    token, chosen, top_ids, top_lp, finite = (fetch(a) for a in out)
    return SampledRows(
        tokens=np.asarray(token[:n]),
        logprobs=np.asarray(chosen[:n]),
        top_ids=np.asarray(top_ids[:n]),
        top_logprobs=np.asarray(top_lp[:n]),
        finite=np.asarray(finite[:n]),
    )
