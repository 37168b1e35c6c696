"""How a step multiplies a layer's weights, ``project`` and ``project_experts`` of
:func:`ruvllm.modeling.decoder_layer`: XLA's products of the scanned layer's matrices or the native
kernels' (w8a8, wxa8, the k-quants), and a mixture of experts' grouped products over the stacked
experts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from ruvllm.modeling import EXPERT_FIELDS, PROJECTION_GROUPS, LayerWeights
from ruvllm_jax import native
from ruvllm_jax.experts import native_experts, native_project_experts, router_product, xla_quantized_experts
from ruvllm_jax.quant import QuantArray, linear
from ruvllm_jax.split_stack import SplitStack, split_projection
from ruvllm_jax.step_types import StepInputs, StepPlan

#: Projections that share one input, so one native call quantizes the input once for all of them.
_NATIVE_FIELDS = tuple(p for g in PROJECTION_GROUPS for p in g)


def native_format(w: object) -> str | None:
    """``w8a8`` or ``wxa8`` for the quantized forms the native kernels multiply, else None. The k-quants
    count as ``wxa8`` (one call takes both) when they are in the panel layout, the only one their
    kernel reads."""
    if isinstance(w, SplitStack):  # its parts are k-quants in their own forms
        return "wxa8"
    if not isinstance(w, QuantArray) or w.act_bits != 8:
        return None
    if w.sub_group:  # the kernels' k-quant forms: with offsets and no zero point, or symmetric
        symmetric_ok = w.offset is None and w.zero_point == 1 << (w.bits - 1)
        return "wxa8" if w.panel and (symmetric_ok or (w.offset is not None and not w.zero_point)) else None
    if w.wxa8 and w.offset is None and w.zero_point != 1 << (w.bits - 1):
        return None  # the kernels' symmetric form is code - 2^(bits-1)
    return "wxa8" if w.wxa8 else "w8a8"


def native_projections(
    x: jax.Array, mats: list[QuantArray], layer: jax.Array, live: jax.Array | None = None
) -> list[jax.Array]:
    """``x @ W.T`` for each (stacked ``[layers, out, in]`` or plain) matrix of one group, at ``layer``,
    in one native call that quantizes ``x`` once (a w8a8 group shares its smoothing factors, so
    ``mats[0]``'s serve all). ``live``: rows of ``x`` that are real; the rest (padding) come out 0."""
    lead, cols = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, cols)
    split = [i for i, m in enumerate(mats) if isinstance(m, SplitStack)]
    if split:  # each in its own call (its part's row is not the others' layer); the rest together
        rest = [i for i in range(len(mats)) if i not in split]
        ys = dict(zip(rest, native_projections(x2, [mats[i] for i in rest], layer, live) if rest else [], strict=True))
        ys |= {i: split_projection(x2, mats[i], layer, live).astype(x.dtype) for i in split}
        return [ys[i].reshape(*lead, -1) for i in range(len(mats))]
    if live is not None:  # the kernels read [layer, live rows] from their layer operand
        layer = jnp.stack([jnp.asarray(layer, jnp.int32).reshape(()), jnp.asarray(live, jnp.int32).reshape(())])
    if native_format(mats[0]) == "wxa8":
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
class Projector:
    """How a step multiplies a layer's weights: XLA's products of the scanned layer's matrices, or the
    native kernels, which index the stacked (quantized) matrices by layer themselves, so native steps
    keep those out of the scanned operands (a scanned operand would be copied out layer by layer)."""

    stacked: LayerWeights
    native: bool
    live_tokens: jax.Array | None
    #: A mixture of experts' quantized experts through the native experts' kernel (ruvllm_jax.experts).
    experts: bool = False

    @classmethod
    def of(cls, layers: LayerWeights, plan: StepPlan, inp: StepInputs) -> Projector:
        # A mixture of experts has no dense MLP: its absent fields do not count.
        formats = {native_format(getattr(layers, f)) for f in _NATIVE_FIELDS if getattr(layers, f) is not None}
        experts = plan.native and layers.expert_gate is not None and native_experts(layers)
        return cls(layers, plan.native and len(formats) == 1 and None not in formats, inp.live_tokens, experts)

    def scanned(self) -> LayerWeights:
        drop = (_NATIVE_FIELDS if self.native else ()) + (tuple(EXPERT_FIELDS.values()) if self.experts else ())
        return dataclasses.replace(self.stacked, **{f: None for f in drop}) if drop else self.stacked

    def experts_at(self, lw: LayerWeights, layer: jax.Array, gather_rows: int):
        """``project_experts`` of layer ``layer``: the native kernel over the stacked experts, else
        :func:`project_experts` over the scanned layer's."""
        return native_project_experts(self.stacked, layer) if self.experts else project_experts(lw, gather_rows)

    def at(self, lw: LayerWeights, layer: jax.Array):
        def project(h: jax.Array, group: tuple[str, ...]) -> list[jax.Array]:
            if self.native and group[0] in _NATIVE_FIELDS:  # the router (float) is XLA's
                return native_projections(h, [getattr(self.stacked, p) for p in group], layer, self.live_tokens)
            if group == ("router",):  # in a fixed order: a row's routing does not depend on the batch
                return [router_product(h, lw.router)]
            return [linear(h, getattr(lw, p)) for p in group]

        return project


#: The experts' products: each row of ``x`` times its group's expert (``rhs [experts, out, in]``).
_EXPERT_DOT = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def project_experts(lw: LayerWeights, gather_rows: int = 0):
    """``project_experts`` of :func:`ruvllm.modeling.decoder_layer` for one layer's experts in XLA:
    ``lax.ragged_dot_general``, or for steps of at most ``gather_rows`` (token, expert) rows each row
    times its own expert, gathered. (XLA:CPU expands the ragged product to every expert times every
    row, so a decode step would read all the experts; gathered, it reads the chosen ones.) Quantized
    experts go through :func:`ruvllm_jax.experts.xla_quantized_experts` (CPU steps use the native
    kernel instead, :meth:`Projector.experts_at`)."""

    def project(x: jax.Array, sizes: jax.Array, group: tuple[str, ...]) -> list[jax.Array]:
        rows = x.shape[0]
        gather = rows <= gather_rows  # static: the step's shape
        experts = jnp.arange(sizes.shape[0], dtype=jnp.int32)
        expert_of_row = jnp.repeat(experts, sizes, total_repeat_length=rows)
        out = []
        for p in group:
            w = getattr(lw, EXPERT_FIELDS[p])
            if isinstance(w, QuantArray):
                y = xla_quantized_experts(w, x, expert_of_row, gather)
            elif gather:
                y = jnp.einsum("ri,roi->ro", x, w[expert_of_row].astype(x.dtype))
            else:
                y = lax.ragged_dot_general(x, w.astype(x.dtype), sizes.astype(jnp.int32), _EXPERT_DOT)
            out.append(y)
        return out

    return project
