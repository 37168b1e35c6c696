"""Attention over the paged KV cache: the jax.numpy reference and the dispatch to Pallas kernels.

All implementations share one signature. ``q`` is ``[S, Q, heads, head_dim]``: ``Q`` new tokens of
each of ``S`` sequences (padded); ``q_pos[s, i]`` is the position of query ``i``; a query attends to
the keys at positions ``p <= q_pos[s, i]`` with ``p < context[s]``, read through ``tables[s]``
(position ``p`` lives in block ``tables[s, p // block_size]`` at offset ``p % block_size``). The cache
holds all layers, ``[layers, num_blocks, block_size, kv_heads, head_dim]``; ``layer`` picks one.
Queries with nothing to attend to (padding) get zeros.

``window`` (an int32 scalar, traced: layers differ) limits a query at ``q`` to keys ``p > q - window``
(Hugging Face's sliding window; 0: no limit). ``scale`` (static) multiplies the scores, default
``head_dim ** -0.5``. An int8 cache comes with ``k_scale``/``v_scale`` ``[layers, num_blocks,
block_size, kv_heads, groups]`` (see :class:`ruvllm_jax.kv_state.KVState`; the reference implementation
only). ``sinks`` ``[heads]`` (gpt_oss; the reference implementation only): one logit per query head
that joins each query's softmax as a key without a value, so the weights of the real keys sum to less
than one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ruvllm_jax.kv_state import dequantize_kv
from ruvllm_jax.masking import MASK_VALUE, score_scale, window_start

#: Keys the reference attention processes per loop iteration. Block tables are as wide as the
#: longest sequence the engine serves (one compiled shape for every context length); the loop runs
#: only over the chunks that hold keys some query of the step can see.
KEY_CHUNK_TOKENS = 256


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
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    hot: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    s, nq, nh, hd = q.shape
    scale = score_scale(scale, hd)
    _, _, bs, nkv, _ = k_cache.shape
    group = nh // nkv
    lo = window_start(q_pos, window)
    per_chunk = max(1, KEY_CHUNK_TOKENS // bs)
    scales = (k_scale, v_scale)
    if tables.shape[1] <= per_chunk:  # one chunk: no loop
        return _attend_keys(q, k_cache, v_cache, scales, layer, tables, 0, q_pos, lo, context, scale, hot, sinks)[0]
    if hot is not None:
        hot = (*hot[:2], jnp.pad(hot[2], ((0, 0), (0, -tables.shape[1] % per_chunk)), constant_values=-1))
    tables = jnp.pad(tables, ((0, 0), (0, -tables.shape[1] % per_chunk)))
    chunk = per_chunk * bs
    live = context > 0
    # Chunks [first, last) hold every key a live query may see (a sliding window skips old ones).
    first = jnp.min(jnp.where(live[:, None], lo, jnp.iinfo(jnp.int32).max)) // chunk
    last = -(-jnp.max(context) // chunk)
    first = jnp.minimum(first, last)
    qg = (s, nkv, group, nq)
    init = (
        jnp.full(qg, MASK_VALUE, jnp.float32),
        jnp.zeros(qg, jnp.float32),
        jnp.zeros((*qg, hd), jnp.float32),
    )

    def body(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        m, total, acc = carry
        tb = lax.dynamic_slice_in_dim(tables, i * per_chunk, per_chunk, axis=1)
        hb = None if hot is None else (*hot[:2], lax.dynamic_slice_in_dim(hot[2], i * per_chunk, per_chunk, axis=1))
        _, (m_c, sum_c, acc_c) = _attend_keys(
            q, k_cache, v_cache, scales, layer, tb, i * chunk, q_pos, lo, context, scale, hb
        )
        m_new = jnp.maximum(m, m_c)
        a, b = jnp.exp(m - m_new), jnp.exp(m_c - m_new)
        return m_new, total * a + sum_c * b, acc * a[..., None] + acc_c * b[..., None]

    m, total, acc = lax.fori_loop(first, last, body, init)
    out = acc / _denominator(m, total, sinks, nkv)[..., None]  # [S, KV, G, Q, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(s, nq, nh, hd).astype(q.dtype)


def _attend_keys(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    scales: tuple[jax.Array | None, jax.Array | None],
    layer: jax.Array,
    tables: jax.Array,
    offset: jax.Array | int,
    q_pos: jax.Array,
    lo: jax.Array,
    context: jax.Array,
    scale: float,
    hot: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """Attention of ``q`` over the keys of ``tables`` (positions from ``offset``): the normalised
    output ``[S, Q, H, D]`` and the pieces an online softmax combines across chunks (row maximum,
    sum of exponentials and unnormalised output, ``[S, KV, G, Q(, D)]``). ``hot``: a two-tier cache's
    float copies and each table entry's slot there (-1: none), read in place of the int8 codes."""
    s, nq, nh, hd = q.shape
    _, _, bs, nkv, _ = k_cache.shape
    group = nh // nkv
    keys = tables.shape[1] * bs
    k, v = k_cache[layer, tables], v_cache[layer, tables]
    if scales[0] is not None:  # int8 codes times their group scales
        k = dequantize_kv(k, scales[0][layer, tables])
        v = dequantize_kv(v, scales[1][layer, tables])
    if hot is not None:  # recent blocks of a two-tier cache: their float copies
        hot_k, hot_v, slots = hot
        use = (slots >= 0)[:, :, None, None, None]
        slots = jnp.maximum(slots, 0)
        k = jnp.where(use, hot_k[layer, slots].astype(k.dtype), k)
        v = jnp.where(use, hot_v[layer, slots].astype(v.dtype), v)
    k = k.reshape(s, keys, nkv, hd).transpose(0, 2, 1, 3)  # [S, KV, L, D]
    v = v.reshape(s, keys, nkv, hd).transpose(0, 2, 1, 3)
    # The group's queries stacked as rows of one batched matmul per (sequence, kv head): XLA:CPU
    # runs this ~2.5x faster than the general einsum at 1024 queries.
    qt = q.reshape(s, nq, nkv, group, hd).transpose(0, 2, 3, 1, 4).reshape(s, nkv, group * nq, hd)
    batch = ((0, 1), (0, 1))
    scores = lax.dot_general(qt, k, (((3,), (3,)), batch), preferred_element_type=jnp.float32) * scale
    scores = scores.reshape(s, nkv, group, nq, keys)
    kpos = offset + jnp.arange(keys, dtype=jnp.int32)[None, None, :]
    mask = (kpos >= lo[:, :, None]) & (kpos <= q_pos[:, :, None]) & (kpos < context[:, None, None])
    mask = mask[:, None, None]  # [S, 1, 1, Q, L]
    scores = jnp.where(mask, scores, MASK_VALUE)
    m = jnp.max(scores, axis=-1)
    e = jnp.where(mask, jnp.exp(scores - m[..., None]), 0.0)
    total = jnp.sum(e, axis=-1)
    p = e.reshape(s, nkv, group * nq, keys).astype(v.dtype)
    acc = lax.dot_general(p, v, (((3,), (2,)), batch), preferred_element_type=jnp.float32)
    acc = acc.reshape(s, nkv, group, nq, hd)
    out = acc / _denominator(m, total, sinks, nkv)[..., None]
    out = out.transpose(0, 3, 1, 2, 4).reshape(s, nq, nh, hd).astype(q.dtype)
    return out, (m, total, acc)


def _denominator(m: jax.Array, total: jax.Array, sinks: jax.Array | None, nkv: int) -> jax.Array:
    """The softmax's denominator ``[S, KV, G, Q]`` from the row maxima and sums of exponentials: with
    ``sinks``, each head's sink added as ``exp(sink - m)`` (a row with no keys stays 0 / x = 0)."""
    if sinks is None:
        return jnp.where(total > 0, total, 1.0)
    sink = sinks.astype(jnp.float32).reshape(1, nkv, -1, 1)
    return total + jnp.exp(jnp.minimum(sink - m, 80.0))


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
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    hot: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    decode_splits: int = 1,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Dispatch: ``reference``, or the Pallas kernels (``pallas`` compiled for CUDA,
    ``pallas_interpret`` interpreted anywhere): decode kernel for one query per sequence (its keys
    cut into ``decode_splits`` parts, see :func:`ruvllm_jax.kernels.paged_decode_attention`), flash
    prefill kernel otherwise."""
    if impl == "reference":
        return reference_paged_attention(
            q,
            k_cache,
            v_cache,
            layer,
            tables,
            q_pos,
            context,
            window,
            scale=scale,
            k_scale=k_scale,
            v_scale=v_scale,
            hot=hot,
            sinks=sinks,
        )
    if sinks is not None:
        raise ValueError("the Pallas kernels have no attention sinks; sinks need attention='reference'")
    if k_scale is not None:
        raise ValueError("the Pallas kernels read a float cache; an int8 KV cache needs attention='reference'")
    from ruvllm_jax.kernels import paged_decode_attention, paged_prefill_attention

    kw = dict(window=window, scale=scale, interpret=impl == "pallas_interpret")
    if q.shape[1] == 1:
        return paged_decode_attention(q[:, 0], k_cache, v_cache, layer, tables, context, splits=decode_splits, **kw)[
            :, None
        ]
    return paged_prefill_attention(q, k_cache, v_cache, layer, tables, q_pos[:, 0], context, **kw)
