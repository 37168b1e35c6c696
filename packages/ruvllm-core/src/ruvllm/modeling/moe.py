"""A mixture of experts in place of the MLP: the router's choice (:func:`route`), the step's
(token, expert) pairs sorted into one group per expert (:func:`expert_groups`), and the weighted sum
back per token (:func:`moe_mlp`); the backend's ``project_experts`` multiplies each group by its own
expert's matrices."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ruvllm.modeling.arithmetic import _f32, gated_activation, namespace
from ruvllm.modeling.schema import LayerShape, LayerWeights

if TYPE_CHECKING:
    from ruvllm.modeling.layer import Project

# -- mixture of experts ------------------------------------------------------------------------------------

#: ``project_experts(x, group_sizes, group)``: for rows ``x [N, in]`` sorted by expert (the first
#: ``group_sizes[0]`` rows for expert 0, the next ``group_sizes[1]`` for expert 1, ...), each of
#: ``group``'s products (``("gate_proj", "up_proj")`` or ``("down_proj",)``) of a row with its own
#: expert's matrix (:data:`EXPERT_FIELDS`), ``[N, out]`` each, without bias.
ProjectExperts = Callable[[Any, Any, tuple[str, ...]], Sequence[Any]]


def fixed_order_sum(x: Any) -> Any:
    """``sum(x, axis=-1, keepdims=True)`` in one order whatever ``x``'s other dimensions: the row padded
    with zeros to a power of two and halved by elementwise adds (a library's reduction may pick its
    order from the whole shape: XLA's summed a router softmax of one row unlike one of 64)."""
    xp = namespace(x)
    n = x.shape[-1]
    width = 1 << max(0, n - 1).bit_length()
    if width != n:
        x = xp.concat([x, xp.zeros((*x.shape[:-1], width - n), dtype=x.dtype)], axis=-1)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


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
        return top / fixed_order_sum(top), experts
    if shape.routing != "softmax_topk":
        raise ValueError(f"unknown routing {shape.routing!r}")
    z = xp.exp(z - xp.max(z, axis=-1, keepdims=True))
    probs = z / fixed_order_sum(z)
    experts = xp.argsort(-probs, axis=-1, stable=True)[:, :k]
    weights = xp.take_along_axis(probs, experts, axis=-1)
    if shape.norm_topk_prob:
        weights = weights / fixed_order_sum(weights)
    return weights, experts


class ExpertGroups(NamedTuple):
    """A step's (token, slot) pairs sorted by chosen expert: the row of ``x`` each sorted pair reads,
    how many pairs each expert has, and where each pair went (to put the outputs back)."""

    rows: Any  # [T * k] token of each sorted pair
    sizes: Any  # [experts] int32
    inverse: Any  # [T * k] sorted position of pair (t, j) at t * k + j
    experts: Any  # [T * k] expert of each sorted pair (a padding pair's: the last one, in range)


def expert_groups(experts: Any, num_experts: int, live_rows: Any = None) -> ExpertGroups:
    """Group the ``[T, k]`` chosen experts by expert (stable: within a group, in token order). With
    ``live_rows``, tokens from that index on are padding: their pairs sort after every group and no
    group counts them, so no expert is read for them (the backend's products for those rows are never
    used); the live pairs' groups are the same as without the padding."""
    xp = namespace(experts)
    t, k = experts.shape
    if live_rows is not None:  # padding pairs take expert num_experts, past every group
        padding = xp.arange(t, dtype=xp.int32)[:, None] >= xp.astype(xp.asarray(live_rows), xp.int32)
        experts = xp.where(padding, xp.asarray(num_experts, dtype=experts.dtype), experts)
    flat = xp.reshape(experts, (-1,))
    order = xp.argsort(flat, stable=True)
    ids = xp.arange(num_experts, dtype=flat.dtype)
    sizes = xp.sum(xp.astype(flat[None, :] == ids[:, None], xp.int32), axis=1)
    chosen = xp.minimum(xp.take(flat, order, axis=0), xp.asarray(num_experts - 1, dtype=flat.dtype))
    return ExpertGroups(order // k, sizes, xp.argsort(order, stable=True), chosen)


def moe_mlp(
    h2: Any,
    lw: LayerWeights,
    shape: LayerShape,
    *,
    project: Project,
    project_experts: ProjectExperts,
    live_rows: Any = None,
) -> tuple[Any, Any, Any]:
    """A mixture of experts over ``h2 [T, hidden]``: the router's ``k`` experts per token, each
    expert's gated MLP over its group of tokens, and per token the weighted sum of its ``k`` outputs
    (in the router's order, so a row's sum does not depend on the batch). ``live_rows``: the count of
    real rows, padding after them; padding rows are routed to no expert (a decode step padded to its
    bucket reads only its live tokens' experts) and their output is not meaningful.
    Returns (output, router weights ``[T, k]``, experts ``[T, k]``)."""
    xp = namespace(h2)
    t, k = h2.shape[0], shape.experts_per_token
    (logits,) = project(h2, ("router",))
    if lw.router_bias is not None:
        logits = logits + lw.router_bias.astype(logits.dtype)
    weights, experts = route(logits, shape)
    groups = expert_groups(experts, shape.num_experts, live_rows)
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
