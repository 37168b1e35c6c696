"""Attention over the paged KV cache: the jax.numpy reference and the dispatch to Pallas kernels.

All implementations share one signature. ``q`` is ``[S, Q, heads, head_dim]``: ``Q`` new tokens of
each of ``S`` sequences (padded); ``q_pos[s, i]`` is the position of query ``i``; a query attends to
the keys at positions ``p <= q_pos[s, i]`` with ``p < context[s]``, read through ``tables[s]``
(position ``p`` lives in block ``tables[s, p // block_size]`` at offset ``p % block_size``). The cache
holds all layers, ``[layers, num_blocks, block_size, kv_heads, head_dim]``; ``layer`` picks one.
Queries with nothing to attend to (padding) get zeros.

``window`` (an int32 scalar, traced: layers differ) limits a query at ``q`` to keys ``p > q - window``
(Hugging Face's sliding window; 0: no limit). ``scale`` (static) multiplies the scores, default
``head_dim ** -0.5``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

#: Large negative, finite, so fully masked rows never produce NaN.
MASK_VALUE = -1e30


def score_scale(scale: float | None, head_dim: int) -> float:
    return head_dim**-0.5 if scale is None else scale


def window_start(q_pos: jax.Array, window: jax.Array | int) -> jax.Array:
    """First key position a query at ``q_pos`` sees (0 without a window)."""
    window = jnp.asarray(window, jnp.int32)
    return jnp.where(window > 0, jnp.maximum(q_pos - window + 1, 0), 0)


@functools.partial(jax.jit, static_argnames=("scale",))
def reference_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    tables: jax.Array,
    q_pos: jax.Array,
    context: jax.Array,
    window: jax.Array | int = 0,
    *,
    scale: float | None = None,
) -> jax.Array:
    s, nq, nh, hd = q.shape
    scale = score_scale(scale, hd)
    _, _, bs, nkv, _ = k_cache.shape
    group = nh // nkv
    keys = tables.shape[1] * bs
    k = k_cache[layer, tables].reshape(s, keys, nkv, hd)
    v = v_cache[layer, tables].reshape(s, keys, nkv, hd)
    lo = window_start(q_pos, window)
    if nq > 1:
        return _prefill_attention(q, k, v, q_pos, lo, context, scale)
    qg = q.reshape(s, nq, nkv, group, hd)
    scores = jnp.einsum("sqkgd,slkd->skgql", qg, k, preferred_element_type=jnp.float32) * scale
    p = _masked_softmax(scores, q_pos, lo, context)
    out = jnp.einsum("skgql,slkd->sqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(s, nq, nh, hd).astype(q.dtype)


def _masked_softmax(scores: jax.Array, q_pos: jax.Array, lo: jax.Array, context: jax.Array) -> jax.Array:
    """Softmax over keys of ``scores`` ``[S, KV, G, Q, L]``: key ``l`` counts for query ``i`` when
    ``lo[s, i] <= l <= q_pos[s, i]`` and ``l < context[s]``; rows with no key are all zero."""
    kpos = jnp.arange(scores.shape[-1], dtype=jnp.int32)[None, None, :]
    mask = (kpos >= lo[:, :, None]) & (kpos <= q_pos[:, :, None]) & (kpos < context[:, None, None])
    mask = mask[:, None, None]  # [S, 1, 1, Q, L]
    scores = jnp.where(mask, scores, MASK_VALUE)
    m = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(scores - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(denom > 0, denom, 1.0)


def _prefill_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, lo: jax.Array, context: jax.Array, scale: float
) -> jax.Array:
    """Many queries per sequence: the same math laid out as batched matmuls over (sequence, kv head)
    with the group's queries stacked, which XLA:CPU runs ~2.5x faster than the general einsum at
    1024 queries (it otherwise transposes the scores and runs small matmuls)."""
    s, nq, nh, hd = q.shape
    keys, nkv = k.shape[1], k.shape[2]
    group = nh // nkv
    kt = k.transpose(0, 2, 1, 3)  # [S, KV, L, D]
    vt = v.transpose(0, 2, 1, 3)
    qt = q.reshape(s, nq, nkv, group, hd).transpose(0, 2, 3, 1, 4).reshape(s, nkv, group * nq, hd)
    batch = ((0, 1), (0, 1))
    scores = lax.dot_general(qt, kt, (((3,), (3,)), batch), preferred_element_type=jnp.float32) * scale
    p = _masked_softmax(scores.reshape(s, nkv, group, nq, keys), q_pos, lo, context)
    p = p.reshape(s, nkv, group * nq, keys)
    out = lax.dot_general(p.astype(vt.dtype), vt, (((3,), (2,)), batch), preferred_element_type=jnp.float32)
    return out.reshape(s, nkv, group, nq, hd).transpose(0, 3, 1, 2, 4).reshape(s, nq, nh, hd).astype(q.dtype)


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    tables: jax.Array,
    q_pos: jax.Array,
    context: jax.Array,
    window: jax.Array | int = 0,
    *,
    scale: float | None = None,
    impl: str = "reference",
) -> jax.Array:
    """Dispatch: ``reference``, or the Pallas kernels (``pallas`` compiled for CUDA,
    ``pallas_interpret`` interpreted anywhere): decode kernel for one query per sequence, flash
    prefill kernel otherwise."""
    if impl == "reference":
        return reference_paged_attention(q, k_cache, v_cache, layer, tables, q_pos, context, window, scale=scale)
    from ruvllm_jax.kernels import paged_decode_attention, paged_prefill_attention

    kw = dict(window=window, scale=scale, interpret=impl == "pallas_interpret")
    if q.shape[1] == 1:
        return paged_decode_attention(q[:, 0], k_cache, v_cache, layer, tables, context, **kw)[:, None]
    return paged_prefill_attention(q, k_cache, v_cache, layer, tables, q_pos[:, 0], context, **kw)
