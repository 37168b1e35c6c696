"""A mixture of experts' quantized experts: the native kernel that multiplies each group of (token,
expert) rows by its own expert's blocks only, and the XLA form where the kernels are not used.

The loader keeps ``w4a8`` experts stacked ``[layers, experts, out, in]`` in the native kernels' panel
layout, ``w8a8`` experts as int8 rows with a scale each (:mod:`ruvllm_jax.loading`). In a native step
they stay out of the scanned layer operands, as the dense matrices do: the kernel (``ruvllm_experts``,
``ruvllm_experts_w8a8`` in ``native/cpu_ffi.cc``) takes the whole stack, the layer index and the group
sizes of :func:`ruvllm.modeling.moe_mlp`, and reads only the experts that got rows, so a decode step
with top-8 of 128 experts reads 8 experts' blocks.

With ``mmap_experts`` the experts are not copied at all: each expert field is a :class:`StoredExperts`,
a table of where each layer's ``[experts, out, row bytes]`` stack of GGUF blocks lies in the file's
memory map (registered with the native library, which XLA's buffers cannot alias), and the kernel
``ruvllm_experts_stored`` reads the chosen experts' blocks as the file stores them (Q4_K, Q6_K, Q8_0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from ruvllm.checkpoint import Checkpoint
from ruvllm.errors import BackendError
from ruvllm.modeling import EXPERT_FIELDS, LayerTensor, LayerWeights
from ruvllm_jax import native
from ruvllm_jax.quant import PANEL, QuantArray, linear
from ruvllm_jax.step_types import ModelSpec

#: ``project_experts`` of :func:`ruvllm.modeling.decoder_layer`: ``(x, sizes, group) -> outputs``.
ProjectExperts = Callable[[jax.Array, jax.Array, tuple[str, ...]], Sequence[jax.Array]]


@jax.tree_util.register_dataclass
@dataclass
class StoredExperts:
    """One expert field of every layer left as the GGUF file's blocks (``mmap_experts``): ``table``
    int32 ``[layers, 5]``, each layer's (region handle, byte offset low and high 32 bits, ggml type
    id, bytes per row) of its ``[experts, out, row bytes]`` stack in the file's registered mapping;
    ``shape`` is the logical ``(layers, experts, out, in)``."""

    table: jax.Array
    shape: tuple[int, ...] = field(default=(), metadata=dict(static=True))


#: Each registered file mapping by its handle, kept alive as long as the native library may read it
#: (the library never forgets a region, so neither does this).
_MAPPINGS: dict[int, np.ndarray] = {}


def stored_experts(checkpoint: Checkpoint, t: LayerTensor, spec: ModelSpec) -> StoredExperts:
    """Where every layer's experts of ``t`` lie in ``checkpoint``'s memory map, for the stored-block
    kernel: the file's mapping registered once, nothing read or copied. Raises :class:`BackendError`
    naming the tensor for a type the kernel does not read as stored."""
    mapping = checkpoint.mapping()
    handle = next((h for h, m in _MAPPINGS.items() if m is mapping), None)
    if handle is None:
        handle = native.register_region(mapping)
        _MAPPINGS[handle] = mapping
    base = mapping.ctypes.data
    num_layers, num_experts = spec.num_layers, spec.num_experts
    rows, shape = [], ()
    for layer in range(num_layers):
        names = t.names(layer, spec)
        first, last = checkpoint.raw_tensor(names[0]), checkpoint.raw_tensor(names[-1])
        if first.ggml_type not in native.STORED_TYPES:
            raise BackendError(
                f"jax backend: mmap_experts reads experts in {', '.join(native.STORED_TYPES)} as stored; "
                f"{names[0]} is {first.ggml_type} (load with mmap_experts=false)"
            )
        n, row_bytes = first.data.shape
        offset = first.data.ctypes.data - base
        if last.data.ctypes.data - base != offset + (num_experts - 1) * n * row_bytes:
            raise BackendError(f"jax backend: mmap_experts: the experts of {names[0]} are not one stack in the file")
        rows.append([handle, offset & 0xFFFFFFFF, offset >> 32, native.STORED_TYPES[first.ggml_type], row_bytes])
        shape = (num_layers, num_experts, *first.shape)
    return StoredExperts(np.asarray(rows, np.int64).astype(np.uint32).view(np.int32), shape)


def _w8a8(w: QuantArray) -> bool:
    """int8 per output channel for int8 activations, without smoothing factors."""
    return not w.wxa8 and w.bits == 8 and w.offset is None and w.in_scale is None and w.scale.shape[-1] == 1


def native_expert_weight(w: object) -> bool:
    """Whether the experts' kernels multiply ``w``: ``w4a8`` experts in the panel layout, k-quant or
    plain group (an asymmetric one, or a symmetric one whose zero point is the kernels' ``2^(bits-1)``),
    or ``w8a8`` experts, or experts left in the file (:class:`StoredExperts`)."""
    if isinstance(w, StoredExperts):
        return True
    if not isinstance(w, QuantArray) or w.act_bits != 8:
        return False
    if _w8a8(w):
        return True
    if not w.wxa8 or w.panel != PANEL:
        return False
    if w.sub_group:
        return True
    return w.offset is not None or w.zero_point == 1 << (w.bits - 1)


def native_experts(layers: LayerWeights) -> bool:
    """Whether every expert matrix of ``layers`` is one the experts' kernel multiplies."""
    return all(native_expert_weight(getattr(layers, f)) for f in EXPERT_FIELDS.values())


def _operands(w: QuantArray) -> tuple[jax.Array, ...]:
    if w.sub_group:
        return (w.quant, w.scale, w.offset, w.sub_scale, w.sub_offset)
    return (w.quant, w.scale, w.offset)


def native_project_experts(stacked: LayerWeights, layer: jax.Array) -> ProjectExperts:
    """The experts' products of layer ``layer`` through the native kernel, from the stacked experts
    ``[layers, experts, ...]`` (read in place): each group's rows times its own expert's panels, ``x``
    quantized once per group of projections that share it (gate and up)."""

    def project(x: jax.Array, sizes: jax.Array, group: tuple[str, ...]) -> list[jax.Array]:
        mats = [getattr(stacked, EXPERT_FIELDS[p]) for p in group]
        if isinstance(mats[0], StoredExperts):  # mmap_experts: every expert matrix is
            ys = native.experts_stored_group(x, layer, sizes, [(m.table, m.shape[-2]) for m in mats])
        elif _w8a8(mats[0]):  # loading gives every expert matrix one form
            ys = native.experts_w8a8_group(x, layer, sizes, [(m.quant, m.scale) for m in mats])
        else:
            ys = native.experts_group(x, layer, sizes, [_operands(m) for m in mats])
        return [y.astype(x.dtype) for y in ys]

    return project


def router_product(h: jax.Array, w: object) -> jax.Array:
    """The router's scores ``h @ w.T`` in float32: on the CPU with the native library each score summed in one fixed
    order (:func:`ruvllm_jax.native.float_product`), so a row's routing is the same alone and in a
    batch (XLA's dot sums a one-row step in another order than a larger one); elsewhere XLA's."""

    def xla(h: jax.Array, w: jax.Array) -> jax.Array:
        return linear(h, w).astype(jnp.float32)

    if isinstance(w, QuantArray) or not native.available():
        return xla(h, w)
    return jax.lax.platform_dependent(h, w, cpu=native.float_product, default=xla)


def xla_quantized_experts(w: QuantArray, x: jax.Array, expert_of_row: jax.Array, gather: bool) -> jax.Array:
    """Rows of ``x`` times their experts of one layer's quantized experts ``w`` ``[experts, out, in]``
    in XLA, through :func:`~ruvllm_jax.quant.linear` (activations quantized as the native kernel
    quantizes them, so both compute the same sums): with ``gather`` each row times its own expert,
    gathered (a step of few rows reads only its experts); else every expert times every row, each row
    keeping its own expert's (where the native kernel is not used: ``RUVLLM_JAX_NATIVE=0``, accelerators)."""

    def one(xs: jax.Array, we: QuantArray) -> jax.Array:
        return linear(xs, we)

    if gather:
        chosen = jax.tree_util.tree_map(lambda a: a[expert_of_row], w)
        return jax.vmap(lambda xr, we: one(xr[None], we)[0])(x, chosen)
    every = jax.vmap(one, in_axes=(None, 0))(x, w)  # [experts, rows, out]
    return every[expert_of_row, jnp.arange(x.shape[0])]
