"""One weight's layers stored in different GGUF k-quant types, each type's layers in their own form.

llama.cpp's Q4_K_M gives ``attn_v`` and ``ffn_down`` Q6_K in about half the layers and Q4_K in the
rest. Stacked into one array, every layer takes the form both fit (6-bit codes, 16-wide factors with
offsets): an 8B file's ``ffn_down`` then held 29% more bytes than the file, and a decode token read
them all. A :class:`SplitStack` keeps one stack per type, each in the type's own form (the file's
bytes, :func:`ruvllm_jax.gguf_blocks.kernel_form`), and the layer's place in them; the native kernels
multiply layer ``l`` by switching to its type's stack at its row there. Only native ``w4a8`` steps
take it (every step of such a model runs native), so XLA's scan never sees one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax import lax

from ruvllm_jax import native
from ruvllm_jax.quant import QuantArray


@jax.tree_util.register_dataclass
@dataclass
class SplitStack:
    """Layer ``l`` of the weight is row ``index[l]`` of ``parts[part[l]]`` (each part stacked
    ``[layers of its type, out, ...]`` in the kernels' panel layout)."""

    parts: tuple[QuantArray, ...]
    part: tuple[int, ...] = field(metadata=dict(static=True))
    index: tuple[int, ...] = field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """``[layers, out, in]``, as one stack of the weight would be."""
        return (len(self.part), *self.parts[0].shape[1:])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def layer(self, i: int) -> QuantArray:
        """Layer ``i``'s matrix (host side: tests and tools)."""
        return jax.tree_util.tree_map(lambda a: a[self.index[i]], self.parts[self.part[i]])


def kquant_operands(w: QuantArray) -> tuple:
    """A k-quant's operands as :func:`ruvllm_jax.native.kxa8_group` takes them."""
    return (w.quant, w.scale, w.offset, w.sub_scale, w.sub_offset)


def split_projection(x: jax.Array, w: SplitStack, layer: jax.Array, live: jax.Array | None) -> jax.Array:
    """``x @ W_layer.T`` (``x`` ``[rows, in]``) through the native kernel, ``layer`` traced: a switch to
    the layer's part, whose call reads its row there in place. ``live``: the rows that are real."""
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    row = jnp.asarray(w.index, jnp.int32)[layer]
    operand = row if live is None else jnp.stack([row, jnp.asarray(live, jnp.int32).reshape(())])

    def branch(p: QuantArray):
        return lambda x, at: native.kxa8_group(x, at, [kquant_operands(p)])[0]

    if len(w.parts) == 1:
        return branch(w.parts[0])(x, operand)
    return lax.switch(jnp.asarray(w.part, jnp.int32)[layer], [branch(p) for p in w.parts], x, operand)
