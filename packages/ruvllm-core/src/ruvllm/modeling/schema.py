"""What a decoder layer holds: its projections (:data:`PROJECTIONS`), which of them share an input
(:data:`PROJECTION_GROUPS`), their shapes and canonical tensor names, and the layer-weights schema
(:data:`LAYER_TENSORS`, :class:`LayerWeights`): one field per tensor, the same names in every backend,
present or not by the config."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

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
