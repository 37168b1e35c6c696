"""How a step writes a layer's keys and values and attends over them, ``attend`` of
:func:`ruvllm.modeling.decoder_layer`: the paged cache's decode and prefill groups apart, through XLA's
attention or the native kernels, on the one pool or a hybrid cache's two."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from ruvllm.errors import BackendError
from ruvllm_jax import native
from ruvllm_jax.attention import paged_attention, window_start
from ruvllm_jax.kv_state import NATIVE_KV_DTYPES, KVState, write_kv
from ruvllm_jax.step_types import ModelSpec, StepInputs, StepPlan


def _hot(kv: KVState, tables: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """A two-tier cache's float copies and the slot of each table entry, for the attention."""
    return (kv.hot_k, kv.hot_v, tables) if kv.two_tier else None


def _attend(
    q: jax.Array,
    kv: KVState,
    layer: jax.Array,
    window: jax.Array | int,
    inp: StepInputs,
    plan: StepPlan,
    scale: float,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of every token over its own sequence's cache, decode and prefill groups apart
    (``sinks``: gpt_oss's logit per head that joins each softmax; XLA's reference attention only)."""
    _t, h, d = q.shape
    out = jnp.zeros_like(q)
    if sinks is not None and plan.attention != "reference":
        raise BackendError(
            f"jax backend: attention sinks (gpt_oss) run in the reference attention only, not {plan.attention!r}"
        )
    native_attention = plan.native_attention and sinks is None
    if plan.decode_seqs:
        qd = q.at[inp.decode_token].get(mode="clip")[:, None]  # [Sd, 1, H, D]
        q_pos = inp.decode_context - 1
        if native_attention and kv.k.dtype in NATIVE_KV_DTYPES and not kv.quantized and plan.attention == "reference":
            # The native kernel reads the sequences' blocks in place instead of gathering them.
            first = window_start(q_pos, window)
            od = native.paged_decode(
                qd[:, 0], kv.k, kv.v, layer, inp.decode_tables, inp.decode_context, first, scale=scale
            )[:, None]
        else:
            od = paged_attention(
                qd,
                kv.k,
                kv.v,
                layer,
                inp.decode_tables,
                q_pos[:, None],
                inp.decode_context,
                window,
                scale=scale,
                impl=plan.attention,
                k_scale=kv.k_scale,
                v_scale=kv.v_scale,
                hot=_hot(kv, inp.decode_hot_tables),
                decode_splits=plan.decode_splits,
                sinks=sinks,
            )
        out = out.at[inp.decode_token].set(od[:, 0].astype(q.dtype), mode="drop")
    if plan.prefill_seqs:
        qp = q.at[inp.prefill_token].get(mode="clip")  # [Sp, Qb, H, D]
        q_pos = inp.prefill_start[:, None] + jnp.arange(plan.prefill_len, dtype=jnp.int32)[None, :]
        if native_attention and kv.k.dtype in NATIVE_KV_DTYPES and not kv.quantized and plan.attention == "reference":
            # The native kernel reads the blocks in place and skips padding queries (XLA's attention
            # computes every padded query of the group's shape).
            sp, qb = q_pos.shape
            live = q_pos < inp.prefill_context[:, None]
            op = native.paged_prefill(
                qp.reshape(sp * qb, h, d),
                kv.k,
                kv.v,
                layer,
                inp.prefill_tables,
                jnp.repeat(jnp.arange(sp, dtype=jnp.int32), qb),
                jnp.where(live, q_pos + 1, 0).reshape(-1),
                window_start(q_pos, window).reshape(-1),
                scale=scale,
            ).reshape(sp, qb, h, d)
        else:
            op = paged_attention(
                qp,
                kv.k,
                kv.v,
                layer,
                inp.prefill_tables,
                q_pos,
                inp.prefill_context,
                window,
                scale=scale,
                impl=plan.attention,
                k_scale=kv.k_scale,
                v_scale=kv.v_scale,
                hot=_hot(kv, inp.prefill_hot_tables),
                sinks=sinks,
            )
        out = out.at[inp.prefill_token.reshape(-1)].set(op.reshape(-1, h, d), mode="drop")
    return out


@dataclass(frozen=True)
class Pools:
    """Where a layer's keys and values are written and read: the one pool, or a hybrid cache's two
    (each layer in its own pool at its index there; the write to the other pool points past its last
    block, so the scatter drops it), with a two-tier cache's float slots beside each."""

    inp: StepInputs
    plan: StepPlan
    scale: float
    local_inp: StepInputs | None

    @classmethod
    def of(cls, cache: KVState, spec: ModelSpec, inp: StepInputs, plan: StepPlan) -> Pools:
        local_inp = None
        if cache.local is not None:
            local_inp = dataclasses.replace(
                inp,
                decode_tables=inp.decode_local_tables,
                prefill_tables=inp.prefill_local_tables,
                decode_hot_tables=inp.decode_local_hot_tables,
                prefill_hot_tables=inp.prefill_local_hot_tables,
            )
        return cls(inp, plan, spec.attention_scale, local_inp)

    def attend(self, kv: KVState, kvl: KVState | None, layer, pool, window, q, k, v, sinks=None):
        """Write the layer's ``k``/``v``, attend ``q`` over its pool: (output, kv, kvl)."""
        inp, plan, scale = self.inp, self.plan, self.scale
        if pool is None:
            kv = write_kv(kv, layer, inp.write_block, inp.write_offset, k, v, inp.hot_write)
            return _attend(q, kv, layer, window, inp, plan, scale, sinks), kv, kvl
        local, idx = pool
        hot, local_hot = None, None
        if kv.two_tier:
            hot = jnp.where(local, kv.hot_k.shape[1], inp.hot_write)
            local_hot = jnp.where(local, inp.local_hot_write, kvl.hot_k.shape[1])
        kv = write_kv(kv, idx, jnp.where(local, kv.k.shape[1], inp.write_block), inp.write_offset, k, v, hot)
        kvl = write_kv(
            kvl, idx, jnp.where(local, inp.local_write_block, kvl.k.shape[1]), inp.write_offset, k, v, local_hot
        )
        out = lax.cond(
            local,
            lambda: _attend(q, kvl, idx, window, self.local_inp, plan, scale, sinks),
            lambda: _attend(q, kv, idx, window, inp, plan, scale, sinks),
        )
        return out, kv, kvl
