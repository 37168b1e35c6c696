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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ruvllm.errors import BackendError
from ruvllm.model_config import ModelConfig
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
from ruvllm_jax import native, row_sums
from ruvllm_jax.attention import paged_attention, window_start
from ruvllm_jax.kv_state import (  # noqa: F401 (the KV state's names stay importable from here)
    KV_SCALE_GROUP,
    NATIVE_KV_DTYPES,
    KVState,
    dequantize_kv,
    kv_scale_groups,
    quantize_kv,
    write_kv,
)
from ruvllm_jax.quant import QuantArray, Weight, linear, take_rows

# XLA's own sigmoid (SiLU) and rsqrt (RMSNorm) for the model's formulas: the ops the step always ran;
# RMSNorm's mean in a fixed order, so a row's norm does not depend on the step's row count.
register_primitives(jnp, sigmoid=jax.nn.sigmoid, rsqrt=lax.rsqrt, mean_square=row_sums.mean_square)


def bucket(n: int) -> int:
    """Padded size for ``n`` (powers of two), so a few compiled shapes serve every batch."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


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
    attention_bias: bool
    tie_word_embeddings: bool
    activation: str
    qk_norm: bool
    output_norms: bool
    embedding_scale: float
    #: Multiplies the attention scores (``head_dim ** -0.5`` unless the model says otherwise).
    attention_scale: float
    #: Per layer: sliding window (0: global) and index into ``ropes``.
    layer_windows: tuple[int, ...]
    layer_ropes: tuple[int, ...]
    #: The distinct RoPEs: (inverse frequencies ``[head_dim // 2]`` as float32 values, attention factor),
    #: computed on the host by :class:`ruvllm.model_config.Rope`.
    ropes: tuple[tuple[tuple[float, ...], float], ...]
    final_logit_softcap: float | None
    dtype: str = "float32"
    #: The windowed layers of a model that interleaves them with global ones
    #: (:attr:`ModelConfig.local_layers`): a hybrid cache keeps their K/V in a pool of their own.
    local_layers: tuple[int, ...] = ()
    #: A mixture of experts (:class:`ModelConfig`'s fields of the same names; 0: the dense MLP).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    routing: str = "softmax_topk"
    norm_topk_prob: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    #: gpt_oss: the o_proj bias, attention sinks (reference attention only), its clamped SwiGLU.
    o_proj_bias: bool = False
    attention_sinks: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype: str = "float32") -> ModelSpec:
        if cfg.activation not in ACTIVATION_NAMES:
            raise BackendError(
                f"jax backend: activation {cfg.activation!r} is not implemented (known: {', '.join(ACTIVATION_NAMES)})"
            )
        layer_ropes = [cfg.layer_rope(layer) for layer in range(cfg.num_layers)]
        distinct = list(dict.fromkeys(layer_ropes))
        ropes = tuple(
            (tuple(float(f) for f in r.inv_freq(cfg.head_dim).astype(np.float32)), float(r.attention_factor))
            for r in distinct
        )
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            attention_bias=cfg.attention_bias,
            tie_word_embeddings=cfg.tie_word_embeddings,
            activation=cfg.activation,
            qk_norm=cfg.qk_norm,
            output_norms=cfg.output_norms,
            embedding_scale=float(cfg.embedding_scale),
            attention_scale=float(cfg.attention_scale),
            layer_windows=tuple(cfg.layer_window(layer) for layer in range(cfg.num_layers)),
            layer_ropes=tuple(distinct.index(r) for r in layer_ropes),
            ropes=ropes,
            final_logit_softcap=cfg.final_logit_softcap,
            dtype=dtype,
            local_layers=tuple(cfg.local_layers),
            num_experts=cfg.num_experts,
            experts_per_token=cfg.experts_per_token,
            expert_intermediate_size=cfg.expert_intermediate_size,
            routing=cfg.routing,
            norm_topk_prob=cfg.norm_topk_prob,
            router_bias=cfg.router_bias,
            expert_bias=cfg.expert_bias,
            o_proj_bias=cfg.o_proj_bias,
            attention_sinks=cfg.attention_sinks,
            swiglu_alpha=cfg.swiglu_alpha,
            swiglu_limit=cfg.swiglu_limit,
        )

    @property
    def windowed(self) -> bool:
        return any(self.layer_windows)

    def layer_constants(self) -> tuple[jax.Array, jax.Array]:
        """Scanned with the layers: each layer's window and RoPE index (int32 ``[layers]``)."""
        return jnp.asarray(self.layer_windows, jnp.int32), jnp.asarray(self.layer_ropes, jnp.int32)

    def pool_constants(self) -> tuple[jax.Array, jax.Array]:
        """Scanned with the layers of a step on a hybrid cache: whether each layer is windowed (its
        K/V in the windowed pool) and its index in its pool (int32 ``[layers]``)."""
        local = [layer in self.local_layers for layer in range(self.num_layers)]
        index = [sum(1 for j in range(layer) if local[j] == local[layer]) for layer in range(self.num_layers)]
        return jnp.asarray(local, jnp.bool_), jnp.asarray(index, jnp.int32)

    def projection_shape(self, proj: str) -> tuple[int, int]:
        """``(out, in)`` of projection ``proj`` (one of :data:`PROJECTIONS`)."""
        return projection_shape(self, proj)


#: One decoder layer's weights (:class:`ruvllm.modeling.LayerWeights`, the schema every backend
#: shares); in :class:`Weights` every leaf has a leading layer axis.
jax.tree_util.register_dataclass(LayerWeights)


@jax.tree_util.register_dataclass
@dataclass
class Weights:
    embed: Weight
    layers: LayerWeights
    final_norm: jax.Array
    #: None when the output projection is tied to ``embed``.
    lm_head: Weight | None = None


@dataclass(frozen=True)
class LoraPlan:
    """The static shape of a step's adapters: slot count and rank (both buckets) and the
    projections any of them adapts (in :data:`PROJECTIONS` order)."""

    slots: int
    rank: int
    projections: tuple[str, ...]
    #: How tokens pick their adapters: 0, each token its slot (``StepInputs.lora_slot``); 1, each token
    #: a weight per slot (``StepInputs.lora_weight`` ``[T, S]``: adapter mixes, X-LoRA); 2, a weight
    #: per layer, projection and slot (``[layers, projections, T, S]``: X-LoRA's layerwise scalings).
    weighted: int = 0


#: A step's adapter factors: projection -> one ``(A [layers, r, in], B [layers, out, r])`` per slot,
#: float32, ``B`` already multiplied by the adapter's scale.
LoraFactors = dict[str, tuple[tuple[jax.Array, jax.Array], ...]]


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
    #: None: no sequence of the step has an adapter, and the step contains no LoRA operation.
    lora: LoraPlan | None = None
    #: Run the quantized products (w8a8, w4a8) and decode attention in the native CPU kernels
    #: (:mod:`ruvllm_jax.native`): the runner sets it for CPU steps once the kernels are loaded.
    native: bool = False
    #: Run the layers unrolled instead of under ``lax.scan``. Scanned, each layer's weights are a
    #: dynamic slice of the stacked arrays, and XLA on CUDA copies that slice out before the layer's
    #: matrix products (each weight byte read twice and written once per step); unrolled, the slices
    #: are static and the products read the weights in place. The runner sets it on CUDA.
    unroll_layers: bool = False


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
    lora_slot: jax.Array | None = None  # [T] adapter slot of each token, -1 for none (steps with adapters)
    #: Steps whose ``LoraPlan.weighted`` is set: each token's weight per adapter slot (see there).
    lora_weight: jax.Array | None = None
    #: A hybrid cache's windowed pool: each token's block there, and the sequences' tables in it.
    local_write_block: jax.Array | None = None  # [T]
    decode_local_tables: jax.Array | None = None  # [Sd, Bd]
    prefill_local_tables: jax.Array | None = None  # [Sp, Bp]
    #: A two-tier cache: each token's float slot (hot_blocks: none), and per table entry the slot that
    #: holds the block in float (-1: read its int8 codes); ``local_*`` for a hybrid cache's second pool.
    hot_write: jax.Array | None = None  # [T]
    decode_hot_tables: jax.Array | None = None  # [Sd, Bd]
    prefill_hot_tables: jax.Array | None = None  # [Sp, Bp]
    local_hot_write: jax.Array | None = None
    decode_local_hot_tables: jax.Array | None = None
    prefill_local_hot_tables: jax.Array | None = None
    #: Real tokens and real logit rows: they come first, padding after (the native kernels skip it).
    live_tokens: jax.Array | None = None  # [] int32
    live_logits: jax.Array | None = None  # [] int32


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
    native_attention = plan.native and sinks is None
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


def _lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, mask: jax.Array) -> jax.Array:
    """``((x @ a.T) * mask) @ b.T`` in float32 at full precision: the factors are small, and a
    reduced-precision pass (TF32, bfloat16) would blur an update that may be tiny next to ``W``."""
    xa = jnp.einsum("ti,ki->tk", x.astype(jnp.float32), a, precision=lax.Precision.HIGHEST) * mask
    return jnp.einsum("tk,ok->to", xa, b, precision=lax.Precision.HIGHEST)


#: Steps of at most this many tokens apply adapters through the native kernel (each token times its own
#: adapter's factors); longer ones (prompt chunks, mostly one adapter) through XLA's dense products.
NATIVE_LORA_MAX_TOKENS = 256


def gathers_lora(native: bool, num_tokens: int) -> bool:
    """A step of this kind applies adapters through the native kernel (the runner gathers its factors)."""
    return native and num_tokens <= NATIVE_LORA_MAX_TOKENS


def native_lora(plan: StepPlan) -> bool:
    """The step applies its adapters through the native kernel (its factors come gathered)."""
    return plan.lora is not None and not plan.lora.weighted and gathers_lora(plan.native, plan.num_tokens)


#: Projections that share one input, so one native call quantizes the input once for all of them.
_NATIVE_FIELDS = tuple(p for g in PROJECTION_GROUPS for p in g)


def _native_format(w: object) -> str | None:
    """``w8a8`` or ``wxa8`` for the quantized forms the native kernels multiply, else None. The k-quants
    count as ``wxa8`` (one call takes both) when they are in the panel layout, the only one their
    kernel reads."""
    if not isinstance(w, QuantArray) or w.act_bits != 8:
        return None
    if w.sub_group:
        return "wxa8" if w.panel else None
    if w.wxa8 and w.offset is None and w.zero_point != 1 << (w.bits - 1):
        return None  # the kernels' symmetric form is code - 2^(bits-1)
    return "wxa8" if w.wxa8 else "w8a8"


def _native_projections(
    x: jax.Array, mats: list[QuantArray], layer: jax.Array, live: jax.Array | None = None
) -> list[jax.Array]:
    """``x @ W.T`` for each (stacked ``[layers, out, in]`` or plain) matrix of one group, at ``layer``,
    in one native call that quantizes ``x`` once (a w8a8 group shares its smoothing factors, so
    ``mats[0]``'s serve all). ``live``: rows of ``x`` that are real; the rest (padding) come out 0."""
    lead, cols = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, cols)
    if live is not None:  # the kernels read [layer, live rows] from their layer operand
        layer = jnp.stack([jnp.asarray(layer, jnp.int32).reshape(()), jnp.asarray(live, jnp.int32).reshape(())])
    if _native_format(mats[0]) == "wxa8":
        ys = [jnp.zeros(())] * len(mats)
        for panel in (False, True):  # one call per layout (loading gives a group one layout)
            idx = [i for i, m in enumerate(mats) if bool(m.panel) == panel]
            if not idx:
                continue
            if any(mats[i].sub_group for i in idx):  # k-quants: one call takes them and plain panels
                parts = [(m.quant, m.scale, m.offset, m.sub_scale, m.sub_offset) for m in (mats[i] for i in idx)]
                got = native.kxa8_group(x2, layer, [p if p[3] is not None else p[:3] for p in parts])
            else:
                got = native.wxa8_group(
                    x2, layer, [(mats[i].quant, mats[i].scale, mats[i].offset) for i in idx], panel=panel
                )
            for i, y in zip(idx, got, strict=True):
                ys[i] = y
    else:
        ys = native.w8a8_group(x2, layer, mats[0].in_scale, [(m.quant, m.scale) for m in mats])
    return [y.reshape(*lead, -1).astype(x.dtype) for y in ys]


@dataclass(frozen=True)
class _Projector:
    """How a step multiplies a layer's weights: XLA's products of the scanned layer's matrices, or the
    native kernels, which index the stacked (quantized) matrices by layer themselves, so native steps
    keep those out of the scanned operands (a scanned operand would be copied out layer by layer)."""

    stacked: LayerWeights
    native: bool
    live_tokens: jax.Array | None

    @classmethod
    def of(cls, layers: LayerWeights, plan: StepPlan, inp: StepInputs) -> _Projector:
        formats = {_native_format(getattr(layers, f)) for f in _NATIVE_FIELDS}
        return cls(layers, plan.native and len(formats) == 1 and None not in formats, inp.live_tokens)

    def scanned(self) -> LayerWeights:
        return dataclasses.replace(self.stacked, **{f: None for f in _NATIVE_FIELDS}) if self.native else self.stacked

    def at(self, lw: LayerWeights, layer: jax.Array):
        def project(h: jax.Array, group: tuple[str, ...]) -> list[jax.Array]:
            if self.native:
                return _native_projections(h, [getattr(self.stacked, p) for p in group], layer, self.live_tokens)
            return [linear(h, getattr(lw, p)) for p in group]

        return project


#: The experts' products: each row of ``x`` times its group's expert (``rhs [experts, out, in]``).
_EXPERT_DOT = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def project_experts(lw: LayerWeights, gather_rows: int = 0):
    """``project_experts`` of :func:`ruvllm.modeling.decoder_layer` for one layer's float experts:
    ``lax.ragged_dot_general``, or for steps of at most ``gather_rows`` (token, expert) rows each row
    times its own expert, gathered. (XLA:CPU expands the ragged product to every expert times every
    row, so a decode step would read all the experts; gathered, it reads the chosen ones.)"""

    def project(x: jax.Array, sizes: jax.Array, group: tuple[str, ...]) -> list[jax.Array]:
        rows = x.shape[0]
        gather = rows <= gather_rows  # static: the step's shape
        if gather:
            experts = jnp.arange(sizes.shape[0], dtype=jnp.int32)
            expert_of_row = jnp.repeat(experts, sizes, total_repeat_length=rows)
        out = []
        for p in group:
            w = getattr(lw, EXPERT_FIELDS[p])
            if gather:
                y = jnp.einsum("ri,roi->ro", x, w[expert_of_row].astype(x.dtype))
            else:
                y = lax.ragged_dot_general(x, w.astype(x.dtype), sizes.astype(jnp.int32), _EXPERT_DOT)
            out.append(y)
        return out

    return project


@dataclass(frozen=True)
class _Adapters:
    """How a step's tokens get their adapters' updates (:class:`LoraPlan`): none; the native kernel,
    each token times its own adapter's factors (handed over gathered); or dense products over every
    slot's factors, scanned with the layers, masked to each token's slot, weighted per token and slot
    (mixes), or per layer, projection, token and slot (X-LoRA's layerwise scalings, scanned too)."""

    plan: StepPlan
    inp: StepInputs
    native: dict[str, tuple[jax.Array, jax.Array]]
    dense: dict[str, tuple[jax.Array, jax.Array]] | None = None  # proj -> (A [L, S * r, in], B [L, out, S * r])
    mask: jax.Array | None = None  # [T, S * r]
    layer_masks: jax.Array | None = None  # [L, P, T, S * r]

    @classmethod
    def of(cls, plan: StepPlan, lora: LoraFactors | None, inp: StepInputs) -> _Adapters:
        if plan.lora is None:
            return cls(plan, inp, {})
        assert lora is not None and inp.lora_slot is not None, "a plan with adapters needs their factors and slots"
        if native_lora(plan):
            return cls(plan, inp, {p: slots[0] for p, slots in lora.items()})
        r = plan.lora.rank
        slot_of_column = jnp.arange(plan.lora.slots * r, dtype=jnp.int32) // r
        mask = layer_masks = None
        if plan.lora.weighted == 0:
            mask = (inp.lora_slot[:, None] == slot_of_column[None, :]).astype(jnp.float32)
        elif plan.lora.weighted == 1:
            mask = inp.lora_weight[:, slot_of_column]
        else:
            layer_masks = inp.lora_weight[..., slot_of_column]
        dense = {
            p: (jnp.concatenate([a for a, _ in slots], axis=1), jnp.concatenate([b for _, b in slots], axis=2))
            for p, slots in lora.items()
        }
        return cls(plan, inp, {}, dense, mask, layer_masks)

    def at(self, layer: jax.Array, dense: dict | None, layer_mask: jax.Array | None):
        """``adapt`` for one layer, given its slices of the scanned factors and masks."""

        def adapt(y: jax.Array, y_in: jax.Array, proj: str) -> jax.Array:
            # Python-level: projections no adapter touches (and steps without adapters) get no op.
            if proj in self.native:
                a, bt = self.native[proj]
                delta = native.lora_delta(y_in, layer, a, bt, self.inp.lora_slot, self.plan.lora.rank)
                return (y.astype(jnp.float32) + delta).astype(y.dtype)
            if dense is None or proj not in dense:
                return y
            a, b = dense[proj]
            m = self.mask if layer_mask is None else layer_mask[self.plan.lora.projections.index(proj)]
            return (y.astype(jnp.float32) + _lora_delta(y_in, a, b, m)).astype(y.dtype)

        return adapt


@dataclass(frozen=True)
class _Pools:
    """Where a layer's keys and values are written and read: the one pool, or a hybrid cache's two
    (each layer in its own pool at its index there; the write to the other pool points past its last
    block, so the scatter drops it), with a two-tier cache's float slots beside each."""

    inp: StepInputs
    plan: StepPlan
    scale: float
    local_inp: StepInputs | None

    @classmethod
    def of(cls, cache: KVState, spec: ModelSpec, inp: StepInputs, plan: StepPlan) -> _Pools:
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
    projector = _Projector.of(weights.layers, plan, inp)
    adapters = _Adapters.of(plan, lora, inp)
    # On CPU a step with fewer (token, expert) rows than experts reads only its chosen experts.
    gather_rows = spec.num_experts if jax.default_backend() == "cpu" else 0
    pools = _Pools.of(cache, spec, inp, plan)

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
            project_experts=project_experts(lw, gather_rows) if spec.num_experts else None,
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
    if plan.native and _native_format(head) is not None:
        (logits,) = _native_projections(x[inp.logit_rows], [head], jnp.zeros((), jnp.int32), inp.live_logits)
    else:
        logits = linear(x[inp.logit_rows], head)
    logits = apply_softcap(logits.astype(jnp.float32), spec.final_logit_softcap)
    hidden = x.astype(jnp.float32) if plan.return_hidden else None
    return logits, hidden, kv
