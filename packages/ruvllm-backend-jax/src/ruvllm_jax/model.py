"""The decoder forward step of every family in :mod:`ruvllm.architectures` as one pure function.

``forward_step(weights, cache, inputs, spec=..., plan=...)`` runs every layer over a ragged batch of
tokens laid out flat (``[T]``), writes their keys and values into the paged cache and returns the
logits of the requested rows. It is jitted once per :class:`StepPlan` (the padded shapes) by
:mod:`ruvllm_jax.runner`. Layers run under ``lax.scan`` over weights stacked on a leading layer axis,
so compile time does not grow with depth. What differs between families is in :class:`ModelSpec`
(activation, QK-norm, output norms, embedding and query scales, per-layer sliding windows and RoPE,
logit soft-capping); per-layer values (window, which RoPE table) are scanned with the weights.
The layer's arithmetic is :func:`ruvllm.modeling.decoder_layer`, the one every backend runs; this
module gives it the JAX ways to project (XLA or the native kernels), attend (the paged cache) and
adapt (LoRA slots), and the calibration pass of :mod:`ruvllm_jax.calibrate` runs it too.

A mixture of experts multiplies the step's (token, expert) pairs, sorted into one group per expert
by :func:`ruvllm.modeling.moe_mlp`, with ``lax.ragged_dot_general`` over the stacked experts
``[experts, out, in]``: one grouped product per matrix whatever the batch. (XLA on CUDA and TPU
lowers it to a grouped matrix product; XLA:CPU in this jax expands it to every expert times every
row, masked, so on CPU a step with fewer rows than experts, a decode step, gathers each row's
expert instead and reads only the chosen ones.)

Per-sequence LoRA adapters (:class:`LoraPlan`): every adapter of a step owns a slot. Per projection
in use, slot ``s`` brings ``A_s [layers, r, in]`` and ``B_s [layers, out, r]`` (scale folded into
``B``, zeros where the adapter has no entry or a smaller rank); the step concatenates the slots into
``A [layers, S * r, in]`` and ``B [layers, out, S * r]``, scanned with the layer weights, and adds
``((x @ A.T) * mask) @ B.T`` to the projection's output, where ``mask`` keeps each token's own slot's
``r`` columns (none for tokens without an adapter). Two small dense matmuls per projection, whatever
the mix of adapters in the batch; a step without adapters has no LoRA operation at all.

The step's arguments are in :mod:`ruvllm_jax.step_types`; how it projects, attends and adapts in
:mod:`ruvllm_jax.step_projections`, :mod:`ruvllm_jax.step_attention` and :mod:`ruvllm_jax.step_adapters`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ruvllm.modeling import (  # noqa: F401 (decoder_layer and the math stay importable from here)
    ACTIVATION_NAMES,
    ACTIVATIONS,
    EXPERT_FIELDS,
    PROJECTION_GROUPS,
    PROJECTIONS,
    LayerWeights,
    apply_rope,
    decoder_layer,
    projection_shape,
    register_primitives,
    rms_norm,
)
from ruvllm.modeling import softcap as apply_softcap
from ruvllm_jax import row_sums
from ruvllm_jax.kv_state import (  # noqa: F401 (the KV state's names stay importable from here)
    KV_SCALE_GROUP,
    NATIVE_KV_DTYPES,
    KVState,
    dequantize_kv,
    kv_scale_groups,
    quantize_kv,
    write_kv,
)
from ruvllm_jax.quant import Weight, linear, take_rows
from ruvllm_jax.step_adapters import Adapters
from ruvllm_jax.step_attention import Pools
from ruvllm_jax.step_projections import (
    Projector,
    native_format,
    native_projections,
    project_experts,  # noqa: F401 (stays importable from here)
)
from ruvllm_jax.step_types import (  # noqa: F401 (the step's types stay importable from here)
    NATIVE_LORA_MAX_TOKENS,
    LoraFactors,
    LoraPlan,
    ModelSpec,
    StepInputs,
    StepPlan,
    Weights,
    bucket,
    gathers_lora,
    native_lora,
)

# XLA's own sigmoid (SiLU) and rsqrt (RMSNorm) for the model's formulas: the ops the step always ran;
# RMSNorm's mean in a fixed order, so a row's norm does not depend on the step's row count.
register_primitives(
    jnp, sigmoid=jax.nn.sigmoid, rsqrt=row_sums.exact_rsqrt, mean_square=row_sums.mean_square, erf=jax.lax.erf
)


def rope_tables(positions: jax.Array, spec: ModelSpec) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[ropes, T, head_dim // 2]`` (float32) of each of the spec's RoPEs, as Hugging
    Face computes them: ``cos(position * inv_freq) * attention_factor`` in float32."""
    inv_freq = jnp.asarray(np.array([f for f, _ in spec.ropes], np.float32))
    factor = jnp.asarray(np.array([a for _, a in spec.ropes], np.float32))[:, None, None]
    angles = positions.astype(jnp.float32)[None, :, None] * inv_freq[:, None, :]
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def embed_tokens(embed: Weight, tokens: jax.Array, spec: ModelSpec, dtype) -> jax.Array:
    x = take_rows(embed, tokens, dtype)
    if spec.embedding_scale != 1.0:
        # In the embedding dtype, as Hugging Face scales them (Gemma: sqrt(hidden)).
        x = x * jnp.asarray(np.float32(spec.embedding_scale)).astype(x.dtype)
    return x


def forward_step(
    weights: Weights,
    cache: KVState,
    inp: StepInputs,
    lora: LoraFactors | None = None,
    *,
    spec: ModelSpec,
    plan: StepPlan,
) -> tuple[jax.Array, jax.Array | None, KVState]:
    """One engine step: returns (logits ``[G, vocab]`` float32, final hidden ``[T, hidden]`` or None,
    the updated cache). ``lora`` holds the adapters' factors when ``plan.lora`` is set."""
    x = embed_tokens(weights.embed, inp.tokens, spec, jnp.dtype(spec.dtype))
    cos, sin = rope_tables(inp.positions, spec)
    projector = Projector.of(weights.layers, plan, inp)
    adapters = Adapters.of(plan, lora, inp)
    # On CPU a step with fewer (token, expert) rows than experts reads only its chosen experts.
    gather_rows = spec.num_experts if jax.default_backend() == "cpu" else 0
    pools = Pools.of(cache, spec, inp, plan)

    def layer_step(carry, xs):
        x, kv, kvl, layer = carry
        lw, dense, (window, rope), pool, layer_mask = xs
        window = window if spec.windowed else 0  # Python 0: no window arithmetic at all

        def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            nonlocal kv, kvl
            out, kv, kvl = pools.attend(kv, kvl, layer, pool, window, q, k, v, lw.sinks)
            return out

        project, adapt = projector.at(lw, layer), adapters.at(layer, dense, layer_mask)
        x, _ = decoder_layer(
            x,
            lw,
            spec,
            cos[rope],
            sin[rope],
            project=project,
            attend=attend,
            adapt=adapt,
            project_experts=projector.experts_at(lw, layer, gather_rows) if spec.num_experts else None,
            live_rows=inp.live_tokens,
        )
        return (x, kv, kvl, layer + 1), None

    scanned = (
        projector.scanned(),
        adapters.dense,
        spec.layer_constants(),
        spec.pool_constants() if cache.local is not None else None,
        adapters.layer_masks,
    )
    carry = (x, dataclasses.replace(cache, local=None), cache.local, jnp.zeros((), jnp.int32))
    (x, kv, kvl, _), _ = lax.scan(layer_step, carry, scanned, unroll=plan.unroll_layers or 1)
    kv = dataclasses.replace(kv, local=kvl)

    x = rms_norm(x, weights.final_norm, spec.rms_norm_eps)
    head = weights.embed if weights.lm_head is None else weights.lm_head
    if plan.native and native_format(head) is not None:
        (logits,) = native_projections(x[inp.logit_rows], [head], jnp.zeros((), jnp.int32), inp.live_logits)
    else:
        logits = linear(x[inp.logit_rows], head)
    logits = apply_softcap(logits.astype(jnp.float32), spec.final_logit_softcap)
    hidden = x.astype(jnp.float32) if plan.return_hidden else None
    return logits, hidden, kv
