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
  the codes' low 4 bits in the int4 order (16 bytes), then a 4-byte plane of their fifth bits in which
  bit ``i`` of byte ``k`` is code ``4 i + k``'s (GGUF Q5_0's ``qs``, then its ``qh`` with the bits of
  the 32-bit word transposed as a 4 x 8 matrix). Byte ``k`` of the plane sits beside nibble bytes
  ``k, 4 + k, 8 + k, 12 + k``, whose codes' bits it holds, in the order the kernels unpack four codes
  at a time, so a vector of nibble bytes gets its fifth bits with one shift and one mask. See
  :func:`unpack_codes`.
* 6-bit (``bits=6``, ``w4a8`` only, GGUF Q6_K's codes): ``quant`` uint8 ``[out, in // 32 * 24]``, the
  low 4 bits as in the 4- and 5-bit forms (16 bytes), then 4 bytes of the bit pairs 4-5 of codes 0..15
  and 4 of codes 16..31: bits ``2 t, 2 t + 1`` of pair byte ``k`` are those of code ``4 t + k`` (or
  ``16 + 4 t + k``). Byte ``k`` again sits beside the nibble bytes whose codes it completes, so a
  vector of nibble bytes gets both high bits with one shift and one mask.
* k-quants (GGUF Q4_K / Q5_K / Q6_K, ``sub_group`` > 0): two-level scales, as in the file. ``scale``
  (and ``offset``) are float16 ``[out, in // 256]``, one per super-block; ``sub_scale`` (and
  ``sub_offset``) are small integers ``[out, in // sub_group]``; ``W = scale * sub_scale * (code -
  zero_point) - offset * sub_offset``. See :func:`ruvllm_jax.gguf_blocks.wxa8_from_gguf_blocks`.
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

from ruvllm.errors import BackendError

#: ``LoadOptions.quantization`` values this backend understands. ``w4a8`` is llama.cpp's CPU scheme:
#: weights in groups of 32 (4-bit codes with a float16 scale and offset per group, GGUF Q4_0 / Q4_1
#: blocks kept as they are; the tied embedding / output projection 8-bit, Q8_0; a GGUF's k-quant
#: blocks with their two-level scales), activations quantized to int8 per group of 32 at run time; see
#: :func:`_linear_wxa8` and :func:`_linear_kquant`. ``w8a8`` is int8 weights (one scale
#: per output channel) times int8 activations (one scale per token, chosen at run time): XLA's CPU
#: backend runs that product in an integer GEMM kernel several times faster than any float or
#: weight-only form, which is why it exists (see docs/performance-journal.md for speed and quality).
QUANTIZATIONS = ("none", "q8", "q4", "w8a8", "w4a8", "fp8")
#: ``q8`` is the w8a16 form on a GPU: int8 weights (a float16 scale per group of 32) dequantized to the
#: compute dtype (bfloat16 there) inside the product, activations left in it. ``fp8`` is float8 e4m3
#: weights with a float32 scale per output channel, upcast to the compute dtype in the product (see
#: :func:`quantize_fp8`): half bf16's bytes, read by XLA on CUDA straight into the fused product.
#: Group size of RTN int8 / int4 (GGUF's block size, so both paths share one layout).
Q_GROUP = 32
#: Inputs per k-quant super-block (GGUF's ``QK_K``): one float16 ``d`` (and ``dmin``) per row each.
KQ_BLOCK = 256


@jax.tree_util.register_dataclass
@dataclass
class QuantArray:
    quant: jax.Array
    scale: jax.Array
    #: Per-group additive term (GGUF Q4_1's minimum); None for symmetric formats (whose zero point
    #: does the job: ``(code - zero_point) * scale``).
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
    #: k-quants: per-sub-group integer factors of ``scale`` and ``offset``, ``[..., out, in //
    #: sub_group]``: as in the file (uint8 6-bit for Q4_K / Q5_K, int8 for Q6_K) from
    #: :func:`~ruvllm_jax.gguf_blocks.wxa8_from_gguf_blocks`, int8 per 16 in the form the loader keeps
    #: and the kernels read (:func:`~ruvllm_jax.gguf_blocks.kernel_form`).
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
        with an offset (Q4_1, Q5_1) or a zero point (the symmetric Q4_0, Q5_0, Q8_0: no offset is
        stored, the kernels form ``-zero_point * d``), and the k-quants."""
        return self.act_bits == 8 and (self.offset is not None or self.zero_point > 0 or self.sub_group > 0)

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
    gb = 4 * w.bits  # bytes per group of 32: 16 of low nibbles, then 4 (5-bit) or 8 (6-bit) of high bits
    g = q.reshape(*lead, out, nbytes // gb, gb)
    codes = _unpack_nibbles(g[..., :16], 32)
    if w.bits == 5:
        # Bit i of plane byte k is code 4 i + k's bit 4: [.., k, i] -> [.., i, k] -> code order.
        bit = xp.swapaxes((g[..., 16:20, None] >> xp.arange(8, dtype=xp.uint8)) & 1, -1, -2)
        high = bit.reshape(codes.shape) << 4
    else:
        # Bits 2 t, 2 t + 1 of pair byte k (of codes 0..15, then 16..31) are code 4 t + k's bits 4-5:
        # [.., half, k, t] -> [.., half, t, k] -> code order.
        pairs = g[..., 16:24].reshape(*g.shape[:-1], 2, 4, 1)
        two = (pairs >> (2 * xp.arange(4, dtype=xp.uint8))) & 3
        high = xp.swapaxes(two, -1, -2).reshape(codes.shape) << 4
    return (codes | high).reshape(*lead, out, nbytes // gb * 32)


def bit_plane(bits: np.ndarray) -> np.ndarray:
    """0/1 bits ``[..., 32]`` of the codes of groups (code order) -> their 4-byte planes ``[..., 4]``
    (bit ``i`` of byte ``k``: code ``4 i + k``'s bit; see the module docstring)."""
    by_byte = np.swapaxes(np.asarray(bits, np.uint8).reshape(*bits.shape[:-1], 8, 4), -1, -2)
    return np.packbits(by_byte, axis=-1, bitorder="little").reshape(*bits.shape[:-1], 4)


def bit_pairs(pairs: np.ndarray) -> np.ndarray:
    """Bits 4-5 of the codes of groups ``[..., 32]`` (code order, values 0..3) -> the 6-bit form's 8
    pair bytes ``[..., 8]`` (bits ``2 t, 2 t + 1`` of byte ``k``: code ``4 t + k``'s; of byte ``4 + k``:
    code ``16 + 4 t + k``'s; see the module docstring)."""
    p = np.asarray(pairs, np.uint8).reshape(*pairs.shape[:-1], 2, 4, 4).astype(np.uint16)  # [.., half, t, k]
    shifted = p << (2 * np.arange(4, dtype=np.uint16))[:, None]
    return shifted.sum(-2).astype(np.uint8).reshape(*pairs.shape[:-1], 8)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes below ``2**bits``, ``[..., out, in]`` -> the ``bits``-wide form of groups of 32
    (host side; the inverse of :func:`unpack_codes`)."""
    if bits == 8:
        return codes
    *lead, out, cols = codes.shape
    g = codes.reshape(*lead, out, cols // 32, 32)
    high = [] if bits == 4 else [bit_plane((g >> 4) & 1)] if bits == 5 else [bit_pairs(g >> 4)]
    packed = np.concatenate([_pack_nibbles(g & 0x0F, 32), *high], axis=-1)
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


def true_divide(a: jax.Array, b: jax.Array | float) -> jax.Array:
    """``a / b`` rounded as one IEEE division, as the native kernels divide. XLA's simplifier turns a
    division by a constant or by a broadcast value into a multiplication by its reciprocal, which
    rounds differently: activations quantized by XLA then differed from the native kernels' codes in
    a few elements of some rows, so a w8a8 row's product depended on whether its step was small
    enough for the kernels (issue 61). The barrier hides the divisor's origin from the simplifier."""
    return a / lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape))


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
    x_scale = jnp.where(amax > 0, true_divide(amax, 127.0), 1.0)
    xq = jnp.clip(jnp.round(true_divide(xf, x_scale)), -127, 127).astype(jnp.int8)
    acc = lax.dot_general(xq, w.quant, (((1,), (w.quant.ndim - 1,)), ((), ())), preferred_element_type=jnp.int32)
    y = _w8a8_rescale(acc, x_scale, w.scale[..., 0])
    return y[:rows].reshape(*lead, -1).astype(x.dtype)


def _w8a8_rescale(acc: jax.Array, x_scale: jax.Array, w_scale: jax.Array) -> jax.Array:
    """``(float(acc) * x_scale) * w_scale``. On the CPU with the native kernels loaded, their custom
    call, so that the result is the rounded product the kernels return for a small step (issue 61:
    fused into its consumer, XLA:CPU contracted the last multiply and the residual add into one FMA);
    elsewhere XLA's multiplies."""
    from ruvllm_jax import native

    def xla(a: jax.Array, xs: jax.Array, ws: jax.Array) -> jax.Array:
        return a.astype(jnp.float32) * xs * ws.astype(jnp.float32)

    if not native.available():
        return xla(acc, x_scale, w_scale)
    return lax.platform_dependent(acc, x_scale, w_scale, cpu=native.w8a8_rescale, default=xla)


#: Group size of the ``w4a8`` format, for weights and activations alike (GGUF's block size).
ACT_GROUP = 32


def quantize_activation_groups(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x`` ``[rows, K]`` -> (int8 codes ``[rows, K / 32, 32]``, scale ``dx`` and ``dx * sum(codes)``
    ``[rows, K / 32]``): per group of 32, ``dx = max|x| / 127`` and codes ``round(x / dx)`` (half to
    even, clipped to +-127), all-zero groups all zero. The native kernel computes the same."""
    rows, cols = x.shape
    xg = x.astype(jnp.float32).reshape(rows, cols // ACT_GROUP, ACT_GROUP)
    amax = jnp.max(jnp.abs(xg), axis=-1)
    dx = true_divide(amax, 127.0)
    safe = jnp.where(amax > 0, dx, 1.0)
    xq = jnp.where(amax[..., None] > 0, jnp.clip(jnp.round(true_divide(xg, safe[..., None])), -127, 127), 0)
    xq = xq.astype(jnp.int8)
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
    # A symmetric format's m = -zero_point * d (exact: a power of two times a float16).
    m = w.offset.astype(jnp.float32) if w.offset is not None else -float(w.zero_point) * d
    y = y + jnp.einsum("rg,og->ro", sx, m, precision=lax.Precision.HIGHEST)
    return y.reshape(*lead, out).astype(x.dtype)


def _linear_kquant(x: jax.Array, w: QuantArray) -> jax.Array:
    """``x @ w.T`` for k-quant weights and activations quantized per group of 32 (as for
    :func:`_linear_wxa8`), in the native kernels' arithmetic (``cpu_kernels.h``, KMatrix): per half
    group ``h`` of 16 inputs (inside activation group ``g``) the integer dot ``p_h = codes . xq`` and
    ``isum_h = sum(xq)`` exact in int32; then, in float32, ``y = sum_h p_h (d sc_h) dx_g - (dmin
    mn_h) dx_g isum_h`` with the exact products of :func:`_kquant_factors`, a 32-wide sub-group's
    factors read for both its halves and a symmetric one's ``dmin mn_h = zero_point d sc_h`` (a power
    of two: exact). This is the reference the native kernels are checked against."""
    if w.panel:
        w = from_panels(w)
    lead, cols = x.shape[:-1], x.shape[-1]
    xq, dx, _ = quantize_activation_groups(x.reshape(-1, cols))
    rows, sg = xq.shape[0], 16
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
    dxh = jnp.repeat(dx, ACT_GROUP // sg, axis=-1)  # [rows, subs]: each half group's activation scale
    d, m = _kquant_factors(w)  # [out, in // sub_group]
    if m is None:
        m = d * jnp.float32(w.zero_point)
    elif w.zero_point:
        raise BackendError("a k-quant with both a zero point and offsets has no kernel form")
    if w.sub_group != sg:
        d, m = (jnp.repeat(a, w.sub_group // sg, axis=-1) for a in (d, m))
    y = jnp.einsum("hro,oh,rh->ro", p.astype(jnp.float32), d, dxh, precision=lax.Precision.HIGHEST)
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


def quantize_int8(w: np.ndarray | jax.Array, group_size: int | None = Q_GROUP) -> QuantArray:
    """Round-to-nearest symmetric int8 of a float ``[..., out, in]`` matrix, one float16 scale per
    group of ``group_size`` inputs (GGUF Q8_0's layout), or one float32 scale per output channel when
    ``group_size`` is None. NumPy at load; a jax array is quantized where it lives (benchmarks make
    8B-shaped weights on the device)."""
    xp = _xp(w)
    *lead, cols = w.shape
    gs = cols if group_size is None else group_size
    if cols % gs:
        raise BackendError(f"int8 quantization: {cols} input features are not a multiple of group size {gs}")
    g = w.astype(xp.float32).reshape(*lead, cols // gs, gs)
    amax = xp.abs(g).max(axis=-1)
    scale = (amax / 127.0).astype(xp.float32 if group_size is None else xp.float16)
    inv = xp.where(scale != 0, 1.0 / scale.astype(xp.float32), 0.0)
    q = xp.clip(xp.rint(g * inv[..., None]), -127, 127).astype(xp.int8)
    return QuantArray(q.reshape(*lead, cols), scale, None, bits=8, group_size=gs)


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
    if mode == "fp8":
        return quantize_fp8(w)
    if mode == "w8a8":
        return quantize_w8a8(w)
    if mode == "q8":
        return quantize_int8(w)
    if mode == "q4":
        return quantize_int4(w)
    raise BackendError(f"unknown quantization {mode!r} (known: {', '.join(QUANTIZATIONS)})")


# -- fp8: float8 e4m3 weights, weight-only ------------------------------------------------------------

#: The largest finite float8 e4m3fn value; a row's largest magnitude is scaled to it.
FP8_MAX = 448.0


def quantize_fp8(w: np.ndarray | jax.Array) -> QuantArray:
    """float8 e4m3 (``jnp.float8_e4m3fn``, round to nearest even) of a float ``[..., out, in]`` matrix
    with one float32 scale per output channel: row ``o`` is divided by ``max|w[o]| / 448`` so its
    largest weight lands on e4m3's largest finite value (NumPy at load; a jax array on its device).

    Per channel rather than per group: e4m3 carries an exponent in every element, so its relative
    precision (3 mantissa bits) is the same across 2^-6..448 and a finer scale buys range only,
    not precision (the few weights below 2^-6 of a row's maximum x 448 become subnormal, which is where
    per-group scales would help, and those weights matter least to the product). One scale per row
    also multiplies the product's output column (:func:`linear`'s per-channel path), after the
    dot, so the GEMM reads nothing but the e4m3 bytes and XLA on CUDA fuses the upcast into its operand
    load; a scale per group would sit inside the reduction."""
    xp = _xp(w)
    g = w.astype(xp.float32)
    amax = xp.abs(g).max(axis=-1, keepdims=True)
    scale = xp.where(amax > 0, amax / FP8_MAX, 1.0).astype(xp.float32)
    # Clipped: the division may land a hair above 448, and e4m3fn has no infinity (it would be NaN).
    q = xp.clip(g / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return QuantArray(q, scale, None, bits=8, group_size=g.shape[-1])


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
    return QuantArray(codes, d, None, bits=8, group_size=32, zero_point=128, act_bits=8)


# -- the native kernels' panel layout ----------------------------------------------------------------

#: Output rows per panel.
PANEL = 16


def to_panels(w: QuantArray) -> QuantArray:
    """A group-quantized (``w4a8``-format) matrix in the native kernels' panel layout, host side:
    for each 16 output rows and group of 32 inputs, the rows' code bytes become ``gb / 4`` runs of 16
    dwords (dword ``r`` of run ``t`` = bytes ``4t .. 4t+3`` of row ``r``'s group; ``gb`` = 16 code bytes
    per group for 4-bit, 20 for 5-bit (runs 0-3 the nibbles, run 4 the fifth bits), 24 for 6-bit (runs
    4 and 5 the bit pairs of codes 0..15 and 16..31), 32 for 8-bit),
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
