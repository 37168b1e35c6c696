"""The decoder layer (:func:`decoder_layer`): the arithmetic strung together around the backend's
callbacks, ``project``, ``attend``, ``adapt`` and, for a mixture of experts, ``project_experts``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ruvllm.modeling.arithmetic import apply_rope, gated_activation, namespace, primitives, rms_norm
from ruvllm.modeling.moe import ProjectExperts, moe_mlp
from ruvllm.modeling.schema import PROJECTION_GROUPS, LayerShape, LayerWeights

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
    live_rows: Any = None,
) -> tuple[Any, LayerActivations]:
    """One pre-norm decoder layer over ``x [T, hidden]`` with RoPE ``cos``/``sin`` ``[T, head_dim // 2]``:
    attention (biases, QK-norm and output norms where the model has them) and the gated MLP, or the
    mixture of experts (``project_experts`` multiplies its groups; ``project`` gets the ``router``),
    each added to the residual stream. ``live_rows``: the count of real rows of ``x`` (padding after),
    so the mixture of experts routes no padding row. Returns the new residual stream and the layer's
    activations."""
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
        down, _, _ = moe_mlp(h2, lw, shape, project=project, project_experts=project_experts, live_rows=live_rows)
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
