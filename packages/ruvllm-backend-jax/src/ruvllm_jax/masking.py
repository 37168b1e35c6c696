"""What a query of paged attention sees, written once for the reference attention
(:mod:`ruvllm_jax.attention`) and the Pallas kernels (:mod:`ruvllm_jax.kernels`): the first key of a
sliding window, the score scale, and the score a masked key gets."""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: Large negative, finite, so fully masked rows never produce NaN.
MASK_VALUE = -1e30


def score_scale(scale: float | None, head_dim: int) -> float:
    return head_dim**-0.5 if scale is None else scale


def window_start(q_pos: jax.Array, window: jax.Array | int) -> jax.Array:
    """First key position a query at ``q_pos`` sees (0 without a window)."""
    window = jnp.asarray(window, jnp.int32)
    return jnp.where(window > 0, jnp.maximum(q_pos - window + 1, 0), 0)
