"""The forward step's arguments: the model's static description (:class:`ModelSpec`), its weights
(:class:`Weights`, whose layers are :class:`ruvllm.modeling.LayerWeights` stacked on a leading layer
axis), the static shape of one step (:class:`StepPlan`, :class:`LoraPlan`) and its host-prepared
inputs (:class:`StepInputs`), read by :func:`ruvllm_jax.model.forward_step`."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ruvllm.errors import BackendError
from ruvllm.model_config import ModelConfig
from ruvllm.modeling import ACTIVATION_NAMES, LayerWeights, projection_shape
from ruvllm_jax.quant import Weight, weight_nbytes


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

    def decode_nbytes(self) -> int:
        """Bytes of these weights one decode token reads: all but an untied embedding, of which it
        reads one row (a tied one is the output projection too, read whole)."""
        skip = 0 if self.lm_head is None else weight_nbytes(self.embed)
        return weight_nbytes(self) - skip


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
    #: Run the quantized products (w8a8, w4a8) in the native CPU kernels (:mod:`ruvllm_jax.native`):
    #: the runner sets it for CPU steps once the kernels are loaded (w8a8: small steps only, see
    #: :func:`ruvllm_jax.step_shapes.runs_native`).
    native: bool = False
    #: Run the attention in the native CPU kernels: every step of a model whose kernels are loaded,
    #: whatever its size, so that a sequence's attention is the same arithmetic in a step of any row
    #: count (w8a8 steps past :data:`~ruvllm_jax.step_shapes.NATIVE_MAX_TOKENS` tokens multiply in
    #: XLA's exact integer GEMM but still attend natively).
    native_attention: bool = False
    #: Run the layers unrolled instead of under ``lax.scan``. Scanned, each layer's weights are a
    #: dynamic slice of the stacked arrays, and XLA on CUDA copies that slice out before the layer's
    #: matrix products (each weight byte read twice and written once per step); unrolled, the slices
    #: are static and the products read the weights in place. The runner sets it on CUDA.
    unroll_layers: bool = False
    #: Parts each decoding sequence's keys are cut into by the Pallas decode kernel (flash decoding,
    #: :func:`ruvllm_jax.step_shapes.decode_splits`); 1 on CPU and in XLA's attention.
    decode_splits: int = 1


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


#: Steps of at most this many tokens apply adapters through the native kernel (each token times its own
#: adapter's factors); longer ones (prompt chunks, mostly one adapter) through XLA's dense products.
NATIVE_LORA_MAX_TOKENS = 256


def gathers_lora(native: bool, num_tokens: int) -> bool:
    """A step of this kind applies adapters through the native kernel (the runner gathers its factors)."""
    return native and num_tokens <= NATIVE_LORA_MAX_TOKENS


def native_lora(plan: StepPlan) -> bool:
    """The step applies its adapters through the native kernel (its factors come gathered)."""
    return plan.lora is not None and not plan.lora.weighted and gathers_lora(plan.native, plan.num_tokens)
