"""How a step adds its LoRA adapters' updates, ``adapt`` of :func:`ruvllm.modeling.decoder_layer`
(the scheme is in :mod:`ruvllm_jax.model`'s docstring): none, the native kernel, or dense products over
every slot's factors."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from ruvllm_jax import native
from ruvllm_jax.step_types import LoraFactors, StepInputs, StepPlan, native_lora


def _lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, mask: jax.Array) -> jax.Array:
    """``((x @ a.T) * mask) @ b.T`` in float32 at full precision: the factors are small, and a
    reduced-precision pass (TF32, bfloat16) would blur an update that may be tiny next to ``W``."""
    xa = jnp.einsum("ti,ki->tk", x.astype(jnp.float32), a, precision=lax.Precision.HIGHEST) * mask
    return jnp.einsum("tk,ok->to", xa, b, precision=lax.Precision.HIGHEST)


@dataclass(frozen=True)
class Adapters:
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
    def of(cls, plan: StepPlan, lora: LoraFactors | None, inp: StepInputs) -> Adapters:
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
