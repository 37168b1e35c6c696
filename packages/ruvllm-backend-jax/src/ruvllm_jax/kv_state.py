"""The paged KV cache as the compiled step sees it: :class:`KVState` (a pytree of all layers' keys and
values, its int8 codes and scales, a hybrid cache's second pool and a two-tier cache's float slots),
the int8 codec, and :func:`write_kv`, the scatter of a step's new keys and values. The host side of
the cache (sizing options, allocation, copy-on-write) is :mod:`ruvllm_jax.kv_cache`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class KVState:
    """Paged K and V of all layers: ``[layers, num_blocks, block_size, kv_heads, head_dim]``, so layer
    ``l``'s cache is ``k[l]`` of shape ``[num_blocks, block_size, kv_heads, head_dim]``.

    A hybrid cache (a model interleaving windowed and global layers, see
    :class:`ruvllm.block_manager.HybridBlockManager`) holds the global layers here, in layer order,
    and the windowed layers in ``local``, a pool of its own with its own block count, addressed by
    the step's local block tables.

    An int8 cache holds codes in ``k``/``v`` and float32 scales in ``k_scale``/``v_scale``
    ``[layers, num_blocks, block_size, kv_heads, head_dim // KV_SCALE_GROUP]``: one per group of
    :data:`KV_SCALE_GROUP` consecutive values of a token's head, ``max|x| / 127`` over the group."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    local: KVState | None = None
    #: A two-tier cache: float copies of recent blocks ``[layers, hot_blocks, block_size, kv_heads,
    #: head_dim]`` next to every block's int8 codes. The runner (:class:`ruvllm_jax.two_tier.HotSlots`)
    #: gives a recent block a slot here; attention reads a block through its slot when it has one.
    hot_k: jax.Array | None = None
    hot_v: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def two_tier(self) -> bool:
        return self.hot_k is not None


#: Values of a token's head that share one int8 scale. A scale per whole head lets the few large
#: channels of rotated keys swamp the rest (SmolLM2: max |logit error| ~2 over 256 tokens); groups of
#: 16 keep each group's range its own for 4 more bytes per 16 values.
KV_SCALE_GROUP = 16
#: K/V cache element types the native CPU attention kernels read in place (16-bit rows are widened to
#: float32 as they are read); an int8 cache attends through XLA.
NATIVE_KV_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def kv_scale_groups(head_dim: int) -> int:
    return -(-head_dim // KV_SCALE_GROUP) if head_dim % KV_SCALE_GROUP == 0 else 1


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int8 codes of ``x`` ``[..., head_dim]`` and the scales of its groups ``[..., groups]``
    (symmetric, round to nearest)."""
    *lead, d = x.shape
    g = kv_scale_groups(d)
    xg = x.astype(jnp.float32).reshape(*lead, g, d // g)
    scale = jnp.max(jnp.abs(xg), axis=-1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.clip(jnp.round(xg / safe[..., None]), -127, 127).astype(jnp.int8)
    return codes.reshape(*lead, d), scale


def dequantize_kv(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 values of int8 ``codes`` ``[..., head_dim]`` with their group scales ``[..., groups]``."""
    *lead, d = codes.shape
    g = scale.shape[-1]
    return (codes.astype(jnp.float32).reshape(*lead, g, d // g) * scale[..., None]).reshape(*lead, d)


def write_kv(
    cache: KVState,
    layer: jax.Array,
    block: jax.Array,
    offset: jax.Array,
    k: jax.Array,
    v: jax.Array,
    hot_slot: jax.Array | None = None,
) -> KVState:
    """``cache`` with tokens' keys and values ``[T, kv_heads, head_dim]`` written at (block, offset) of
    ``layer`` (padding tokens point past the last block and are dropped); a two-tier cache also writes
    them as they are at (``hot_slot``, offset) of its float copies (past the last slot: none)."""
    idx = (layer, block, offset)
    if not cache.quantized:
        return dataclasses.replace(
            cache,
            k=cache.k.at[idx].set(k.astype(cache.k.dtype), mode="drop"),
            v=cache.v.at[idx].set(v.astype(cache.v.dtype), mode="drop"),
        )
    kc, ks = quantize_kv(k)
    vc, vs = quantize_kv(v)
    out = dataclasses.replace(
        cache,
        k=cache.k.at[idx].set(kc, mode="drop"),
        v=cache.v.at[idx].set(vc, mode="drop"),
        k_scale=cache.k_scale.at[idx].set(ks, mode="drop"),
        v_scale=cache.v_scale.at[idx].set(vs, mode="drop"),
    )
    if cache.two_tier:
        hidx = (layer, hot_slot, offset)
        out = dataclasses.replace(
            out,
            hot_k=cache.hot_k.at[hidx].set(k.astype(cache.hot_k.dtype), mode="drop"),
            hot_v=cache.hot_v.at[hidx].set(v.astype(cache.hot_v.dtype), mode="drop"),
        )
    return out
