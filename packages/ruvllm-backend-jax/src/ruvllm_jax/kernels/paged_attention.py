"""Pallas attention kernels over the paged KV cache, written for (and lowered through) Pallas's Triton
backend on CUDA; ``attention="pallas"`` opts into them (the jax backend's default on GPUs is XLA's
attention over gathered blocks, see ``docs/jax-backend.md``).

Both kernels run one program per (sequence, kv head[, query tile]) and stream the sequence's keys
and values through its block table in steps of ``pages_per_step`` blocks, with an online softmax
(flash attention), so nothing of size ``context`` is ever materialized. All query heads that share
a kv head (GQA) are processed together as the rows of one tile, so each key block is read once per
group. Triton wants power-of-two tile sides of at least 16, so the group is padded up to that.

A sliding window (``window`` > 0, a runtime value: layers differ) masks keys at or before
``q - window`` and starts the stream at the first block any query of the program sees, so a windowed
layer reads ``window`` keys, not the whole context.

The cache is passed whole, viewed as a ``[layers * blocks * block_size, kv_heads * head_dim]``
matrix (a free reshape), and rows are gathered from it with computed indices: the layer and the
block table are runtime values, which block specs cannot express on this lowering.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from ruvllm_jax.masking import MASK_VALUE, score_scale, window_start

#: Lowered through Pallas's Triton backend, named explicitly: JAX's default Pallas GPU backend is now
#: Mosaic GPU, which stages every input block in shared memory, and these kernels take the whole
#: cache as one block (they gather rows with computed indices), far over the 227 KB a Hopper SM has.
TRITON = pl_triton.CompilerParams(num_warps=4, num_stages=2)
#: Keys streamed per inner step (rounded to whole blocks).
KEYS_PER_STEP = 64
#: Query tile rows (query tokens x heads of a group) of the prefill kernel.
QUERY_ROWS = 64


def _pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def _stream_keys(
    q,
    scale,
    k_ref,
    v_ref,
    tables_ref,
    *,
    layer,
    head,
    num_blocks,
    block_size,
    pages_per_step,
    first_step,
    steps,
    q_pos,
    lo,
    length,
    stats=False,
):
    """Online-softmax attention of the tile ``q`` ``[M, D]`` over key steps ``first_step .. steps - 1``;
    query row ``m`` sees keys at positions ``lo[m] .. q_pos[m]`` below ``length``. With ``stats``, also
    each row's running maximum and sum (to merge partial results over disjoint key ranges)."""
    m_rows, hd = q.shape
    keys = pages_per_step * block_size
    r = jnp.arange(keys, dtype=jnp.int32)

    def body(i, carry):
        acc, m_prev, l_prev = carry
        page = tables_ref[i * pages_per_step + r // block_size]
        rows = (layer * num_blocks + page) * block_size + r % block_size
        k = k_ref[rows, pl.ds(head * hd, hd)]
        v = v_ref[rows, pl.ds(head * hd, hd)]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        kpos = i * keys + r
        valid = (kpos[None, :] >= lo[:, None]) & (kpos[None, :] <= q_pos[:, None]) & (kpos[None, :] < length)
        s = jnp.where(valid, s, MASK_VALUE)
        m_new = jnp.maximum(m_prev, s.max(axis=-1))
        corr = jnp.exp(m_prev - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
        l_new = l_prev * corr + p.sum(axis=-1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc * corr[:, None] + pv, m_new, l_new

    init = (
        jnp.zeros((m_rows, hd), jnp.float32),
        jnp.full((m_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((m_rows,), jnp.float32),
    )
    acc, m_max, l_sum = lax.fori_loop(first_step, steps, body, init)
    out = acc / jnp.where(l_sum > 0, l_sum, 1.0)[:, None]
    return (out, m_max, l_sum) if stats else out


def _decode_keys(layer_ref, window_ref, lens_ref, tables_ref, q_ref, k_ref, v_ref, *, num_blocks, block_size,
                 pages_per_step, scale, part=None, splits=1):
    """The decode attention of program (sequence, kv head): over every key step the query sees, or
    over part ``part`` of ``splits`` consecutive ranges of them (then with the softmax statistics)."""
    s, head = pl.program_id(0), pl.program_id(1)
    length = lens_ref[s]
    q = q_ref[...]
    keys = pages_per_step * block_size
    q_pos = jnp.full((q.shape[0],), length - 1, jnp.int32)
    window = window_ref[0]
    first, steps = window_start(length - 1, window) // keys, pl.cdiv(length, keys)
    if part is not None:
        per = pl.cdiv(jnp.maximum(steps - first, 0), splits)
        first, steps = first + part * per, jnp.minimum(first + part * per + per, steps)
    return _stream_keys(
        q,
        scale,
        k_ref,
        v_ref,
        tables_ref,
        layer=layer_ref[0],
        head=head,
        num_blocks=num_blocks,
        block_size=block_size,
        pages_per_step=pages_per_step,
        first_step=first,
        steps=steps,
        q_pos=q_pos,
        lo=window_start(q_pos, window),
        length=length,
        stats=part is not None,
    )


def _decode_kernel(*refs, **static):
    *inputs, o_ref = refs
    o_ref[...] = _decode_keys(*inputs, **static).astype(o_ref.dtype)


def _decode_split_kernel(*refs, splits, **static):
    """One part of a sequence's keys (flash decoding): the key steps it needs are cut into ``splits``
    consecutive ranges, one program each, so a few long sequences still fill the device. Writes the
    part's normalized output with its softmax maximum and sum; :func:`_merge_parts` combines them."""
    *inputs, o_ref, m_ref, l_ref = refs
    o_ref[...], m_ref[...], l_ref[...] = _decode_keys(*inputs, part=pl.program_id(2), splits=splits, **static)


def _merge_parts(out: jax.Array, m_max: jax.Array, l_sum: jax.Array) -> jax.Array:
    """Softmax-weighted sum of the parts (axis 2) of :func:`_decode_split_kernel`; a part that saw no
    key weighs nothing, and a sequence with none at all (padding) gives zeros, as the one-part kernel."""
    seen = l_sum > 0
    lse = jnp.where(seen, m_max + jnp.log(jnp.where(seen, l_sum, 1.0)), -jnp.inf)
    top = jnp.max(lse, axis=2, keepdims=True)
    w = jnp.where(seen, jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = jnp.sum(w, axis=2)
    return jnp.sum(w[..., None] * out, axis=2) / jnp.where(total > 0, total, 1.0)[..., None]


def _prefill_kernel(
    layer_ref,
    window_ref,
    start_ref,
    lens_ref,
    tables_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    *,
    num_blocks,
    block_size,
    pages_per_step,
    scale,
    group_rows,
    tile_tokens,
):
    s, head, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, length = start_ref[s], lens_ref[s]
    q = q_ref[...]
    first = start + tile * tile_tokens
    q_pos = first + jnp.arange(q.shape[0], dtype=jnp.int32) // group_rows
    window = window_ref[0]
    lo = window_start(q_pos, window)
    keys = pages_per_step * block_size
    # Causal: the tile needs keys up to its last query; a tile of padding only needs none.
    kv_end = jnp.minimum(length, first + tile_tokens)
    steps = jnp.where(first < length, pl.cdiv(kv_end, keys), 0)
    out = _stream_keys(
        q,
        scale,
        k_ref,
        v_ref,
        tables_ref,
        layer=layer_ref[0],
        head=head,
        num_blocks=num_blocks,
        block_size=block_size,
        pages_per_step=pages_per_step,
        first_step=window_start(first, window) // keys,  # the tile's first query sees the earliest key
        steps=steps,
        q_pos=q_pos,
        lo=lo,
        length=length,
    )
    o_ref[...] = out.astype(o_ref.dtype)


def _cache_matrix(cache: jax.Array) -> jax.Array:
    layers, blocks, bs, kvh, hd = cache.shape
    return cache.reshape(layers * blocks * bs, kvh * hd)


def _pad_tables(tables: jax.Array, pages_per_step: int) -> jax.Array:
    extra = -tables.shape[1] % pages_per_step
    return jnp.pad(tables, ((0, 0), (0, extra))) if extra else tables


def _full(x: jax.Array) -> pl.BlockSpec:
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _scalar(x) -> jax.Array:
    return jnp.reshape(jnp.asarray(x), (1,)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "splits"))
def paged_decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    tables: jax.Array,
    context: jax.Array,
    *,
    window: jax.Array | int = 0,
    scale: float | None = None,
    interpret: bool = False,
    splits: int = 1,
) -> jax.Array:
    """One query per sequence: ``q`` ``[S, heads, head_dim]`` at position ``context[s] - 1`` attends
    over positions ``0 .. context[s] - 1`` (the last ``window`` of them when ``window`` > 0). Returns
    ``[S, heads, head_dim]``. ``splits`` > 1 cuts each sequence's keys into that many parts, one
    program each, merged afterwards (flash decoding: one program per sequence and kv head leaves most
    of a GPU idle at small batches)."""
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be a positive integer, got {splits!r}")
    s, nh, hd = q.shape
    _layers, num_blocks, bs, nkv, _ = k_cache.shape
    group = nh // nkv
    gp = _pow2_at_least(group)
    pages = max(1, KEYS_PER_STEP // bs)
    qg = jnp.pad(q.reshape(s, nkv, group, hd), ((0, 0), (0, 0), (0, gp - group), (0, 0)))
    tables = _pad_tables(tables.astype(jnp.int32), pages)
    layer_arr, window_arr = _scalar(layer), _scalar(window)
    context = context.astype(jnp.int32)
    kernel = functools.partial(
        _decode_kernel, num_blocks=num_blocks, block_size=bs, pages_per_step=pages, scale=score_scale(scale, hd)
    )
    k2, v2 = _cache_matrix(k_cache), _cache_matrix(v_cache)
    if splits > 1:
        return _decode_split(layer_arr, window_arr, context, tables, qg, k2, v2, q.dtype, interpret, splits,
                             num_blocks=num_blocks, block_size=bs, pages_per_step=pages,
                             scale=score_scale(scale, hd))[:, :, :group].reshape(s, nh, hd)  # fmt: skip
    out = pl.pallas_call(
        kernel,
        grid=(s, nkv),
        in_specs=[
            _full(layer_arr),
            _full(window_arr),
            _full(context),
            pl.BlockSpec((None, tables.shape[1]), lambda i, h: (i, 0)),
            pl.BlockSpec((None, None, gp, hd), lambda i, h: (i, h, 0, 0)),
            _full(k2),
            _full(v2),
        ],
        out_specs=pl.BlockSpec((None, None, gp, hd), lambda i, h: (i, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        interpret=interpret,
        compiler_params=TRITON,
        name="ruvllm_paged_decode_attention",
    )(layer_arr, window_arr, context, tables, qg, k2, v2)
    return out[:, :, :group].reshape(s, nh, hd)


def _decode_split(layer_arr, window_arr, context, tables, qg, k2, v2, dtype, interpret, splits, **static):
    s, nkv, gp, hd = qg.shape
    part = (None, None, None, gp)
    out, m_max, l_sum = pl.pallas_call(
        functools.partial(_decode_split_kernel, splits=splits, **static),
        grid=(s, nkv, splits),
        in_specs=[
            _full(layer_arr),
            _full(window_arr),
            _full(context),
            pl.BlockSpec((None, tables.shape[1]), lambda i, h, p: (i, 0)),
            pl.BlockSpec((None, None, gp, hd), lambda i, h, p: (i, h, 0, 0)),
            _full(k2),
            _full(v2),
        ],
        out_specs=[
            pl.BlockSpec((*part, hd), lambda i, h, p: (i, h, p, 0, 0)),
            pl.BlockSpec(part, lambda i, h, p: (i, h, p, 0)),
            pl.BlockSpec(part, lambda i, h, p: (i, h, p, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((s, nkv, splits, gp, hd), jnp.float32),
            jax.ShapeDtypeStruct((s, nkv, splits, gp), jnp.float32),
            jax.ShapeDtypeStruct((s, nkv, splits, gp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=TRITON,
        name="ruvllm_paged_decode_attention_split",
    )(layer_arr, window_arr, context, tables, qg, k2, v2)
    return _merge_parts(out, m_max, l_sum).astype(dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def paged_prefill_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    tables: jax.Array,
    start: jax.Array,
    context: jax.Array,
    *,
    window: jax.Array | int = 0,
    scale: float | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal flash attention of chunks: ``q`` ``[S, Q, heads, head_dim]``, query ``i`` of sequence
    ``s`` at position ``start[s] + i`` attends over positions ``<= start[s] + i`` and
    ``< context[s]`` (its own chunk's keys must already be in the cache), and above
    ``start[s] + i - window`` when ``window`` > 0. Returns ``q``'s shape."""
    s, nq, nh, hd = q.shape
    _layers, num_blocks, bs, nkv, _ = k_cache.shape
    group = nh // nkv
    gp = _pow2_at_least(group, floor=1)
    tile_tokens = max(1, QUERY_ROWS // gp)
    nq_pad = -(-nq // tile_tokens) * tile_tokens
    pages = max(1, KEYS_PER_STEP // bs)
    # [S, Q, kvh, g, D] -> [S, kvh, Q * gp, D]: a tile's rows are consecutive tokens, each with its
    # whole head group, so one tile shares one kv head.
    qg = q.reshape(s, nq, nkv, group, hd)
    qg = jnp.pad(qg, ((0, 0), (0, nq_pad - nq), (0, 0), (0, gp - group), (0, 0)))
    qg = qg.transpose(0, 2, 1, 3, 4).reshape(s, nkv, nq_pad * gp, hd)
    tables = _pad_tables(tables.astype(jnp.int32), pages)
    layer_arr, window_arr = _scalar(layer), _scalar(window)
    start, context = start.astype(jnp.int32), context.astype(jnp.int32)
    rows = tile_tokens * gp
    kernel = functools.partial(
        _prefill_kernel,
        num_blocks=num_blocks,
        block_size=bs,
        pages_per_step=pages,
        scale=score_scale(scale, hd),
        group_rows=gp,
        tile_tokens=tile_tokens,
    )
    k2, v2 = _cache_matrix(k_cache), _cache_matrix(v_cache)
    out = pl.pallas_call(
        kernel,
        grid=(s, nkv, nq_pad // tile_tokens),
        in_specs=[
            _full(layer_arr),
            _full(window_arr),
            _full(start),
            _full(context),
            pl.BlockSpec((None, tables.shape[1]), lambda i, h, t: (i, 0)),
            pl.BlockSpec((None, None, rows, hd), lambda i, h, t: (i, h, t, 0)),
            _full(k2),
            _full(v2),
        ],
        out_specs=pl.BlockSpec((None, None, rows, hd), lambda i, h, t: (i, h, t, 0)),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        interpret=interpret,
        compiler_params=TRITON,
        name="ruvllm_paged_prefill_attention",
    )(layer_arr, window_arr, start, context, tables, qg, k2, v2)
    out = out.reshape(s, nkv, nq_pad, gp, hd)[:, :, :nq, :group]
    return out.transpose(0, 2, 1, 3, 4).reshape(s, nq, nh, hd)
