"""Sums over the last axis in one fixed order, whatever the array's other dimensions.

XLA's CPU reduction picks its vectorisation and tiling from the whole shape, so a row's sum of
squares (RMSNorm) over 576 values came out differently in a step of 8 rows than in a step of 1, and a
greedy answer could change with what else the server was running. Here the row is padded with zeros
to a power of two and halved by elementwise adds (exact zeros, and XLA does not reassociate float
adds), so every row is summed as the same binary tree whatever the number of rows. On the CPU with the
native kernels one FFI call sums each row in a fixed order instead, at XLA's own speed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ruvllm_jax import native


def row_sum(x: jax.Array) -> jax.Array:
    """``sum(x, axis=-1, keepdims=True)``, each row summed in the same order whatever ``x.shape[:-1]``."""
    n = x.shape[-1]
    width = 1 << max(0, n - 1).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def tree_row_mean(x: jax.Array) -> jax.Array:
    """``mean(x, axis=-1, keepdims=True)`` with :func:`row_sum`'s fixed order."""
    return row_sum(x) / jnp.asarray(x.shape[-1], x.dtype)


def mean_square(x: jax.Array) -> jax.Array:
    """``mean(x * x, axis=-1, keepdims=True)`` in float32 (RMSNorm's), batch invariant: on the CPU with
    the native kernels :func:`ruvllm_jax.native.mean_square` sums each row in one pass in a fixed lane
    order (the tree over ``x * x`` cost a SmolLM2 prefill step about 5%); elsewhere
    :func:`tree_row_mean` of the squares."""
    x = x.astype(jnp.float32)
    if not native.available():
        return tree_row_mean(x * x)
    return jax.lax.platform_dependent(x, cpu=native.mean_square, default=lambda v: tree_row_mean(v * v))


def exact_rsqrt(x: jax.Array) -> jax.Array:
    """``1 / sqrt(x)``, both correctly rounded, so an element's result does not depend on where it
    falls in the array. XLA's ``rsqrt`` on the CPU is an approximation refined by a Newton step in its
    vector loops and ``1 / sqrtf`` in the scalar remainder, so RMSNorm's factor for a row changed with
    the step's row count wherever the vector width left that row in the other loop (512-bit vectors
    on an Intel Xeon, 128-bit ones under SSE 4.2). The barrier keeps XLA's simplifier from turning
    the division back into ``rsqrt``; it costs one division per row."""
    return 1.0 / jax.lax.optimization_barrier(jnp.sqrt(x))
