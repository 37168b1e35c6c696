"""The Llama-family forward step (llama, mistral, qwen2) as one pure function.

``forward_step(weights, cache, inputs, spec=..., plan=...)`` runs every layer over a ragged batch of
tokens laid out flat (``[T]``), writes their keys and values into the paged cache and returns the
logits of the requested rows. It is jitted once per :class:`StepPlan` (the padded shapes) by
:mod:`ruvllm_jax.runner`. Layers run under ``lax.scan`` over weights stacked on a leading layer axis,
so compile time does not grow with depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from ruvllm.model_config import ModelConfig
from ruvllm_jax.attention import paged_attention
from ruvllm_jax.quant import Weight, linear, take_rows


@dataclass(frozen=True)
class ModelSpec:
    """What the math needs to know, hashable so it can be a static jit argument."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    tie_word_embeddings: bool
    dtype: str = "float32"

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype: str = "float32") -> ModelSpec:
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            attention_bias=cfg.attention_bias,
            tie_word_embeddings=cfg.tie_word_embeddings,
            dtype=dtype,
        )


@jax.tree_util.register_dataclass
@dataclass
class LayerWeights:
    """One decoder layer's weights; in :class:`Weights` every leaf has a leading layer axis."""

    input_norm: jax.Array
    q_proj: Weight
    k_proj: Weight
    v_proj: Weight
    o_proj: Weight
    post_attention_norm: jax.Array
    gate_proj: Weight
    up_proj: Weight
    down_proj: Weight
    q_bias: jax.Array | None = None
    k_bias: jax.Array | None = None
    v_bias: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclass
class Weights:
    embed: Weight
    layers: LayerWeights
    final_norm: jax.Array
    #: None when the output projection is tied to ``embed``.
    lm_head: Weight | None = None


@jax.tree_util.register_dataclass
@dataclass
class KVState:
    """Paged K and V of all layers: ``[layers, num_blocks, block_size, kv_heads, head_dim]``, so layer
    ``l``'s cache is ``k[l]`` of shape ``[num_blocks, block_size, kv_heads, head_dim]``."""

    k: jax.Array
    v: jax.Array


@dataclass(frozen=True)
class StepPlan:
    """The static shape of one step (every size is a padded bucket) and what it returns."""

    num_tokens: int
    #: Decode group: sequences with exactly one new token, and their block-table width.
    decode_seqs: int
    decode_blocks: int
    #: Prefill group: sequences with several new tokens, the longest chunk, and block-table width.
    prefill_seqs: int
    prefill_len: int
    prefill_blocks: int
    logit_rows: int
    return_hidden: bool
    #: ``reference`` (jax.numpy), ``pallas`` (CUDA kernels) or ``pallas_interpret`` (same kernels,
    #: interpreted: for testing them inside the model on CPU).
    attention: str = "reference"


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    """Host-prepared int32 arrays of one step. Padding entries point past the end (``num_tokens`` or
    ``num_blocks``) so the scatters that use them drop them."""

    tokens: jax.Array  # [T]
    positions: jax.Array  # [T]
    write_block: jax.Array  # [T] cache block of each token's K/V (num_blocks for padding)
    write_offset: jax.Array  # [T]
    decode_token: jax.Array  # [Sd] flat index of each decode sequence's token (T for padding)
    decode_tables: jax.Array  # [Sd, Bd]
    decode_context: jax.Array  # [Sd] tokens to attend over (end_pos), 0 for padding
    prefill_token: jax.Array  # [Sp, Qb] flat index of each chunk's tokens (T for padding)
    prefill_tables: jax.Array  # [Sp, Bp]
    prefill_start: jax.Array  # [Sp] position of each chunk's first token
    prefill_context: jax.Array  # [Sp]
    logit_rows: jax.Array  # [G] flat indices whose logits are returned


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[T, head_dim // 2]`` (float32) of the rotary embedding."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (Hugging Face layout) of ``x`` ``[T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _attend(q: jax.Array, kv: KVState, layer: jax.Array, inp: StepInputs, plan: StepPlan) -> jax.Array:
    """Attention of every token over its own sequence's cache, decode and prefill groups apart."""
    _t, h, d = q.shape
    out = jnp.zeros_like(q)
    if plan.decode_seqs:
        qd = q.at[inp.decode_token].get(mode="clip")[:, None]  # [Sd, 1, H, D]
        od = paged_attention(
            qd,
            kv.k,
            kv.v,
            layer,
            inp.decode_tables,
            (inp.decode_context - 1)[:, None],
            inp.decode_context,
            impl=plan.attention,
        )
        out = out.at[inp.decode_token].set(od[:, 0], mode="drop")
    if plan.prefill_seqs:
        qp = q.at[inp.prefill_token].get(mode="clip")  # [Sp, Qb, H, D]
        q_pos = inp.prefill_start[:, None] + jnp.arange(plan.prefill_len, dtype=jnp.int32)[None, :]
        op = paged_attention(qp, kv.k, kv.v, layer, inp.prefill_tables, q_pos, inp.prefill_context, impl=plan.attention)
        out = out.at[inp.prefill_token.reshape(-1)].set(op.reshape(-1, h, d), mode="drop")
    return out


def forward_step(
    weights: Weights, cache: KVState, inp: StepInputs, *, spec: ModelSpec, plan: StepPlan
) -> tuple[jax.Array, jax.Array | None, KVState]:
    """One engine step: returns (logits ``[G, vocab]`` float32, final hidden ``[T, hidden]`` or None,
    the updated cache)."""
    dtype = jnp.dtype(spec.dtype)
    t = plan.num_tokens
    nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    x = take_rows(weights.embed, inp.tokens, dtype)
    cos, sin = rope_tables(inp.positions, hd, spec.rope_theta)

    def layer_step(carry, lw: LayerWeights):
        x, k_cache, v_cache, layer = carry
        h = rms_norm(x, lw.input_norm, spec.rms_norm_eps)
        q, k, v = linear(h, lw.q_proj), linear(h, lw.k_proj), linear(h, lw.v_proj)
        if spec.attention_bias:
            q, k, v = q + lw.q_bias.astype(dtype), k + lw.k_bias.astype(dtype), v + lw.v_bias.astype(dtype)
        q = apply_rope(q.reshape(t, nh, hd), cos, sin)
        k = apply_rope(k.reshape(t, nkv, hd), cos, sin)
        v = v.reshape(t, nkv, hd)
        k_cache = k_cache.at[layer, inp.write_block, inp.write_offset].set(k.astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[layer, inp.write_block, inp.write_offset].set(v.astype(v_cache.dtype), mode="drop")
        a = _attend(q, KVState(k_cache, v_cache), layer, inp, plan)
        x = x + linear(a.reshape(t, nh * hd), lw.o_proj)
        h = rms_norm(x, lw.post_attention_norm, spec.rms_norm_eps)
        x = x + linear(jax.nn.silu(linear(h, lw.gate_proj)) * linear(h, lw.up_proj), lw.down_proj)
        return (x, k_cache, v_cache, layer + 1), None

    (x, k_cache, v_cache, _), _ = lax.scan(layer_step, (x, cache.k, cache.v, jnp.zeros((), jnp.int32)), weights.layers)
    x = rms_norm(x, weights.final_norm, spec.rms_norm_eps)
    head = weights.embed if weights.lm_head is None else weights.lm_head
    logits = linear(x[inp.logit_rows], head).astype(jnp.float32)
    hidden = x.astype(jnp.float32) if plan.return_hidden else None
    return logits, hidden, KVState(k_cache, v_cache)
