"""GGUF blocks in MLX's affine quantized form (``w = scale * code + bias`` per group of 32 values,
codes packed little-endian into uint32 words, as ``mx.quantize`` lays them out).

Exact types, every weight dequantizing to the file's value bit for bit:

* Q4_1 / Q5_1: ``scale = d``, ``bias = m``;
* Q4_0 / Q5_0 / Q8_0 (symmetric): the codes shifted to unsigned (Q8_0: ``q + 128``), ``bias`` then
  ``-8 d``, ``-16 d``, ``-128 d``;
* Q4_K / Q5_K (sub-blocks of 32): ``scale = d * sc``, ``bias = -dmin * m`` per sub-block;
* Q3_K (sub-blocks of 16, ``w = d (s - 32) (q - 4)``): the products ``(s - 32) (q - 4)`` run from
  -124 to 128, so they are 8-bit codes ``p + 124`` under one ``scale = d`` and ``bias = -124 d`` for
  the whole super-block, whatever the sub-blocks' scales.

Scales and biases are float32: ``d * sc`` (11 + 6 significant bits) and ``scale * code`` (+ 5) are
exact there, so each weight is one rounding of the exact value, as the reference dequantizer's.

Q6_K and Q2_K have sub-blocks of 16 with scales (and Q2_K's minimums) no group of 32 can hold, and
their products with the codes do not fit 8 bits: their weights go to the nearest MLX form, codes per
32 rounded from the file's values (:data:`NEAREST_FORMS`; the error is measured in
tests/test_mlx_gguf_blocks.py and docs/mlx-backend.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ruvllm.errors import ModelFormatError, UnsupportedQuantizationError

#: MLX's group size for every GGUF form (its smallest: GGUF's blocks and sub-blocks are 32 wide).
GROUP = 32
#: Types held exactly, with their code width.
EXACT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q3_K": 8, "Q4_K": 4, "Q5_K": 5}
#: Types with no exact MLX form: the form they are rounded to (bits per code, group 32).
NEAREST_FORMS = {"Q2_K": 8, "Q6_K": 8}
#: (values, bytes) per block.
_BLOCK = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}


@dataclass(frozen=True)
class AffineBlocks:
    """A matrix ``[out, cols]`` in MLX's quantized form, as NumPy arrays: ``packed`` uint32 ``[out,
    cols * bits / 32]``, ``scales`` and ``biases`` float32 ``[out, cols / 32]``."""

    packed: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int


def _blocks(ggml_type: str, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``data`` as uint8 ``[out, blocks, block bytes]``; a size the shape does not imply is corrupt."""
    out, cols = shape
    block, nbytes = _BLOCK[ggml_type]
    if cols % block:
        raise ModelFormatError(f"{ggml_type} rows of {cols} values are not whole blocks of {block}")
    raw = np.ascontiguousarray(data, dtype=np.uint8)
    if raw.size != out * (cols // block) * nbytes:
        raise ModelFormatError(f"{ggml_type} data of {raw.size} bytes does not match its shape {out} x {cols}")
    return raw.reshape(out, cols // block, nbytes)


def _f16(blocks: np.ndarray, at: int, ggml_type: str) -> np.ndarray:
    """The float16 field at byte ``at`` of every block as float32 ``[out, blocks]``; a non-finite one
    marks a corrupt block."""
    v = blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    if not np.isfinite(v).all():
        row, blk = (int(i) for i in np.argwhere(~np.isfinite(v))[0])
        raise ModelFormatError(f"{ggml_type} block {blk} of row {row} has a non-finite scale")
    return v


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Code bytes in value order: per run of ``width`` bytes, the low nibbles are ``width`` values
    and the high nibbles the next ``width``."""
    runs = qs.reshape(*qs.shape[:-1], -1, 1, width)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=-2).reshape(*qs.shape[:-1], -1)


def _bits_of(words: np.ndarray, count: int) -> np.ndarray:
    """Bits ``0 .. count`` of little-endian bytes ``[..., count / 8]`` as 0/1 values ``[..., count]``."""
    return np.unpackbits(words, axis=-1, count=count, bitorder="little")


def _kquant_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of a Q4_K / Q5_K block -> 8 six-bit ``sc`` and 8 six-bit ``m``."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """The 12 scale bytes of a Q3_K block -> 16 six-bit scales ``s`` (int16, before ``- 32``): scale
    ``j``'s low nibble is byte ``j % 8``'s (low for ``j < 8``), its top two bits bits ``2 (j // 4)``
    of byte ``8 + j % 4``."""
    low = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)
    pairs = (packed[..., None, 8:12] >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]) & 3  # [t, i]
    return low.astype(np.int16) | (pairs.reshape(*packed.shape[:-1], 16).astype(np.int16) << 4)


def decode_codes(ggml_type: str, data: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An exact type's blocks as unsigned codes uint8 ``[out, cols]`` and float32 ``scale``,
    ``bias`` ``[out, cols / 32]`` with ``w = scale * code + bias``."""
    out, cols = shape
    blocks = _blocks(ggml_type, data, shape)
    groups = cols // GROUP
    if ggml_type == "Q8_0":
        d = _f16(blocks, 0, ggml_type)
        codes = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes.reshape(out, cols), d, -128.0 * d
    if ggml_type in ("Q4_0", "Q4_1"):
        d = _f16(blocks, 0, ggml_type)
        at = 2 if ggml_type == "Q4_0" else 4
        codes = _nibbles(blocks[..., at : at + 16], 16).reshape(out, cols)
        return codes, d, (-8.0 * d if ggml_type == "Q4_0" else _f16(blocks, 2, ggml_type))
    if ggml_type in ("Q5_0", "Q5_1"):
        d = _f16(blocks, 0, ggml_type)
        at = 2 if ggml_type == "Q5_0" else 4
        high = _bits_of(blocks[..., at : at + 4], 32)  # bit j of the little-endian word: code j's fifth bit
        codes = _nibbles(blocks[..., at + 4 : at + 20], 16) | (high << 4)
        bias = -16.0 * d if ggml_type == "Q5_0" else _f16(blocks, 2, ggml_type)
        return codes.reshape(out, cols), d, bias
    if ggml_type in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks, 0, ggml_type), _f16(blocks, 2, ggml_type)
        sc, mn = _kquant_scales(blocks[..., 4:16])
        if ggml_type == "Q4_K":
            codes = _nibbles(blocks[..., 16:144], 32)
        else:
            # qh byte l, bit s: the fifth bit of value l of sub-block s.
            high = _bits_of(blocks[..., 16:48, None], 8).swapaxes(-1, -2).reshape(out, -1, 256)
            codes = _nibbles(blocks[..., 48:176], 32) | (high << 4)
        scale = (d[..., None] * sc).reshape(out, groups)
        bias = (-(dmin[..., None] * mn)).reshape(out, groups)
        return codes.reshape(out, cols), scale, bias
    if ggml_type == "Q3_K":
        d = _f16(blocks, 108, ggml_type)
        # Value 128 c + 32 t + k: bits 2 t of qs byte 32 c + k, and its third bit is bit 4 c + t of
        # hmask byte k (set: no offset of -4).
        low = (blocks[..., 32:96].reshape(out, -1, 2, 1, 32) >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]) & 3
        high = _bits_of(blocks[..., 0:32, None], 8).swapaxes(-1, -2)
        q = low.reshape(out, -1, 256).astype(np.int16) + (high.reshape(out, -1, 256).astype(np.int16) << 2) - 4
        sc = _q3_k_scales(blocks[..., 96:108]) - 32
        products = sc[..., None] * q.reshape(out, -1, 16, 16)  # -124 .. 128
        codes = (products + 124).astype(np.uint8).reshape(out, cols)
        scale = np.repeat(d, 256 // GROUP, axis=-1)
        return codes, scale, -124.0 * scale
    raise UnsupportedQuantizationError(f"GGUF type {ggml_type} has no exact MLX form")


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes below ``2**bits`` ``[out, cols]`` -> MLX's packing: each row one little-endian bit
    stream of ``bits``-wide codes, read as uint32 words."""
    out, cols = codes.shape
    if bits in (4, 8):  # whole nibbles or bytes: no bit stream needed
        c = codes.astype(np.uint8)
        by = c if bits == 8 else (c[:, 0::2] | (c[:, 1::2] << 4))
        return np.ascontiguousarray(by).view(np.uint32).reshape(out, cols * bits // 32)
    stream = ((codes[..., None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(out, cols * bits)
    return np.packbits(stream, axis=-1, bitorder="little").view(np.uint32).reshape(out, cols * bits // 32)


def affine_from_gguf(ggml_type: str, data: np.ndarray, shape: tuple[int, ...]) -> AffineBlocks:
    """An exact type's blocks in MLX's form (see the module doc)."""
    if ggml_type not in EXACT_BITS:
        raise UnsupportedQuantizationError(
            f"GGUF type {ggml_type} has no exact MLX form (exact: {', '.join(sorted(EXACT_BITS))})"
        )
    codes, scale, bias = decode_codes(ggml_type, data, shape)
    bits = EXACT_BITS[ggml_type]
    return AffineBlocks(pack_codes(codes, bits), np.ascontiguousarray(scale), np.ascontiguousarray(bias), bits)


def nearest_affine(values: np.ndarray, bits: int) -> AffineBlocks:
    """Float weights ``[out, cols]`` rounded to ``bits``-bit codes per group of 32, ``scale`` spanning
    each group's range and ``bias`` its minimum: every weight within half a step (``scale / 2``) of
    its value. (``mx.quantize`` moves the range to hold zero exactly, which can cost more.)"""
    out, cols = values.shape
    if cols % GROUP:
        raise ModelFormatError(f"rows of {cols} values are not whole groups of {GROUP}")
    groups = values.reshape(out, cols // GROUP, GROUP).astype(np.float32)
    if not np.isfinite(groups).all():  # a NaN or infinite block scale in the file: its range would be NaN
        row, group = (int(i) for i in np.argwhere(~np.isfinite(groups).all(-1))[0])
        raise ModelFormatError(f"group {group} of row {row} has a non-finite value (a corrupt block scale)")
    low, high = groups.min(-1), groups.max(-1)
    scale = (high - low) / np.float32((1 << bits) - 1)
    scale[scale == 0] = 1.0  # a constant group: every code 0 decodes to ``low`` exactly
    codes = np.clip(np.rint((groups - low[..., None]) / scale[..., None]), 0, (1 << bits) - 1).astype(np.uint8)
    return AffineBlocks(pack_codes(codes.reshape(out, cols), bits), scale, low, bits)
