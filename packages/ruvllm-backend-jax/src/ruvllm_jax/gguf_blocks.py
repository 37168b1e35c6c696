"""GGUF blocks as :class:`~ruvllm_jax.quant.QuantArray`, every weight exactly the file's value, and
the layers of one weight in one storage form when the file's types differ by layer.

``from_gguf_blocks`` keeps Q8_0 / Q4_0 / Q4_1 for the weight-only paths; ``wxa8_from_gguf_blocks``
turns those and Q5_0 / Q5_1 and the k-quants Q2_K / Q3_K / Q4_K / Q5_K / Q6_K into the ``w4a8`` form the native
kernels multiply; ``kernel_form`` gives k-quants the form the kernels read at the file's size, and
``common_format`` brings mixed stacks to one form. Corrupt blocks (non-finite scales) and data of the wrong size are
:class:`ModelFormatError` here; the loader adds the tensor's name.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ruvllm.errors import BackendError, ModelFormatError, UnsupportedQuantizationError
from ruvllm_jax.quant import KQ_BLOCK, ROW_FIELDS, QuantArray, bit_plane, pack_codes, unpack_codes

#: GGUF block types that map onto :class:`QuantArray` without re-quantizing.
GGUF_DIRECT_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1"})
#: GGUF's k-quants: super-blocks of 256 values with integer sub-scales.
KQUANT_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})
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
    "Q2_K": (KQ_BLOCK, 84),
    "Q3_K": (KQ_BLOCK, 110),
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
    """Q5_0 / Q5_1 codes in the 5-bit form, ``[out, blocks * 20]``: the 16 ``qs`` bytes after byte
    ``at + 4`` (low nibbles: codes 0-15, high nibbles: codes 16-31) as they are, then the block's 4-byte
    ``qh`` at byte ``at`` (bit ``j`` of the little-endian word: code ``j``'s fifth bit) as the form's
    plane of fifth bits (:func:`ruvllm_jax.quant.bit_plane`)."""
    qh, qs = blocks[..., at : at + 4], blocks[..., at + 4 : at + 20]
    plane = bit_plane(np.unpackbits(qh, axis=-1, bitorder="little"))
    return np.concatenate([qs, plane], axis=-1).reshape(blocks.shape[0], -1)


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


def _two_bit_codes(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K's 64 code bytes per super-block -> 256 two-bit values: value ``128 c + 32 t + k``
    is bits ``2 t`` of byte ``32 c + k``."""
    runs = qs.reshape(*qs.shape[:-1], 2, 1, 32) >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    return (runs & 0x03).reshape(*qs.shape[:-1], KQ_BLOCK)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """The 12 scale bytes of Q3_K blocks -> 16 signed scales ``s - 32`` (int8) each: scale ``j``'s low
    nibble is byte ``j % 8``'s (low for ``j < 8``), its top two bits bits ``2 (j // 4)`` of byte
    ``8 + j % 4``."""
    low = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)
    pairs = (packed[..., None, 8:12] >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]) & 0x03
    return ((low | (pairs.reshape(*packed.shape[:-1], 16) << 4)).astype(np.int16) - 32).astype(np.int8)


def _sixteen_wide(codes: np.ndarray, d: np.ndarray, dm: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> QuantArray:
    """Codes below 16 ``[out, cols]`` in the form :func:`kernel_form` gives every k-quant: 4-bit,
    ``W = (d sc) code - (dm mn)``, float16 ``d``, ``dm`` per super-block, int8 ``sc``, ``mn`` per 16."""
    out, cols = codes.shape
    sub = dict(sub_scale=sc.reshape(out, cols // 16), sub_offset=mn.reshape(out, cols // 16), sub_group=16)
    return QuantArray(pack_codes(codes, 4), d, dm, bits=4, group_size=32, act_bits=8, **sub)


def wxa8_from_gguf_blocks(ggml_type: str, data: np.ndarray, shape: tuple[int, ...]) -> QuantArray:
    """GGUF blocks as a ``w4a8``-format :class:`QuantArray`, codes and scales bit for bit, so every
    weight dequantizes to the file's value:

    * Q4_1 as it is (``d * code + m``), Q4_0 with zero point 8 (no offset stored);
    * Q8_0's 8-bit codes stored as ``q + 128``, zero point 128;
    * Q5_0 / Q5_1 in the 5-bit form, their bytes reordered (zero point 16, and the file's ``m``);
    * Q4_K: ``scale`` / ``offset`` the float16 ``d`` / ``dmin`` per super-block of 256, ``sub_scale``
      / ``sub_offset`` the uint8 6-bit ``sc`` / ``mn`` per 32, ``W = d sc code - dmin mn``; the 4-bit
      codes repacked per group of 32 into the nibble order of Q4_0 (the file packs 64 values per 32
      bytes, low nibbles first): a permutation of nibbles;
    * Q5_K: the same scales, the 5-bit codes in the 5-bit form (per group of 32, as Q5_0's);
    * Q6_K: the 6-bit codes in the 6-bit form with zero point 32, ``d`` per super-block, the int8
      ``sc`` per 16 (``W = d sc (code - 32)``), no offset;
    * Q2_K / Q3_K (sub-blocks of 16), directly in the kernels' k-quant form, 4-bit codes: Q2_K's ``d``,
      ``dmin`` and 4-bit ``sc``, ``m`` per 16 (``W = d sc q - dmin m``); Q3_K's 3-bit codes ``q`` with
      ``d`` and ``4 d`` and its signed scale as both ``sc`` and ``mn`` (``W = d sc (q - 4)``), as
      :func:`kernel_form` puts Q6_K.

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
            return QuantArray(q.quant, d, None, bits=4, group_size=32, zero_point=8, act_bits=8)
        codes = (np.asarray(q.quant, np.int16) + 128).astype(np.uint8)
        return QuantArray(codes, d, None, bits=8, group_size=32, zero_point=128, act_bits=8)
    blocks = _gguf_blocks(ggml_type, data, shape)
    nb = cols // _GGUF_BLOCK[ggml_type][0]
    if ggml_type in ("Q5_0", "Q5_1"):
        d = _f16(blocks, 0, ggml_type)
        if ggml_type == "Q5_0":
            return QuantArray(_q5_groups(blocks, 2), d, None, bits=5, group_size=32, zero_point=16, act_bits=8)
        return QuantArray(_q5_groups(blocks, 4), d, _f16(blocks, 2, ggml_type), bits=5, group_size=32, act_bits=8)
    if ggml_type == "Q6_K":
        d = _f16(blocks, 208, ggml_type)
        shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]
        high = (blocks[..., 128:192].reshape(out, nb, 2, 1, 32) >> shifts) & 0x03  # [out, nb, 2, 4, 32]
        codes = _low_high(blocks[..., 0:128], 64) | (high.reshape(out, nb, KQ_BLOCK) << 4)
        sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(out, cols // 16)
        return QuantArray(
            pack_codes(codes.reshape(out, cols), 6),
            d,
            None,
            bits=6,
            group_size=32,
            zero_point=32,
            act_bits=8,
            sub_scale=sc,
            sub_group=16,
        )
    if ggml_type == "Q2_K":
        d, dmin = _f16(blocks, 80, ggml_type), _f16(blocks, 82, ggml_type)
        scales = blocks[..., 0:16]
        codes = _two_bit_codes(blocks[..., 16:80]).reshape(out, cols)
        return _sixteen_wide(codes, d, dmin, (scales & 0x0F).astype(np.int8), (scales >> 4).astype(np.int8))
    if ggml_type == "Q3_K":
        d = _f16(blocks, 108, ggml_type)
        with np.errstate(over="ignore"):
            d4 = (d.astype(np.float32) * 4).astype(np.float16)  # a power of two: exact unless it overflows
        if not np.all(np.isfinite(d4)):
            raise BackendError(
                "a Q3_K super-block scale above 16383 has no exact w4a8 form (load with quantization none)"
            )
        # Value 32 b + k's third bit: bit b of hmask byte k (set: no offset of -4, so it is q's bit 2).
        high = (blocks[..., 0:32].reshape(out, nb, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 0x01
        codes = _two_bit_codes(blocks[..., 32:96]) | (high.reshape(out, nb, KQ_BLOCK) << 2)
        sc = _q3_k_scales(blocks[..., 96:108])
        return _sixteen_wide(codes.reshape(out, cols), d, d4, sc, sc)
    d, dmin = _f16(blocks, 0, ggml_type), _f16(blocks, 2, ggml_type)
    sc, mn = _kquant_scales(blocks[..., 4:16])
    sub = dict(sub_scale=sc.reshape(out, cols // 32), sub_offset=mn.reshape(out, cols // 32), sub_group=32)
    if ggml_type == "Q4_K":
        packed = pack_codes(_low_high(blocks[..., 16:144], 32).reshape(out, cols), 4)
        return QuantArray(packed, d, dmin, bits=4, group_size=32, act_bits=8, **sub)
    high = (blocks[..., 16:48].reshape(out, nb, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 0x01
    codes = _low_high(blocks[..., 48:176], 32) | (high.reshape(out, nb, KQ_BLOCK) << 4)
    return QuantArray(pack_codes(codes.reshape(out, cols), 5), d, dmin, bits=5, group_size=32, act_bits=8, **sub)


#: GGUF MXFP4 (gpt-oss's experts): 32 values and one E8M0 scale byte per 17-byte block.
_MXFP4_BLOCK = (32, 17)
#: MXFP4's e2m1 values doubled, by code (ggml's ``kvalues_mxfp4``): a weight is this times ``2^(e - 128)``.
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int16)


def wxa8_from_mxfp4(data: np.ndarray, shape: tuple[int, ...]) -> QuantArray:
    """GGUF MXFP4 blocks in the 5-bit ``w4a8`` form, every weight the file's: a block's doubled e2m1
    values (-12 .. 12) plus 16 are 5-bit codes with zero point 16 (Q5_0's form, which the kernels
    multiply), its scale ``2^(e - 128)`` the float16 ``d`` (5.5 bits a weight against the file's 4.25).
    A scale outside float16's range (``e`` below 104 or above 143) has no exact form:
    :class:`BackendError` (the caller adds the tensor's name); data of the wrong size
    :class:`ModelFormatError`."""
    out, cols = shape
    block, nbytes = _MXFP4_BLOCK
    if cols % block:
        raise ModelFormatError(f"MXFP4 rows of {cols} values are not whole blocks of {block}")
    raw = np.ascontiguousarray(data, dtype=np.uint8)
    if raw.size != out * (cols // block) * nbytes:
        raise ModelFormatError(f"MXFP4 data of {raw.size} bytes does not match its shape {out} x {cols}")
    blocks = raw.reshape(out, cols // block, nbytes)
    e = blocks[..., 0].astype(np.int32)
    bad = np.argwhere((e < 104) | (e > 143))
    if len(bad):
        row, blk = (int(i) for i in bad[0])
        raise BackendError(
            f"MXFP4 block {blk} of row {row} has scale 2^{e[row, blk] - 128}, outside float16's range: "
            "no exact w4a8 form (load with quantization none)"
        )
    qs = blocks[..., 1:17]
    nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # element order: low nibbles, then high
    codes = (_MXFP4_VALUES[nibbles] + 16).astype(np.uint8).reshape(out, cols)
    d = np.ldexp(np.float32(1), e - 128).astype(np.float16)
    return QuantArray(pack_codes(codes, 5), d, None, bits=5, group_size=32, zero_point=16, act_bits=8)


def storage_format(w: QuantArray) -> tuple:
    """What matrices must share to be stacked into one :class:`QuantArray`: the static fields and
    which array fields are present, with their dtypes."""
    arrays = (w.quant, w.in_scale, *(getattr(w, f) for f in ROW_FIELDS))
    dtypes = tuple(None if a is None else np.dtype(a.dtype).str for a in arrays)
    return (w.bits, w.group_size, w.zero_point, w.act_bits, w.panel, w.sub_group, dtypes)


def kernel_form(w: QuantArray) -> QuantArray:
    """A k-quant in a form the native kernels read (``cpu_kernels.h``, KMatrix), as the file holds it:
    Q4_K / Q5_K with their ``d``, ``dmin`` per super-block and 6-bit ``sc``, ``mn`` per 32 as int8;
    Q6_K symmetric (zero point 32, no offset, ``sc`` int8 per 16). Nothing is widened, so the kernels
    read the file's bytes. Q2_K / Q3_K (already 16-wide) and other matrices come back unchanged."""
    if w.sub_group == 32:
        return dataclasses.replace(
            w, sub_scale=np.asarray(w.sub_scale).astype(np.int8), sub_offset=np.asarray(w.sub_offset).astype(np.int8)
        )
    if w.sub_group == 16 and w.offset is None:
        return dataclasses.replace(w, sub_scale=np.asarray(w.sub_scale).astype(np.int8))
    return w


def sixteen_form(w: QuantArray) -> QuantArray:
    """A k-quant in the 16-wide form every k-quant shares (what layers of one weight stored in
    different types are brought to, :func:`common_format`), the same values: no zero point,
    ``W = (scale sc) code - (offset mn)`` with ``scale`` / ``offset`` float16 per super-block, ``sc``
    and ``mn`` int8 per 16. Q4_K / Q5_K: their ``sc`` and ``mn`` each repeated per 16; Q6_K:
    ``offset = 32 d`` and ``mn = sc`` (so ``d sc (code - 32)``). Every product is exact in float32.
    Other matrices come back unchanged."""
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
    layers and Q4_K, or Q8_0 and Q5_0, in others), each converted exactly: one type's layers keep
    :func:`kernel_form`; k-quants of several types go to :func:`sixteen_form` (which every k-quant
    shares, its factors per layer), and codes to the widest form any layer has (4 < 5 < 6 < 8 bits:
    narrower codes fit a wider form with zero high bits, so Q4_K / Q5_K with Q6_K are stored 6-bit;
    with 8-bit codes in some layers all are stored one per byte). Symmetric layers (Q4_0, Q5_0,
    Q8_0: a zero point, no offset) mixed with others get their offsets ``-zero_point d`` stored, as
    the asymmetric ones carry theirs. Other mixes (k-quants with 32-group forms) come back unchanged
    for the caller to refuse."""
    if not all(w.wxa8 and not w.panel for w in mats):
        return mats
    mats = [kernel_form(w) for w in mats]
    if len({storage_format(w) for w in mats}) == 1:
        return mats
    mats = [sixteen_form(w) for w in mats]
    if len({storage_format(w) for w in mats}) == 1 or len({w.sub_group for w in mats}) > 1:
        return mats
    bits = max(w.bits for w in mats)
    mats = [_with_bits(w, bits) for w in mats]
    if len({storage_format(w) for w in mats}) > 1:
        mats = [_with_offset(w) for w in mats]
    return mats


def _with_offset(w: QuantArray) -> QuantArray:
    """A symmetric 32-group matrix with its offset ``-zero_point d`` stored (float16: exact, a power
    of two times a float16, unless it overflows) and no zero point; others unchanged."""
    if w.offset is not None or w.sub_group or not w.zero_point:
        return w
    with np.errstate(over="ignore"):
        m = (np.asarray(w.scale, np.float32) * -w.zero_point).astype(np.float16)
    if not np.all(np.isfinite(m)):
        raise BackendError("a block scale this large has no exact stacked w4a8 form (load with quantization none)")
    return dataclasses.replace(w, offset=m, zero_point=0)


def _with_bits(w: QuantArray, bits: int) -> QuantArray:
    """Row-major ``w`` with its codes in the ``bits``-wide form (5, 6 or 8, no narrower than its own;
    the same values)."""
    if w.bits == bits:
        return w
    return dataclasses.replace(w, quant=pack_codes(np.asarray(unpack_codes(w)), bits), bits=bits)
