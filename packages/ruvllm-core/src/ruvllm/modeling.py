"""The decoder model, defined once: what a layer holds and what it computes, for every backend.

:mod:`ruvllm.architectures` says how each family's files name their tensors and which of a layer's
features it uses (the fields of :class:`~ruvllm.model_config.ModelConfig`); this module says what those
features are:

* the projections (:data:`PROJECTIONS`), which of them share an input (:data:`PROJECTION_GROUPS`),
  their shapes (:func:`projection_shape`) and canonical tensor names (:func:`projection_tensor`);
* the layer-weights schema (:data:`LAYER_TENSORS`, :class:`LayerWeights`): one field per tensor, the
  same names in every backend, present or not by the config;
* the arithmetic: RMSNorm, the activations (:data:`ACTIVATIONS`), rotate-half RoPE, logit soft-capping,
  and :func:`decoder_layer`, which strings them together around two callbacks, ``project`` (how a
  backend multiplies its weights: fused BLAS calls, quantized kernels, a TP shard) and ``attend`` (its
  KV cache and attention kernel). What a backend adds is how to compute, never what the model is.
* a mixture of experts in place of the MLP (:func:`route`, :func:`moe_mlp`): the router's choice,
  the step's (token, expert) pairs sorted into one group per expert, and the weighted sum back per
  token; a third callback, ``project_experts``, multiplies each group by its own expert's matrices
  (a loop over the chosen experts in NumPy, ``jax.lax.ragged_dot`` in JAX), so a step reads each
  chosen expert once whatever the number of its tokens.

The functions are written over the array API that NumPy and JAX share (``x.__array_namespace__()``),
so the NumPy backend, SONA's trainer and the jitted JAX step run the same lines. HF transformers stays
the independent oracle in the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import numpy as np

from ruvllm.model_config import ModelConfig

# -- projections -----------------------------------------------------------------------------------------

#: A decoder layer's projections in Hugging Face naming (the order adapters and kernels list them in).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: A mixture of experts' expert matrices (:class:`LayerWeights` fields, each ``[experts, out, in]``)
#: by the projection each expert's is; ``router`` is the ``[experts, hidden]`` router.
EXPERT_FIELDS = {"gate_proj": "expert_gate", "up_proj": "expert_up", "down_proj": "expert_down"}
#: Projections that multiply the same input, in layer order: a backend may fuse each group into one
#: product (one BLAS call, one quantization of the input).
PROJECTION_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("o_proj",),
    ("gate_proj", "up_proj"),
    ("down_proj",),
)
#: The projections with a bias when ``attention_bias`` (qwen2): the schema's field of each.
BIAS_FIELDS = {"q_proj": "q_bias", "k_proj": "k_bias", "v_proj": "v_bias"}


class LayerShape(Protocol):
    """What the layer's arithmetic reads of a model's configuration (:class:`ModelConfig` has it, and so
    does a backend's own hashable copy of it)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def attention_bias(self) -> bool: ...
    @property
    def qk_norm(self) -> bool: ...
    @property
    def output_norms(self) -> bool: ...
    @property
    def activation(self) -> str: ...
    @property
    def swiglu_alpha(self) -> float: ...
    @property
    def swiglu_limit(self) -> float: ...
    @property
    def o_proj_bias(self) -> bool: ...
    @property
    def attention_sinks(self) -> bool: ...
    @property
    def router_bias(self) -> bool: ...
    @property
    def expert_bias(self) -> bool: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def experts_per_token(self) -> int: ...
    @property
    def expert_intermediate_size(self) -> int: ...
    @property
    def routing(self) -> str: ...
    @property
    def norm_topk_prob(self) -> bool: ...


def projection_module(proj: str) -> str:
    """``self_attn`` or ``mlp``: where ``proj`` sits in a layer's canonical tensor names."""
    if proj in ATTENTION_PROJECTIONS:
        return "self_attn"
    if proj in MLP_PROJECTIONS:
        return "mlp"
    raise ValueError(f"unknown projection {proj!r} (known: {', '.join(PROJECTIONS)})")


def projection_tensor(layer: int, proj: str, kind: str = "weight") -> str:
    """Canonical name of projection ``proj``'s ``weight`` (or ``bias``) in decoder layer ``layer``."""
    return f"model.layers.{layer}.{projection_module(proj)}.{proj}.{kind}"


def projection_shape(shape: LayerShape, proj: str) -> tuple[int, int]:
    """``(out, in)`` of projection ``proj``: Hugging Face's ``[out, in]`` weight layout."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    h, i = shape.hidden_size, shape.intermediate_size
    shapes = {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }
    try:
        return shapes[proj]
    except KeyError:
        raise ValueError(f"unknown projection {proj!r} (known: {', '.join(PROJECTIONS)})") from None


# -- the layer-weights schema ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerTensor:
    """One tensor of a decoder layer: its :class:`LayerWeights` field, its canonical name after
    ``model.layers.{n}.``, its shape, and whether a model has it."""

    field: str
    suffix: str
    shape: Callable[[LayerShape], tuple[int, ...]]
    present: Callable[[LayerShape], bool] = lambda _s: True
    #: One tensor per expert (``suffix`` holds ``{e}``; ``shape`` is one expert's); the field stacks
    #: them on a leading expert axis.
    per_expert: bool = False

    def name(self, layer: int, expert: int | None = None) -> str:
        suffix = self.suffix.format(e=expert) if self.per_expert else self.suffix
        return f"model.layers.{layer}.{suffix}"

    def names(self, layer: int, shape: LayerShape) -> list[str]:
        """The tensor's canonical names in ``layer``: one, or one per expert in expert order."""
        if not self.per_expert:
            return [self.name(layer)]
        return [self.name(layer, e) for e in range(shape.num_experts)]


def _dense(s: LayerShape) -> bool:
    return not s.num_experts


def _moe(s: LayerShape) -> bool:
    return bool(s.num_experts)


def _proj(p: str) -> LayerTensor:
    present = _dense if p in MLP_PROJECTIONS else _always
    return LayerTensor(p, f"{projection_module(p)}.{p}.weight", lambda s: projection_shape(s, p), present)


def expert_shape(shape: LayerShape, proj: str) -> tuple[int, int]:
    """``(out, in)`` of one expert's ``proj`` (``gate_proj``, ``up_proj`` or ``down_proj``)."""
    h, i = shape.hidden_size, shape.expert_intermediate_size
    return (h, i) if proj == "down_proj" else (i, h)


def _expert(p: str) -> LayerTensor:
    return LayerTensor(EXPERT_FIELDS[p], f"mlp.experts.{{e}}.{p}.weight", lambda s: expert_shape(s, p), _moe, True)


def _expert_bias(p: str) -> LayerTensor:
    return LayerTensor(
        f"{EXPERT_FIELDS[p]}_bias",
        f"mlp.experts.{{e}}.{p}.bias",
        lambda s: expert_shape(s, p)[:1],
        lambda s: bool(s.num_experts and s.expert_bias),
        True,
    )


def _bias(p: str) -> LayerTensor:
    return LayerTensor(
        BIAS_FIELDS[p], f"self_attn.{p}.bias", lambda s: (projection_shape(s, p)[0],), lambda s: s.attention_bias
    )


def _norm(field_name: str, suffix: str, size: Callable[[LayerShape], int], when: Callable[[LayerShape], bool]):
    return LayerTensor(field_name, f"{suffix}.weight", lambda s: (size(s),), when)


def _hidden(s: LayerShape) -> int:
    return s.hidden_size


def _head(s: LayerShape) -> int:
    return s.head_dim


def _always(_s: LayerShape) -> bool:
    return True


def _qk_norm(s: LayerShape) -> bool:
    return s.qk_norm


def _output_norms(s: LayerShape) -> bool:
    return s.output_norms


#: Every tensor a decoder layer may hold, in :class:`LayerWeights` field order.
LAYER_TENSORS: tuple[LayerTensor, ...] = (
    _norm("input_norm", "input_layernorm", _hidden, _always),
    *(_proj(p) for p in ATTENTION_PROJECTIONS),
    _norm("post_attention_norm", "post_attention_layernorm", _hidden, _always),
    *(_proj(p) for p in MLP_PROJECTIONS),
    *(_bias(p) for p in BIAS_FIELDS),
    LayerTensor("router", "mlp.gate.weight", lambda s: (s.num_experts, s.hidden_size), _moe),
    *(_expert(p) for p in MLP_PROJECTIONS),
    LayerTensor("o_bias", "self_attn.o_proj.bias", lambda s: (s.hidden_size,), lambda s: s.o_proj_bias),
    LayerTensor("sinks", "self_attn.sinks", lambda s: (s.num_heads,), lambda s: s.attention_sinks),
    LayerTensor(
        "router_bias", "mlp.gate.bias", lambda s: (s.num_experts,), lambda s: bool(s.num_experts and s.router_bias)
    ),
    *(_expert_bias(p) for p in MLP_PROJECTIONS),
    _norm("q_norm", "self_attn.q_norm", _head, _qk_norm),
    _norm("k_norm", "self_attn.k_norm", _head, _qk_norm),
    _norm("attn_output_norm", "attn_output_norm", _hidden, _output_norms),
    _norm("mlp_output_norm", "mlp_output_norm", _hidden, _output_norms),
)
LAYER_FIELDS = {t.field: t for t in LAYER_TENSORS}


def layer_tensors(shape: LayerShape) -> Iterator[LayerTensor]:
    """The tensors a decoder layer of this model holds."""
    return (t for t in LAYER_TENSORS if t.present(shape))


#: The model's tensors outside its layers: canonical name -> shape (``lm_head`` only when untied).
def global_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    out = {
        "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
        "model.norm.weight": (cfg.hidden_size,),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return out


W = TypeVar("W")  # a projection's weight: an array, a quantized array, a shard...
A = TypeVar("A")  # a norm weight or bias: an array


@dataclass
class LayerWeights(Generic[W, A]):
    """One decoder layer's tensors under the schema's field names (None where the model has none).
    Backends fill it with their own array types; the JAX backend registers it as a pytree and stacks
    every leaf on a leading layer axis."""

    input_norm: A
    q_proj: W
    k_proj: W
    v_proj: W
    o_proj: W
    post_attention_norm: A
    #: The dense MLP (None in a mixture of experts).
    gate_proj: W | None = None
    up_proj: W | None = None
    down_proj: W | None = None
    q_bias: A | None = None
    k_bias: A | None = None
    v_bias: A | None = None
    #: ``[head_dim]`` RMSNorm weights of each head's query and key (``qk_norm``).
    q_norm: A | None = None
    k_norm: A | None = None
    #: RMSNorm weights of the attention and MLP outputs (``output_norms``).
    attn_output_norm: A | None = None
    mlp_output_norm: A | None = None
    #: A mixture of experts: the router ``[experts, hidden]`` and the experts' matrices, stacked
    #: ``[experts, out, in]`` (one expert's ``(out, in)`` is :func:`expert_shape`).
    router: W | None = None
    expert_gate: W | None = None
    expert_up: W | None = None
    expert_down: W | None = None
    #: gpt_oss: the o_proj bias ``[hidden]``, attention sinks ``[heads]`` (one logit per query head that
    #: joins its softmax; read by the backend's attention), the router's bias ``[experts]`` and the
    #: experts' biases ``[experts, out]``.
    o_bias: A | None = None
    sinks: A | None = None
    router_bias: A | None = None
    expert_gate_bias: A | None = None
    expert_up_bias: A | None = None
    expert_down_bias: A | None = None


def load_layer(
    shape: LayerShape,
    layer: int,
    tensor: Callable[[str, tuple[int, ...]], Any],
    stack: Callable[[list[Any]], Any] = np.stack,
) -> dict[str, Any]:
    """Each present field of decoder layer ``layer``: ``tensor(name, shape)`` for its canonical name
    and expected shape (the caller reads, checks and converts), per-expert tensors joined by
    ``stack`` in expert order; absent fields are None."""
    out: dict[str, Any] = {}
    for t in LAYER_TENSORS:
        if not t.present(shape):
            out[t.field] = None
        elif t.per_expert:
            out[t.field] = stack([tensor(name, t.shape(shape)) for name in t.names(layer, shape)])
        else:
            out[t.field] = tensor(t.name(layer), t.shape(shape))
    return out


# -- the arithmetic ----------------------------------------------------------------------------------------


def namespace(x: Any) -> Any:
    """The array module of ``x`` (numpy, jax.numpy); NumPy for anything without one."""
    get = getattr(x, "__array_namespace__", None)
    return get() if get is not None else np


@dataclass(frozen=True)
class Primitives:
    """The two elementwise functions the array API leaves out, and the mean of squares over the last
    axis (RMSNorm's), as an array library computes them best. The model's formulas above them are
    written once; a backend registers its library's own forms (:func:`register_primitives`), so its
    compiled step keeps the operations it always had, or one whose row sums keep one order whatever
    the number of rows."""

    sigmoid: Callable[[Any], Any]
    rsqrt: Callable[[Any], Any]
    mean_square: Callable[[Any], Any] | None = None  # mean of x*x over the last axis, kept; None: xp.mean
    #: A tracing compiler (MLX's ``mx.compile``) :func:`decoder_layer` runs its elementwise chains
    #: through (RMSNorm, RoPE, the gated activation: each one fused call); None: run as written.
    compile: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None


def _np_sigmoid(g: Any) -> Any:
    # Through tanh, so a large |g| cannot overflow an exp.
    return 0.5 + 0.5 * namespace(g).tanh(0.5 * g)


def _np_rsqrt(x: Any) -> Any:
    return 1.0 / namespace(x).sqrt(x)


_GENERIC = Primitives(_np_sigmoid, _np_rsqrt)
_PRIMITIVES: dict[str, Primitives] = {}


def register_primitives(
    xp: Any,
    *,
    sigmoid: Callable[[Any], Any],
    rsqrt: Callable[[Any], Any],
    mean_square: Callable[[Any], Any] | None = None,
    compile: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> None:
    """Use ``sigmoid``, ``rsqrt`` and ``mean_square`` (the mean of ``x * x`` over the last axis, kept;
    default the library's mean of the squares) for arrays of the array module ``xp`` (e.g.
    ``jax.numpy``), and ``compile`` for :func:`decoder_layer`'s elementwise chains (a library that
    runs operation by operation, as MLX does, gains by fusing them)."""
    _PRIMITIVES[xp.__name__] = Primitives(sigmoid, rsqrt, mean_square, compile)


def primitives(xp: Any) -> Primitives:
    return _PRIMITIVES.get(xp.__name__, _GENERIC)


def _f32(x: Any, xp: Any) -> Any:
    return x if x.dtype == xp.float32 else x.astype(xp.float32)


def inv_rms(x: Any, eps: float) -> Any:
    """``1 / sqrt(mean(x^2) + eps)`` over the last axis (kept), in float32."""
    xp = namespace(x)
    xf = _f32(x, xp)
    prim = primitives(xp)
    mean = prim.mean_square(xf) if prim.mean_square is not None else xp.mean(xf * xf, axis=-1, keepdims=True)
    return prim.rsqrt(mean + eps)


def rms_norm(x: Any, w: Any, eps: float) -> Any:
    """RMSNorm over the last axis, computed in float32 and returned in ``x``'s dtype."""
    xp = namespace(x)
    xf = _f32(x, xp)
    y = xf * inv_rms(xf, eps) * _f32(w, xp)
    return y if y.dtype == x.dtype else y.astype(x.dtype)


def rms_norm_backward(x: np.ndarray, inv: np.ndarray, w: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """Gradient w.r.t. ``x`` of :func:`rms_norm` given the output gradient ``dy`` (``inv``: its
    :func:`inv_rms`)."""
    t = dy * w
    return inv * t - x * (inv**3) * (np.sum(x * t, axis=-1, keepdims=True) / x.shape[-1])


def silu(g: Any) -> Any:
    """``g * sigmoid(g)``."""
    return g * primitives(namespace(g)).sigmoid(g)


def silu_grad(g: np.ndarray) -> np.ndarray:
    s = _np_sigmoid(g)
    return s * (1.0 + g * (1.0 - s))


_GELU_C = float(np.sqrt(2.0 / np.pi))


def gelu_tanh(g: Any) -> Any:
    """GELU's tanh approximation (PyTorch's ``gelu(approximate="tanh")``, Gemma's ``gelu_pytorch_tanh``)."""
    xp = namespace(g)
    return g * (0.5 * (1.0 + xp.tanh(_GELU_C * (g + 0.044715 * (g * g * g)))))


#: The gated MLP's activation, by :attr:`ModelConfig.activation`.
ACTIVATIONS: dict[str, Callable[[Any], Any]] = {"silu": silu, "gelu_tanh": gelu_tanh}
#: Activations of ``gate`` and ``up`` together (not ``act(gate) * up``): see :func:`gated_activation`.
GATED_ACTIVATIONS = ("swiglu_oai",)
#: Every :attr:`ModelConfig.activation` :func:`gated_activation` computes.
ACTIVATION_NAMES = (*ACTIVATIONS, *GATED_ACTIVATIONS)


def gated_activation(gate: Any, up: Any, shape: LayerShape) -> Any:
    """The gated MLP's middle: ``act(gate) * up``, or gpt_oss's ``swiglu_oai`` (OpenAI's reference:
    gate clamped above and up on both sides at ``swiglu_limit``, ``(up + 1) * gate * sigmoid(alpha *
    gate)``)."""
    if shape.activation == "swiglu_oai":
        xp = namespace(gate)
        limit = shape.swiglu_limit
        gate = xp.minimum(gate, limit)
        up = xp.clip(up, -limit, limit)
        glu = gate * primitives(xp).sigmoid(gate * shape.swiglu_alpha)
        return (up + 1) * glu
    return ACTIVATIONS[shape.activation](gate) * up


def apply_rope(x: Any, cos: Any, sin: Any) -> Any:
    """Rotate-half RoPE (the Hugging Face layout) of ``x [T, heads, head_dim]`` with ``cos``/``sin``
    ``[T, head_dim // 2]`` (a scaled RoPE's attention factor already in both); float32 arithmetic,
    returned in ``x``'s dtype."""
    xp = namespace(x)
    half = x.shape[-1] // 2
    x1, x2 = _f32(x[..., :half], xp), _f32(x[..., half:], xp)
    c, s = cos[:, None, :], sin[:, None, :]
    y = xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return y if y.dtype == x.dtype else y.astype(x.dtype)


def apply_rope_transpose(g: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The transpose of :func:`apply_rope` (rotation by minus the angle): maps gradients back."""
    half = g.shape[-1] // 2
    g1, g2 = g[..., :half], g[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([g1 * c + g2 * s, g2 * c - g1 * s], axis=-1)


def softcap(logits: Any, cap: float | None) -> Any:
    """Logit soft-capping ``cap * tanh(logits / cap)`` (Gemma); identity when ``cap`` is None."""
    if not cap:
        return logits
    return cap * namespace(logits).tanh(logits / cap)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def attention_mask(n: int, end: int, start: int, window: int = 0) -> np.ndarray | None:
    """Keys ``0 .. end`` that queries at positions ``start .. start + n`` may not see (``[n, end]``,
    True: masked): later positions, and with a ``window`` those at or before ``q - window``. None
    when every query sees every key."""
    q_pos = (start + np.arange(n))[:, None]
    keys = np.arange(end)[None, :]
    masked = keys > q_pos if end > start + 1 else None  # a lone last query sees every key
    if window and start + n - window > 0:
        out_of_window = keys <= q_pos - window
        masked = out_of_window if masked is None else masked | out_of_window
    return masked


def group_queries(q: np.ndarray, kv_heads: int, scale: float) -> np.ndarray:
    """``q [n, H, hd]`` times ``scale`` with the query heads that share a KV head stacked as rows:
    ``[KV, G * n, hd]``, so each attention product is one matmul per KV head."""
    n, heads, hd = q.shape
    qg = (q * np.float32(scale)).reshape(n, kv_heads, heads // kv_heads, hd)
    return qg.transpose(1, 2, 0, 3).reshape(kv_heads, -1, hd)


def ungroup(out: np.ndarray, n: int) -> np.ndarray:
    """``[KV, G * n, hd]`` back to the tokens' rows ``[n, H * hd]``."""
    kv_heads, rows, hd = out.shape
    return out.reshape(kv_heads, rows // n, n, hd).transpose(2, 0, 1, 3).reshape(n, -1)


def grouped_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, masked: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention with grouped-query heads in NumPy: ``q [n, H, hd]`` over ``k, v [end, KV, hd]``
    -> (output ``[n, H * hd]``, probabilities ``[KV, G, n, end]``)."""
    n, kv_heads = q.shape[0], k.shape[1]
    qg = group_queries(q, kv_heads, scale)
    scores = (qg @ k.transpose(1, 2, 0)).reshape(kv_heads, -1, n, k.shape[0])
    if masked is not None:
        scores[..., masked] = -np.inf
    probs = softmax_(scores)
    return ungroup(probs.reshape(kv_heads, qg.shape[1], -1) @ v.transpose(1, 0, 2), n), probs


def softmax_(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in place."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


# -- mixture of experts ------------------------------------------------------------------------------------

#: ``project_experts(x, group_sizes, group)``: for rows ``x [N, in]`` sorted by expert (the first
#: ``group_sizes[0]`` rows for expert 0, the next ``group_sizes[1]`` for expert 1, ...), each of
#: ``group``'s products (``("gate_proj", "up_proj")`` or ``("down_proj",)``) of a row with its own
#: expert's matrix (:data:`EXPERT_FIELDS`), ``[N, out]`` each, without bias.
ProjectExperts = Callable[[Any, Any, tuple[str, ...]], Sequence[Any]]


def route(logits: Any, shape: LayerShape) -> tuple[Any, Any]:
    """The router's choice for router logits ``[T, experts]``: (weights ``[T, k]`` float32, experts
    ``[T, k]``), the experts by falling weight. ``softmax_topk`` (qwen3_moe, mixtral): a float32
    softmax over every expert, the k largest (among equal ones the lower index first: a stable sort,
    the same on every backend), renormalised to sum 1 when ``norm_topk_prob``; ``topk_softmax``
    (gpt_oss): the k largest logits (same rule), a softmax over them."""
    xp = namespace(logits)
    k = shape.experts_per_token
    z = _f32(logits, xp)
    if shape.routing == "topk_softmax":  # gpt_oss: the k largest logits, then a softmax over them
        experts = xp.argsort(-z, axis=-1, stable=True)[:, :k]
        top = xp.take_along_axis(z, experts, axis=-1)
        top = xp.exp(top - xp.max(top, axis=-1, keepdims=True))
        return top / xp.sum(top, axis=-1, keepdims=True), experts
    if shape.routing != "softmax_topk":
        raise ValueError(f"unknown routing {shape.routing!r}")
    z = xp.exp(z - xp.max(z, axis=-1, keepdims=True))
    probs = z / xp.sum(z, axis=-1, keepdims=True)
    experts = xp.argsort(-probs, axis=-1, stable=True)[:, :k]
    weights = xp.take_along_axis(probs, experts, axis=-1)
    if shape.norm_topk_prob:
        weights = weights / xp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


class ExpertGroups(NamedTuple):
    """A step's (token, slot) pairs sorted by chosen expert: the row of ``x`` each sorted pair reads,
    how many pairs each expert has, and where each pair went (to put the outputs back)."""

    rows: Any  # [T * k] token of each sorted pair
    sizes: Any  # [experts] int32
    inverse: Any  # [T * k] sorted position of pair (t, j) at t * k + j
    experts: Any  # [T * k] expert of each sorted pair


def expert_groups(experts: Any, num_experts: int) -> ExpertGroups:
    """Group the ``[T, k]`` chosen experts by expert (stable: within a group, in token order)."""
    xp = namespace(experts)
    k = experts.shape[1]
    flat = xp.reshape(experts, (-1,))
    order = xp.argsort(flat, stable=True)
    ids = xp.arange(num_experts, dtype=flat.dtype)
    sizes = xp.sum(xp.astype(flat[None, :] == ids[:, None], xp.int32), axis=1)
    return ExpertGroups(order // k, sizes, xp.argsort(order, stable=True), xp.take(flat, order, axis=0))


def moe_mlp(
    h2: Any, lw: LayerWeights, shape: LayerShape, *, project: Project, project_experts: ProjectExperts
) -> tuple[Any, Any, Any]:
    """A mixture of experts over ``h2 [T, hidden]``: the router's ``k`` experts per token, each
    expert's gated MLP over its group of tokens, and per token the weighted sum of its ``k`` outputs
    (in the router's order, so a row's sum does not depend on the batch). Returns (output, router
    weights ``[T, k]``, experts ``[T, k]``)."""
    xp = namespace(h2)
    t, k = h2.shape[0], shape.experts_per_token
    (logits,) = project(h2, ("router",))
    if lw.router_bias is not None:
        logits = logits + lw.router_bias.astype(logits.dtype)
    weights, experts = route(logits, shape)
    groups = expert_groups(experts, shape.num_experts)
    x = xp.take(h2, groups.rows, axis=0)
    gate, up = project_experts(x, groups.sizes, ("gate_proj", "up_proj"))

    def bias(y: Any, b: Any) -> Any:  # each row's own expert's bias
        return y if b is None else y + xp.take(b, groups.experts, axis=0).astype(y.dtype)

    gate, up = bias(gate, lw.expert_gate_bias), bias(up, lw.expert_up_bias)
    (down,) = project_experts(gated_activation(gate, up, shape), groups.sizes, ("down_proj",))
    down = bias(down, lw.expert_down_bias)
    down = xp.reshape(xp.take(down, groups.inverse, axis=0), (t, k, down.shape[-1]))
    w = weights if weights.dtype == down.dtype else weights.astype(down.dtype)
    out = down[:, 0] * w[:, 0:1]
    for j in range(1, k):
        out = out + down[:, j] * w[:, j : j + 1]
    return out, weights, experts


# -- the layer -------------------------------------------------------------------------------------------


class LayerActivations(NamedTuple):
    """What a layer computed on the way (calibration reads the projections' inputs; SONA's backward
    reads them all). Unused ones cost nothing under ``jax.jit``."""

    h: Any  # input_layernorm(x): the q/k/v input [T, hidden]
    q: Any  # roped queries [T, heads, head_dim]
    k: Any  # roped keys [T, kv_heads, head_dim]
    v: Any  # values [T, kv_heads, head_dim]
    a: Any  # attention output, the o_proj input [T, heads * head_dim]
    mid: Any  # the residual stream after attention [T, hidden]
    h2: Any  # post_attention_layernorm(mid): the gate/up input
    gate: Any  # None in a mixture of experts (their inputs are h2's rows)
    up: Any
    act: Any  # activation(gate) * up: the down_proj input


#: ``project(x, group)``: the group's projections of ``x`` (one of :data:`PROJECTION_GROUPS`), without bias;
#: ``attend(q, k, v)``: attention output ``[T, heads, head_dim]`` (or ``[T, heads * head_dim]``) of the
#: roped queries and keys; ``adapt(y, x, proj)``: ``y`` plus adapters' updates of ``proj`` for input ``x``.
Project = Callable[[Any, tuple[str, ...]], Sequence[Any]]
Attend = Callable[[Any, Any, Any], Any]
Adapt = Callable[[Any, Any, str], Any]


def _no_adapt(y: Any, _x: Any, _proj: str) -> Any:
    return y


#: (array module, eps, id(shape)) -> (shape, its compiled norm, rope, activation); the shape is kept
#: so that its id is not reused while the entry lives.
_COMPILED_CHAINS: dict[tuple[str, float, int], tuple[Any, ...]] = {}


def _elementwise(xp: Any, eps: float, shape: LayerShape) -> tuple[Callable[..., Any], ...]:
    """:func:`decoder_layer`'s RMSNorm ``(x, w)``, RoPE ``(x, cos, sin)`` and gated activation
    ``(gate, up)``, through the array library's registered compiler where it has one."""
    compile_ = primitives(xp).compile
    if compile_ is None:
        return (lambda x, w: rms_norm(x, w, eps)), apply_rope, (lambda g, u: gated_activation(g, u, shape))
    key = (xp.__name__, eps, id(shape))
    chains = _COMPILED_CHAINS.get(key)
    if chains is None or chains[0] is not shape:
        chains = _COMPILED_CHAINS[key] = (
            shape,
            compile_(lambda x, w: rms_norm(x, w, eps)),
            compile_(apply_rope),
            compile_(lambda g, u: gated_activation(g, u, shape)),
        )
    return chains[1:]


def decoder_layer(
    x: Any,
    lw: LayerWeights,
    shape: LayerShape,
    cos: Any,
    sin: Any,
    *,
    project: Project,
    attend: Attend,
    adapt: Adapt = _no_adapt,
    project_experts: ProjectExperts | None = None,
) -> tuple[Any, LayerActivations]:
    """One pre-norm decoder layer over ``x [T, hidden]`` with RoPE ``cos``/``sin`` ``[T, head_dim // 2]``:
    attention (biases, QK-norm and output norms where the model has them) and the gated MLP, or the
    mixture of experts (``project_experts`` multiplies its groups; ``project`` gets the ``router``),
    each added to the residual stream. Returns the new residual stream and the layer's activations."""
    t = x.shape[0]
    nh, nkv, hd, eps = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.rms_norm_eps
    norm, rope, activation = _elementwise(namespace(x), eps, shape)
    h = norm(x, lw.input_norm)
    q, k, v = project(h, PROJECTION_GROUPS[0])
    if shape.attention_bias:
        q, k, v = q + lw.q_bias.astype(q.dtype), k + lw.k_bias.astype(k.dtype), v + lw.v_bias.astype(v.dtype)
    q, k, v = adapt(q, h, "q_proj"), adapt(k, h, "k_proj"), adapt(v, h, "v_proj")
    q, k, v = q.reshape(t, nh, hd), k.reshape(t, nkv, hd), v.reshape(t, nkv, hd)
    if shape.qk_norm:  # per head, before RoPE
        q, k = norm(q, lw.q_norm), norm(k, lw.k_norm)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    a = attend(q, k, v).reshape(t, nh * hd)
    (o,) = project(a, PROJECTION_GROUPS[1])
    if lw.o_bias is not None:  # present exactly when the model has one (o_proj_bias)
        o = o + lw.o_bias.astype(o.dtype)
    o = adapt(o, a, "o_proj")
    if shape.output_norms:
        o = norm(o, lw.attn_output_norm)
    mid = x + o
    h2 = norm(mid, lw.post_attention_norm)
    if shape.num_experts:
        if project_experts is None:
            raise ValueError("a mixture-of-experts layer needs project_experts")
        down, _, _ = moe_mlp(h2, lw, shape, project=project, project_experts=project_experts)
        if shape.output_norms:
            down = norm(down, lw.mlp_output_norm)
        return mid + down, LayerActivations(h, q, k, v, a, mid, h2, None, None, None)
    gate, up = project(h2, PROJECTION_GROUPS[2])
    gate, up = adapt(gate, h2, "gate_proj"), adapt(up, h2, "up_proj")
    act = activation(gate, up)
    (down,) = project(act, PROJECTION_GROUPS[3])
    down = adapt(down, act, "down_proj")
    if shape.output_norms:
        down = norm(down, lw.mlp_output_norm)
    return mid + down, LayerActivations(h, q, k, v, a, mid, h2, gate, up, act)
