"""Weight-only quantization: int8 and packed int4 weights that stay quantized in device memory.

A quantized matrix is one pytree, :class:`QuantArray`; :func:`linear` and :func:`take_rows` are the
only places that look inside it, so the model code never branches on quantization.

Layouts (``W`` is ``[out, in]``, Hugging Face layout; groups run along ``in``):

* int8: ``quant`` int8 ``[out, in]``; ``W = quant * scale`` with ``scale`` ``[out, in // group]``
  (``group == in`` means one scale per output channel).
* int4: ``quant`` uint8 ``[out, in // 2]``; inside each group of ``group`` weights, byte ``j`` holds
  weight ``j`` in its low nibble and weight ``j + group // 2`` in its high nibble (GGUF's Q4 layout, so
  Q4_0 / Q4_1 blocks load as they are). ``W = (nibble - zero_point) * scale (+ offset)``.
* 5-bit (``bits=5``, ``w4a8`` only): ``quant`` uint8 ``[out, in // 32 * 20]``, 20 bytes per group of 32:
  the codes' low 4 bits in the int4 order (16 bytes), then a little-endian uint32 whose bit ``j`` is
  code ``j``'s fifth bit (GGUF Q5_0's ``qs`` and ``qh``, swapped). See :func:`unpack_codes`.
* 6-bit (``bits=6``, ``w4a8`` only, GGUF Q6_K's codes): ``quant`` uint8 ``[out, in // 32 * 24]``, the
  5-bit form's 20 bytes per group, then another little-endian uint32 whose bit ``j`` is code ``j``'s
  sixth bit.
* k-quants (GGUF Q4_K / Q5_K / Q6_K, ``sub_group`` > 0): two-level scales, as in the file. ``scale``
  (and ``offset``) are float16 ``[out, in // 256]``, one per super-block; ``sub_scale`` (and
  ``sub_offset``) are small integers ``[out, in // sub_group]``; ``W = scale * sub_scale * (code -
  zero_point) - offset * sub_offset``. See :func:`wxa8_from_gguf_blocks`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ruvllm.errors import BackendError, ModelFormatError, UnsupportedQuantizationError

#: ``LoadOptions.quantization`` values this backend understands. ``w4a8`` is llama.cpp's CPU scheme:
#: weights in groups of 32 (4-bit codes with a float16 scale and offset per group, GGUF Q4_0 / Q4_1
#: blocks kept as they are; the tied embedding / output projection 8-bit, Q8_0; a GGUF's k-quant
#: blocks with their two-level scales), activations quantized to int8 per group of 32 at run time; see
#: :func:`_linear_wxa8` and :func:`_linear_kquant`. ``w8a8`` is int8 weights (one scale
#: per output channel) times int8 activations (one scale per token, chosen at run time): XLA's CPU
#: backend runs that product in an integer GEMM kernel several times faster than any float or
#: weight-only form, which is why it exists (see docs/jax-backend.md for speed and quality).
QUANTIZATIONS = ("none", "q8", "q4", "w8a8", "w4a8")
#: Group size of RTN int8 / int4 (GGUF's block size, so both paths share one layout).
Q_GROUP = 32
#: Inputs per k-quant super-block (GGUF's ``QK_K``): one float16 ``d`` (and ``dmin``) per row each.
KQ_BLOCK = 256


@jax.tree_util.register_dataclass
@dataclass
class QuantArray:
    quant: jax.Array
    scale: jax.Array
    #: Per-group additive term (GGUF Q4_1's minimum); None for symmetric formats.
    offset: jax.Array | None = None
    #: Code width: 8 (one per byte), 4 (two per byte), 5 or 6 (``w4a8`` only; see the module docstring).
    bits: int = field(default=8, metadata=dict(static=True))
    group_size: int = field(default=0, metadata=dict(static=True))
    #: Subtracted from the stored integer before scaling (8 for symmetric 4-bit, else 0).
    zero_point: int = field(default=0, metadata=dict(static=True))
    #: 8: :func:`linear` quantizes its input to int8 per row and multiplies in integers (w8a8);
    #: 0: the weights are dequantized and the product is float (weight-only).
    act_bits: int = field(default=0, metadata=dict(static=True))
    #: Per-input-channel factor ``[..., in]`` (w8a8 smoothing): the stored weights are the true ones
    #: divided by it column-wise, and :func:`linear` multiplies its input by it first.
    in_scale: jax.Array | None = None
    #: 16: codes, scales and offsets are stored in the native kernels' 16-row panel layout (see
    #: :func:`to_panels`); 0: plain row-major.
    panel: int = field(default=0, metadata=dict(static=True))
    #: k-quants: per-sub-group integer factors of ``scale`` (uint8 6-bit for Q4_K / Q5_K, int8 for
    #: Q6_K) and of ``offset`` (uint8 6-bit), ``[..., out, in // sub_group]``.
    sub_scale: jax.Array | None = None
    sub_offset: jax.Array | None = None
    #: Inputs per ``sub_scale`` (32 for Q4_K / Q5_K, 16 for Q6_K); 0: not a k-quant.
    sub_group: int = field(default=0, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, cols = self.quant.shape
        return (*lead, cols * 8 // self.bits)

    @property
    def nbytes(self) -> int:
        leaves = [self.quant, self.in_scale, *(getattr(self, f) for f in ROW_FIELDS)]
        return int(sum(x.size * x.dtype.itemsize for x in leaves if x is not None))

    @property
    def wxa8(self) -> bool:
        """Grouped weights for activations quantized per group of 32 (``w4a8``): the 32-group forms,
        which always carry an offset, and the k-quants (Q6_K's has none)."""
        return self.act_bits == 8 and (self.offset is not None or self.sub_group > 0)

    def dequantize(self, dtype: jnp.dtype) -> jax.Array:
        """The float matrix, ``[..., out, in]`` in ``dtype`` (inside a jitted step this is fused with
        the matmul's operand load, never kept)."""
        if self.panel:
            return from_panels(self).dequantize(dtype)
        q = unpack_codes(self)
        if self.sub_group:
            return _dequantize_kquant(self, q).astype(dtype)
        *lead, out, cols = q.shape
        groups = cols // self.group_size
        w = q.astype(dtype) if self.zero_point == 0 else q.astype(dtype) - jnp.asarray(self.zero_point, dtype)
        w = w.reshape(*lead, out, groups, self.group_size) * self.scale.astype(dtype)[..., None]
        if self.offset is not None:
            w = w + self.offset.astype(dtype)[..., None]
        w = w.reshape(*lead, out, cols)
        if self.in_scale is not None:
            w = w * self.in_scale.astype(dtype)[..., None, :]
        return w


def _xp(a: Any) -> Any:
    """The array module for ``a``: NumPy for host arrays (at load), else jnp (inside jitted steps)."""
    return np if isinstance(a, np.ndarray) else jnp


def _unpack_nibbles(packed: jax.Array, group: int) -> jax.Array:
    """uint8 ``[..., out, in // 2]`` -> uint8 ``[..., out, in]`` in the GGUF Q4 in-group order."""
    *lead, out, half = packed.shape
    g = packed.reshape(*lead, out, half // (group // 2), group // 2)
    both = _xp(packed).concatenate([g & 0x0F, g >> 4], axis=-1)
    return both.reshape(*lead, out, half * 2)


def unpack_codes(w: QuantArray) -> jax.Array | np.ndarray:
    """``w``'s row-major codes one per byte, ``[..., out, in]``, whatever their width (4, 5, 6 or 8
    bits). NumPy in, NumPy out (at load, on the host); else jnp, so it fuses into a jitted step."""
    q = w.quant
    if w.bits == 8:
        return q
    if w.bits == 4:
        return _unpack_nibbles(q, w.group_size)
    xp = _xp(q)
    *lead, out, nbytes = q.shape
    gb = 4 * w.bits  # bytes per group of 32: 16 of low nibbles, then a 4-byte plane per higher bit
    g = q.reshape(*lead, out, nbytes // gb, gb)
    codes = _unpack_nibbles(g[..., :16], 32)
    for plane, at in enumerate(range(16, gb, 4)):
        # Byte b of a plane (a little-endian word) holds bit 4 + plane of codes 8b .. 8b+7, lowest first.
        bit = (g[..., at : at + 4, None] >> xp.arange(8, dtype=xp.uint8)) & 1
        codes = codes | (bit.reshape(codes.shape) << (4 + plane))
    return codes.reshape(*lead, out, nbytes // gb * 32)


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes below ``2**bits``, ``[..., out, in]`` -> the ``bits``-wide form of groups of 32
    (host side; the inverse of :func:`unpack_codes`)."""
    if bits == 8:
        return codes
    *lead, out, cols = codes.shape
    g = codes.reshape(*lead, out, cols // 32, 32)
    # Bits 4 .. bits-1 as 4-byte planes: packbits' little bit order is the little-endian word's.
    planes = [np.packbits((g >> b) & 1, axis=-1, bitorder="little") for b in range(4, bits)]
    packed = np.concatenate([_pack_nibbles(g & 0x0F, 32), *planes], axis=-1)
    return packed.reshape(*lead, out, cols // 8 * bits)


#: Per-output-row fields: indexed, stacked and laid out in panels the way the codes' rows are.
ROW_FIELDS = ("scale", "offset", "sub_scale", "sub_offset")


def _kquant_factors(w: QuantArray) -> tuple[jax.Array, jax.Array | None]:
    """float32 ``scale * sub_scale`` and ``offset * sub_offset`` per sub-group, ``[..., out, in //
    sub_group]``: products of a float16 and an integer below 2^8, so exact in float32."""
    per = KQ_BLOCK // w.sub_group
    d = jnp.repeat(jnp.asarray(w.scale, jnp.float32), per, axis=-1) * jnp.asarray(w.sub_scale, jnp.float32)
    if w.offset is None:
        return d, None
    m = jnp.repeat(jnp.asarray(w.offset, jnp.float32), per, axis=-1) * jnp.asarray(w.sub_offset, jnp.float32)
    return d, m


def _dequantize_kquant(w: QuantArray, codes: jax.Array) -> jax.Array:
    """float32 ``(d * sc) * (code - zero_point) - dmin * mn``: the factor times the code is exact, so
    the one rounding is the subtraction's, as in GGUF's own dequantization (same values, bit for bit)."""
    *lead, out, cols = codes.shape
    d, m = _kquant_factors(w)
    c = codes.astype(jnp.float32).reshape(*lead, out, cols // w.sub_group, w.sub_group)
    v = d[..., None] * (c - w.zero_point if w.zero_point else c)
    if m is not None:
        v = v - m[..., None]
    return v.reshape(*lead, out, cols)


Weight = jax.Array | QuantArray


def linear(x: jax.Array, w: Weight) -> jax.Array:
    """``x @ w.T`` for ``x`` ``[..., in]`` and ``w`` ``[out, in]`` (float or quantized)."""
    if isinstance(w, QuantArray):
        if w.wxa8 and w.sub_group:
            return _linear_kquant(x, w)
        if w.wxa8:
            return _linear_wxa8(x, w)
        if w.act_bits == 8:
            return _linear_w8a8(x, w)
        if w.bits == 8 and w.offset is None and w.scale.shape[-1] == 1:
            # One scale per output channel: scale the product instead of the weights.
            y = jnp.einsum("...i,oi->...o", x, w.quant.astype(x.dtype))
            return y * w.scale[..., 0].astype(x.dtype)
        if w.bits == 4:
            return _linear_int4(x, w)
        return jnp.einsum("...i,oi->...o", x, w.dequantize(x.dtype))
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype))


#: Rows the integer product is padded to: XLA:CPU sends a one-row int8 product to a slow generic
#: loop, two rows or more to its fast GEMM kernel (measured ~8x apart on SmolLM2's matrices).
_W8A8_MIN_ROWS = 2


def _linear_w8a8(x: jax.Array, w: QuantArray) -> jax.Array:
    """``x @ w.T`` with ``x`` quantized to symmetric int8 per row (scale = row max / 127) and an
    int32-accumulated integer product, rescaled by the row and output-channel scales."""
    lead, cols = x.shape[:-1], x.shape[-1]
    xf = x.reshape(-1, cols).astype(jnp.float32)
    rows = xf.shape[0]
    if w.in_scale is not None:
        xf = xf * w.in_scale.astype(jnp.float32)
    if rows < _W8A8_MIN_ROWS:
        xf = jnp.pad(xf, ((0, _W8A8_MIN_ROWS - rows), (0, 0)))
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    xq = jnp.clip(jnp.round(xf / x_scale), -127, 127).astype(jnp.int8)
    acc = lax.dot_general(xq, w.quant, (((1,), (w.quant.ndim - 1,)), ((), ())), preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * x_scale * w.scale[..., 0].astype(jnp.float32)
    return y[:rows].reshape(*lead, -1).astype(x.dtype)


#: Group size of the ``w4a8`` format, for weights and activations alike (GGUF's block size).
ACT_GROUP = 32


def quantize_activation_groups(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x`` ``[rows, K]`` -> (int8 codes ``[rows, K / 32, 32]``, scale ``dx`` and ``dx * sum(codes)``
    ``[rows, K / 32]``): per group of 32, ``dx = max|x| / 127`` and codes ``round(x / dx)`` (half to
    even, clipped to +-127), all-zero groups all zero. The native kernel computes the same."""
    rows, cols = x.shape
    xg = x.astype(jnp.float32).reshape(rows, cols // ACT_GROUP, ACT_GROUP)
    amax = jnp.max(jnp.abs(xg), axis=-1)
    dx = amax / 127.0
    safe = jnp.where(amax > 0, dx, 1.0)
    xq = jnp.where(amax[..., None] > 0, jnp.clip(jnp.round(xg / safe[..., None]), -127, 127), 0).astype(jnp.int8)
    sx = dx * jnp.sum(xq.astype(jnp.int32), axis=-1).astype(jnp.float32)
    return xq, dx, sx


def _linear_wxa8(x: jax.Array, w: QuantArray) -> jax.Array:
    """``x @ w.T`` for group-quantized weights (``d * code + m`` per group of 32) and activations
    quantized per group: ``sum_g d * dx * (codes . xq) + m * sx``, the integer dot of each group exact
    in int32. This is the XLA formulation; CPU steps call the native kernel, which computes the same
    sums (float rounding order aside)."""
    if w.panel:
        w = from_panels(w)
    lead, cols = x.shape[:-1], x.shape[-1]
    xq, dx, sx = quantize_activation_groups(x.reshape(-1, cols))
    codes = unpack_codes(w)
    out = codes.shape[0]
    groups = cols // ACT_GROUP
    cg = codes.reshape(out, groups, ACT_GROUP).astype(jnp.int8 if w.bits < 8 else jnp.int16)
    # [groups, rows, 32] x [groups, out, 32] -> [groups, rows, out], exact in int32.
    p = lax.dot_general(
        jnp.transpose(xq, (1, 0, 2)).astype(cg.dtype),
        jnp.transpose(cg, (1, 0, 2)),
        (((2,), (2,)), ((0,), (0,))),
        preferred_element_type=jnp.int32,
    )
    d = w.scale.astype(jnp.float32)  # [out, groups]
    y = jnp.einsum("gro,og,rg->ro", p.astype(jnp.float32), d, dx, precision=lax.Precision.HIGHEST)
    y = y + jnp.einsum("rg,og->ro", sx, w.offset.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return y.reshape(*lead, out).astype(x.dtype)


def _linear_kquant(x: jax.Array, w: QuantArray) -> jax.Array:
    """``x @ w.T`` for k-quant weights and activations quantized per group of 32 (as for
    :func:`_linear_wxa8`). Per sub-group ``h`` (16 or 32 inputs, inside activation group ``g``) the
    integer dot ``p_h = codes . xq`` and ``isum_h = sum(xq)`` are exact in int32; then, in float32,
    ``y = sum_h (d sc_h) dx_g (p_h - zero_point isum_h) - (dmin mn_h) dx_g isum_h`` with ``d sc_h`` and
    ``dmin mn_h`` the exact products of :func:`_kquant_factors`. For 32-wide sub-groups ``dx_g
    isum_h`` is :func:`quantize_activation_groups`'s ``sx``. This is the reference the native kernels
    are checked against."""
    if w.panel:
        w = from_panels(w)
    lead, cols = x.shape[:-1], x.shape[-1]
    xq, dx, _ = quantize_activation_groups(x.reshape(-1, cols))
    rows, sg = xq.shape[0], w.sub_group
    subs = cols // sg
    codes = unpack_codes(w)
    out = codes.shape[0]
    xh = xq.reshape(rows, subs, sg)
    # Codes are below 64 in every k-quant: int8 x int8 -> [subs, rows, out], exact in int32.
    p = lax.dot_general(
        jnp.transpose(xh, (1, 0, 2)),
        jnp.transpose(codes.reshape(out, subs, sg).astype(jnp.int8), (1, 0, 2)),
        (((2,), (2,)), ((0,), (0,))),
        preferred_element_type=jnp.int32,
    )
    isum = jnp.sum(xh.astype(jnp.int32), axis=-1)  # [rows, subs]
    if w.zero_point:
        p = p - w.zero_point * jnp.transpose(isum)[:, :, None]
    dxh = jnp.repeat(dx, ACT_GROUP // sg, axis=-1)  # [rows, subs]: each sub-group's activation scale
    d, m = _kquant_factors(w)  # [out, subs]
    y = jnp.einsum("hro,oh,rh->ro", p.astype(jnp.float32), d, dxh, precision=lax.Precision.HIGHEST)
    if m is not None:
        sx = dxh * isum.astype(jnp.float32)
        y = y - jnp.einsum("rh,oh->ro", sx, m, precision=lax.Precision.HIGHEST)
    return y.reshape(*lead, out).astype(x.dtype)


def _linear_int4(x: jax.Array, w: QuantArray) -> jax.Array:
    """int4 matmul without interleaving nibbles: the low nibbles of a group hold its first half, the
    high nibbles its second half, so ``x`` is split the same way and each half meets its nibbles."""
    dt = x.dtype
    out, half = w.quant.shape
    gs = w.group_size
    groups = half * 2 // gs
    packed = w.quant.reshape(out, groups, gs // 2)
    scale = w.scale.astype(dt)[..., None]
    xg = x.reshape(*x.shape[:-1], groups, 2, gs // 2)

    def nibbles(v: jax.Array) -> jax.Array:
        v = v.astype(dt)
        return ((v if w.zero_point == 0 else v - jnp.asarray(w.zero_point, dt)) * scale).reshape(out, half)

    lead = x.shape[:-1]
    x_lo, x_hi = xg[..., 0, :].reshape(*lead, half), xg[..., 1, :].reshape(*lead, half)
    y = jnp.einsum("...i,oi->...o", x_lo, nibbles(packed & 0x0F))
    y = y + jnp.einsum("...i,oi->...o", x_hi, nibbles(packed >> 4))
    if w.offset is not None:
        # The per-group minimum multiplies the sum of the group's inputs.
        y = y + jnp.einsum("...g,og->...o", xg.sum(axis=(-2, -1)), w.offset.astype(dt))
    return y


def take_rows(w: Weight, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows ``w[ids]`` as float ``dtype`` (embedding lookup); only the chosen rows are dequantized."""
    if isinstance(w, QuantArray) and w.panel:
        return _panel_rows(w, ids).dequantize(dtype)
    if isinstance(w, QuantArray):
        return _map_rows(w, lambda a: a[ids]).dequantize(dtype)
    return w[ids].astype(dtype)


def _map_rows(w: QuantArray, fn: Callable[[Any], Any], **changes: Any) -> QuantArray:
    """``w`` with ``changes`` and ``fn`` applied to its codes and every per-row field it has (those
    ``changes`` does not set)."""
    fields = ("quant", *ROW_FIELDS)
    rows = {f: fn(getattr(w, f)) for f in fields if f not in changes and getattr(w, f) is not None}
    return dataclasses.replace(w, **rows, **changes)


def weight_nbytes(tree: object) -> int:
    """Bytes held by the arrays of a weight pytree (quantized leaves count as stored)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


# -- quantizing at load (host side, NumPy) -----------------------------------------------------------


def quantize_int8(w: np.ndarray, group_size: int | None = Q_GROUP) -> QuantArray:
    """Round-to-nearest symmetric int8 of a float ``[out, in]`` matrix, one float16 scale per group
    of ``group_size`` inputs (GGUF Q8_0's layout), or one float32 scale per output channel when
    ``group_size`` is None."""
    out, cols = w.shape
    gs = cols if group_size is None else group_size
    if cols % gs:
        raise BackendError(f"int8 quantization: {cols} input features are not a multiple of group size {gs}")
    g = w.astype(np.float32).reshape(out, cols // gs, gs)
    amax = np.abs(g).max(axis=-1)
    scale = (amax / 127.0).astype(np.float32 if group_size is None else np.float16)
    inv = np.where(scale != 0, 1.0 / scale.astype(np.float32), 0.0)
    q = np.clip(np.rint(g * inv[..., None]), -127, 127).astype(np.int8)
    return QuantArray(q.reshape(out, cols), scale, None, bits=8, group_size=gs)


def quantize_int4(w: np.ndarray, group_size: int = Q_GROUP) -> QuantArray:
    """Round-to-nearest asymmetric int4, group-wise (GGUF Q4_1's scheme): 16 levels from the group's
    minimum to its maximum, float16 scale and minimum per group, two weights per byte."""
    out, cols = w.shape
    if cols % group_size or group_size % 2:
        raise BackendError(f"int4 quantization: {cols} input features are not a multiple of group size {group_size}")
    g = w.astype(np.float32).reshape(out, cols // group_size, group_size)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    scale = ((hi - lo) / 15.0).astype(np.float16)
    offset = lo.astype(np.float16)
    inv = np.where(scale != 0, 1.0 / scale.astype(np.float32), 0.0)
    u = np.clip(np.rint((g - offset.astype(np.float32)[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    packed = _pack_nibbles(u, group_size).reshape(out, cols // 2)
    return QuantArray(packed, scale, offset, bits=4, group_size=group_size, zero_point=0)


def _pack_nibbles(u: np.ndarray, group: int) -> np.ndarray:
    """uint8 ``[out, groups, group]`` of values < 16 -> ``[out, groups, group // 2]`` bytes."""
    half = group // 2
    return (u[..., :half] | (u[..., half:] << 4)).astype(np.uint8)


def quantize_w8a8(w: np.ndarray, smooth: np.ndarray | None = None) -> QuantArray:
    """int8 per output channel, marked for int8 activations (see :func:`_linear_w8a8`).

    ``smooth`` ``[in]`` (SmoothQuant): column ``j`` is multiplied by ``smooth[j]`` before rounding and
    the input by ``1 / smooth[j]`` at run time, moving activation outliers into the weights, whose
    per-channel scales absorb them far better than one scale per token row does."""
    if smooth is None:
        q = quantize_int8(w, group_size=None)
        return QuantArray(q.quant, q.scale, None, bits=8, group_size=q.group_size, act_bits=8)
    smooth = np.asarray(smooth, np.float32)
    q = quantize_int8(w.astype(np.float32) * smooth[None, :], group_size=None)
    return QuantArray(
        q.quant, q.scale, None, bits=8, group_size=q.group_size, act_bits=8, in_scale=(1.0 / smooth).astype(np.float32)
    )


def quantize(w: np.ndarray, mode: str) -> QuantArray:
    """Quantize a float ``[out, in]`` matrix for a ``LoadOptions.quantization`` mode."""
    if mode == "w8a8":
        return quantize_w8a8(w)
    if mode == "q8":
        return quantize_int8(w)
    if mode == "q4":
        return quantize_int4(w)
    raise BackendError(f"unknown quantization {mode!r} (known: {', '.join(QUANTIZATIONS)})")


# -- GGUF blocks kept as they are ----------------------------------------------------------------------

#: GGUF block types that map onto :class:`QuantArray` without re-quantizing.
GGUF_DIRECT_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1"})
#: GGUF's k-quants: super-blocks of 256 values with integer sub-scales.
KQUANT_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K"})
#: GGUF block types the ``w4a8`` form holds exactly (:func:`wxa8_from_gguf_blocks`); Q5_0 / Q5_1 are
#: what llama.cpp's Q4_K_M / Q5_K_M fall back to for rows that are not whole super-blocks.
WXA8_GGUF_TYPES = GGUF_DIRECT_TYPES | KQUANT_TYPES | {"Q5_0", "Q5_1"}
#: (values, bytes) per block.
_GGUF_BLOCK = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (KQ_BLOCK, 144),
    "Q5_K": (KQ_BLOCK, 176),
    "Q6_K": (KQ_BLOCK, 210),
}


def _gguf_blocks(ggml_type: str, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``data`` as uint8 ``[out, blocks, block bytes]``: a size ``shape`` does not imply is a corrupt
    or truncated tensor, never something to reshape into other weights."""
    out, cols = shape
    block, nbytes = _GGUF_BLOCK[ggml_type]
    if cols % block:
        raise ModelFormatError(f"{ggml_type} rows of {cols} values are not whole blocks of {block}")
    raw = np.ascontiguousarray(data, dtype=np.uint8)
    want = out * (cols // block) * nbytes
    if raw.size != want:
        raise ModelFormatError(
            f"{ggml_type} data of {raw.size} bytes does not match its shape {out} x {cols} ({want} bytes)"
        )
    return raw.reshape(out, cols // block, nbytes)


def _f16(blocks: np.ndarray, at: int, ggml_type: str) -> np.ndarray:
    """The float16 field at byte ``at`` of every block, ``[out, blocks]``; a NaN or infinite scale
    marks a corrupt block (it would turn every output it touches into NaN)."""
    v = blocks[..., at : at + 2].copy().view(np.float16)[..., 0]
    bad = np.argwhere(~np.isfinite(v))
    if len(bad):
        row, blk = (int(i) for i in bad[0])
        raise ModelFormatError(f"{ggml_type} block {blk} of row {row} has a non-finite scale ({v[row, blk]})")
    return v


def from_gguf_blocks(ggml_type: str, data: np.ndarray, shape: tuple[int, ...]) -> QuantArray:
    """A :class:`QuantArray` holding GGUF Q8_0 / Q4_0 / Q4_1 blocks (``data`` uint8, one row of
    blocks per output row) bit for bit: the values it dequantizes to are the file's."""
    out, cols = shape
    if ggml_type not in GGUF_DIRECT_TYPES:
        raise UnsupportedQuantizationError(f"GGUF type {ggml_type} cannot be kept quantized (only Q8_0, Q4_0, Q4_1)")
    rows = _gguf_blocks(ggml_type, data, shape)
    d = _f16(rows, 0, ggml_type)
    if ggml_type == "Q8_0":
        q = rows[..., 2:34].copy().view(np.int8).reshape(out, cols)
        return QuantArray(q, d, None, bits=8, group_size=32)
    if ggml_type == "Q4_0":
        packed = rows[..., 2:18].reshape(out, cols // 2)
        return QuantArray(np.ascontiguousarray(packed), d, None, bits=4, group_size=32, zero_point=8)
    m = _f16(rows, 2, ggml_type)
    packed = rows[..., 4:20].reshape(out, cols // 2)
    return QuantArray(np.ascontiguousarray(packed), d, m, bits=4, group_size=32, zero_point=0)


def _q5_groups(blocks: np.ndarray, at: int) -> np.ndarray:
    """Q5_0 / Q5_1 codes in the 5-bit form, ``[out, blocks * 20]``: the block's 4-byte ``qh`` at byte
    ``at`` (bit ``j`` of the little-endian word: code ``j``'s fifth bit) and the 16 ``qs`` bytes after
    it (low nibbles: codes 0-15, high nibbles: codes 16-31) are that form's two parts, swapped."""
    qh, qs = blocks[..., at : at + 4], blocks[..., at + 4 : at + 20]
    return np.concatenate([qs, qh], axis=-1).reshape(blocks.shape[0], -1)


def _kquant_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of Q4_K / Q5_K blocks -> 8 six-bit ``sc`` and 8 six-bit ``mn`` each: bytes
    0-3 hold ``sc`` 0-3 in their low 6 bits and the top 2 bits of ``sc`` 4-7, bytes 4-7 the same for
    ``mn``, bytes 8-11 the low 4 bits of ``sc`` 4-7 (low nibble) and of ``mn`` 4-7 (high nibble)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def _low_high(qs: np.ndarray, width: int) -> np.ndarray:
    """The nibbles of k-quant code bytes in value order: per run of ``width`` bytes, the low nibbles
    are ``width`` consecutive values and the high nibbles the next ``width``."""
    runs = qs.reshape(*qs.shape[:-1], -1, 1, width)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=-2).reshape(*qs.shape[:-1], -1)


def wxa8_from_gguf_blocks(ggml_type: str, data: np.ndarray, shape: tuple[int, ...]) -> QuantArray:
    """GGUF blocks as a ``w4a8``-format :class:`QuantArray`, codes and scales bit for bit, so every
    weight dequantizes to the file's value:

    * Q4_1 as it is (``d * code + m``), Q4_0 with ``m = -8 d``;
    * Q8_0's 8-bit codes stored as ``q + 128`` (``m = -128 d``);
    * Q5_0 / Q5_1 in the 5-bit form, their bytes reordered (``m = -16 d``, and the file's ``m``);
    * Q4_K: ``scale`` / ``offset`` the float16 ``d`` / ``dmin`` per super-block of 256, ``sub_scale``
      / ``sub_offset`` the uint8 6-bit ``sc`` / ``mn`` per 32, ``W = d sc code - dmin mn``; the 4-bit
      codes repacked per group of 32 into the nibble order of Q4_0 (the file packs 64 values per 32
      bytes, low nibbles first): a permutation of nibbles;
    * Q5_K: the same scales, the 5-bit codes in the 5-bit form (per group of 32, as Q5_0's);
    * Q6_K: the 6-bit codes in the 6-bit form with zero point 32, ``d`` per super-block, the int8
      ``sc`` per 16 (``W = d sc (code - 32)``), no offset.

    Rows that are not whole blocks, data of another size than ``shape`` implies and NaN or infinite
    float16 scales raise :class:`ModelFormatError` (the caller adds the tensor's name)."""
    if ggml_type not in WXA8_GGUF_TYPES:
        raise UnsupportedQuantizationError(
            f"GGUF type {ggml_type} has no exact w4a8 form (known: {', '.join(sorted(WXA8_GGUF_TYPES))})"
        )
    out, cols = shape
    if ggml_type in GGUF_DIRECT_TYPES:
        q = from_gguf_blocks(ggml_type, data, shape)
        d = np.asarray(q.scale, np.float16)
        if ggml_type == "Q4_1":
            return QuantArray(q.quant, d, np.asarray(q.offset, np.float16), bits=4, group_size=32, act_bits=8)
        if ggml_type == "Q4_0":
            m = (d.astype(np.float32) * -8).astype(np.float16)
            return QuantArray(q.quant, d, m, bits=4, group_size=32, act_bits=8)
        codes = (np.asarray(q.quant, np.int16) + 128).astype(np.uint8)
        return QuantArray(codes, d, (d.astype(np.float32) * -128).astype(np.float16), bits=8, group_size=32, act_bits=8)
    blocks = _gguf_blocks(ggml_type, data, shape)
    nb = cols // _GGUF_BLOCK[ggml_type][0]
    if ggml_type in ("Q5_0", "Q5_1"):
        d = _f16(blocks, 0, ggml_type)
        if ggml_type == "Q5_0":
            m, packed = (d.astype(np.float32) * -16).astype(np.float16), _q5_groups(blocks, 2)
        else:
            m, packed = _f16(blocks, 2, ggml_type), _q5_groups(blocks, 4)
        return QuantArray(packed, d, m, bits=5, group_size=32, act_bits=8)
    if ggml_type == "Q6_K":
        d = _f16(blocks, 208, ggml_type)
        shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]
        high = (blocks[..., 128:192].reshape(out, nb, 2, 1, 32) >> shifts) & 0x03  # [out, nb, 2, 4, 32]
        codes = _low_high(blocks[..., 0:128], 64) | (high.reshape(out, nb, KQ_BLOCK) << 4)
        sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(out, cols // 16)
        return QuantArray(
            _pack_codes(codes.reshape(out, cols), 6),
            d,
            None,
            bits=6,
            group_size=32,
            zero_point=32,
            act_bits=8,
            sub_scale=sc,
            sub_group=16,
        )
    d, dmin = _f16(blocks, 0, ggml_type), _f16(blocks, 2, ggml_type)
    sc, mn = _kquant_scales(blocks[..., 4:16])
    sub = dict(sub_scale=sc.reshape(out, cols // 32), sub_offset=mn.reshape(out, cols // 32), sub_group=32)
    if ggml_type == "Q4_K":
        packed = _pack_codes(_low_high(blocks[..., 16:144], 32).reshape(out, cols), 4)
        return QuantArray(packed, d, dmin, bits=4, group_size=32, act_bits=8, **sub)
    high = (blocks[..., 16:48].reshape(out, nb, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 0x01
    codes = _low_high(blocks[..., 48:176], 32) | (high.reshape(out, nb, KQ_BLOCK) << 4)
    return QuantArray(_pack_codes(codes.reshape(out, cols), 5), d, dmin, bits=5, group_size=32, act_bits=8, **sub)


def storage_format(w: QuantArray) -> tuple:
    """What matrices must share to be stacked into one :class:`QuantArray`: the static fields and
    which array fields are present, with their dtypes."""
    arrays = (w.quant, w.in_scale, *(getattr(w, f) for f in ROW_FIELDS))
    dtypes = tuple(None if a is None else np.dtype(a.dtype).str for a in arrays)
    return (w.bits, w.group_size, w.zero_point, w.act_bits, w.panel, w.sub_group, dtypes)


def kernel_form(w: QuantArray) -> QuantArray:
    """A k-quant in the one form the native kernels read (``cpu_kernels.h``, KMatrix), the same values:
    16-wide sub-groups, no zero point, ``W = (scale sc) code - (offset mn)`` with ``scale`` / ``offset``
    float16 per super-block, ``sc`` and ``mn`` int8 per 16. Q4_K / Q5_K: their ``d``, ``dmin``, ``sc``
    and ``mn`` each repeated per 16; Q6_K: ``offset = 32 d`` and ``mn = sc`` (so ``d sc (code - 32)``).
    Every product is exact in float32. Other matrices come back unchanged."""
    if not w.sub_group or (w.sub_group == 16 and w.zero_point == 0 and w.offset is not None):
        return w
    sc = np.asarray(w.sub_scale)
    if w.sub_group == 16:  # Q6_K
        assert w.zero_point == 32 and w.offset is None, "a Q6_K-form k-quant has zero point 32 and no offset"
        d = np.asarray(w.scale)
        with np.errstate(over="ignore"):
            d32 = (d.astype(np.float32) * 32).astype(np.float16)  # a power of two: exact unless it overflows
        if not np.all(np.isfinite(d32)):
            raise BackendError(
                "a Q6_K super-block scale above 2047 has no exact w4a8 form (load with quantization none)"
            )
        sc = sc.astype(np.int8)
        return dataclasses.replace(w, offset=d32, sub_scale=sc, sub_offset=sc, zero_point=0)
    return dataclasses.replace(
        w,
        sub_scale=np.repeat(sc, 2, axis=-1).astype(np.int8),
        sub_offset=np.repeat(np.asarray(w.sub_offset), 2, axis=-1).astype(np.int8),
        sub_group=16,
    )


def common_format(mats: list[QuantArray]) -> list[QuantArray]:
    """Row-major ``w4a8`` matrices of one weight in several layers, in one storage format where the
    file's types differ by layer (llama.cpp's Q4_K_M gives ``attn_v`` and ``ffn_down`` Q6_K in some
    layers and Q4_K, or Q8_0 and Q5_0, in others), each converted exactly: k-quants to
    :func:`kernel_form` (which every k-quant shares, its factors per layer), and codes to the widest
    form any layer has (4 < 5 < 6 < 8 bits: narrower codes fit a wider form with zero high bits, so
    Q4_K / Q5_K with Q6_K are stored 6-bit; with 8-bit codes in some layers all are stored one per
    byte). Other mixes (k-quants with 32-group forms) come back unchanged for the caller to refuse."""
    if not all(w.wxa8 and not w.panel for w in mats):
        return mats
    mats = [kernel_form(w) for w in mats]
    if len({storage_format(w) for w in mats}) == 1 or len({w.sub_group for w in mats}) > 1:
        return mats
    bits = max(w.bits for w in mats)
    return [_with_bits(w, bits) for w in mats]


def _with_bits(w: QuantArray, bits: int) -> QuantArray:
    """Row-major ``w`` with its codes in the ``bits``-wide form (5, 6 or 8, no narrower than its own;
    the same values)."""
    if w.bits == bits:
        return w
    return dataclasses.replace(w, quant=_pack_codes(np.asarray(unpack_codes(w)), bits), bits=bits)


# -- w4a8: group-quantized weights for int8 activations ----------------------------------------------


def quantize_wxa8(w: np.ndarray, bits: int) -> QuantArray:
    """Round-to-nearest ``w4a8``-format weights from a float ``[out, in]`` matrix: 4-bit as Q4_1
    (asymmetric, scale and minimum per group of 32), 8-bit as Q8_0 (symmetric per group of 32)."""
    if bits == 4:
        q = quantize_int4(w, 32)
        return QuantArray(q.quant, q.scale, q.offset, bits=4, group_size=32, act_bits=8)
    q = quantize_int8(w, 32)
    d = np.asarray(q.scale, np.float16)
    codes = (np.asarray(q.quant, np.int16) + 128).astype(np.uint8)
    return QuantArray(codes, d, (d.astype(np.float32) * -128).astype(np.float16), bits=8, group_size=32, act_bits=8)


# -- the native kernels' panel layout ----------------------------------------------------------------

#: Output rows per panel.
PANEL = 16


def to_panels(w: QuantArray) -> QuantArray:
    """A group-quantized (``w4a8``-format) matrix in the native kernels' panel layout, host side:
    for each 16 output rows and group of 32 inputs, the rows' code bytes become ``gb / 4`` runs of 16
    dwords (dword ``r`` of run ``t`` = bytes ``4t .. 4t+3`` of row ``r``'s group; ``gb`` = 16 code bytes
    per group for 4-bit, 20 for 5-bit (runs 0-3 the nibbles, run 4 the fifth bits), 24 for 6-bit (run
    5 the sixth bits), 32 for 8-bit),
    and in every per-row field (scales, offsets, k-quant sub-scales) the 16 rows' values of a column
    are consecutive. A permutation only: the same bytes,
    the same size. Matrices whose row count is not a multiple of 16 are returned as they are."""
    *lead, n, nbytes = w.quant.shape
    if w.panel or n % PANEL or not w.wxa8:
        return w
    groups = w.shape[-1] // ACT_GROUP
    gb = nbytes // groups
    q = np.asarray(w.quant).reshape(*lead, n // PANEL, PANEL, groups, gb // 4, 4)
    q = np.moveaxis(q, -4, -2)  # [..., panels, groups, gb/4, 16, 4]

    def rows(a: jax.Array | np.ndarray) -> np.ndarray:
        a = np.asarray(a)
        a = a.reshape(*lead, n // PANEL, PANEL, a.shape[-1])
        return np.ascontiguousarray(np.swapaxes(a, -1, -2)).reshape(*lead, n, -1)

    return _map_rows(w, rows, quant=np.ascontiguousarray(q).reshape(*lead, n, nbytes), panel=PANEL)


def from_panels(w: QuantArray) -> QuantArray:
    """The row-major form of a panel-layout matrix (the inverse of :func:`to_panels`, in jnp so it
    also runs inside a jitted step, for the XLA formulations)."""
    *lead, n, nbytes = w.quant.shape
    groups = w.shape[-1] // ACT_GROUP
    gb = nbytes // groups
    q = jnp.moveaxis(w.quant.reshape(*lead, n // PANEL, groups, gb // 4, PANEL, 4), -2, -4)

    def rows(a: jax.Array) -> jax.Array:
        cols = a.shape[-1]
        return jnp.swapaxes(a.reshape(*lead, n // PANEL, cols, PANEL), -1, -2).reshape(*lead, n, cols)

    return _map_rows(w, rows, quant=q.reshape(*lead, n, nbytes), panel=0)


def _panel_rows(w: QuantArray, ids: jax.Array) -> QuantArray:
    """Rows ``ids`` of an unstacked panel-layout matrix, row-major (embedding lookups)."""
    n, nbytes = w.quant.shape
    groups = w.shape[-1] // ACT_GROUP
    gb = nbytes // groups
    p, r = ids // PANEL, ids % PANEL
    q = w.quant.reshape(n // PANEL, groups, gb // 4, PANEL, 4)[p, :, :, r, :]  # [ids, groups, gb/4, 4]

    def rows(a: jax.Array) -> jax.Array:
        return a.reshape(n // PANEL, a.shape[-1], PANEL)[p, :, r]

    return _map_rows(w, rows, quant=q.reshape(-1, nbytes), panel=0)
