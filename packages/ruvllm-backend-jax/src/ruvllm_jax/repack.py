"""GGUF k-quant blocks straight into the panel form the native kernels read, in one native pass
(``native/cpu_repack.cc``): the bytes :func:`ruvllm_jax.gguf_blocks.wxa8_from_gguf_blocks`,
:func:`~ruvllm_jax.gguf_blocks.kernel_form`, :func:`~ruvllm_jax.gguf_blocks.common_format`'s widening
and :func:`ruvllm_jax.quant.to_panels` give, without their whole-matrix NumPy passes (about a minute
of an 8B Q4_K_M file's first load). Other types and shapes go the NumPy way."""

from __future__ import annotations

import ctypes

import numpy as np

from ruvllm.errors import BackendError, ModelFormatError
from ruvllm_jax import native
from ruvllm_jax.quant import PANEL, QuantArray

#: The types repacked natively, with their own code width, by ggml type id.
NATIVE_REPACK_TYPES = {"Q4_K": (12, 4), "Q5_K": (13, 5), "Q6_K": (14, 6)}
_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_GROUP_BYTES = {4: 16, 5: 20, 6: 24}


def native_repack_applies(ggml_type: str, shape: tuple[int, ...], bits: int) -> bool:
    """Whether :func:`repack_kquant` takes a matrix: a type it repacks, whole panels of 16 rows and
    super-blocks of 256, the kernels' native library loaded, and ``bits`` from its own width to 6."""
    if ggml_type not in NATIVE_REPACK_TYPES or len(shape) != 2 or not native.available():
        return False
    out, cols = shape
    return out % PANEL == 0 and cols % 256 == 0 and NATIVE_REPACK_TYPES[ggml_type][1] <= bits <= 6


def repack_kquant(ggml_type: str, data: np.ndarray, shape: tuple[int, ...], bits: int) -> QuantArray:
    """``to_panels(common-format(kernel_form(wxa8_from_gguf_blocks(ggml_type, data, shape))))`` with
    ``bits``-wide codes, the same bytes, from the file's blocks in one pass. Data of the wrong size and
    non-finite factors are :class:`ModelFormatError`, a Q6_K factor with no exact 32-fold in float16 a
    :class:`BackendError` (as the NumPy conversion's; the caller adds the tensor's name)."""
    if not native_repack_applies(ggml_type, shape, bits):
        raise BackendError(f"no native repack of {ggml_type} {shape} to {bits}-bit codes")
    out, cols = shape
    src = np.ascontiguousarray(data, dtype=np.uint8)
    want = out * (cols // 256) * _BLOCK_BYTES[ggml_type]
    if src.size != want:
        raise ModelFormatError(
            f"{ggml_type} data of {src.size} bytes does not match its shape {out} x {cols} ({want} bytes)"
        )
    q = np.empty((out, cols // 32 * _GROUP_BYTES[bits]), np.uint8)
    d = np.empty((out, cols // 256), np.float16)
    dm = np.empty_like(d)
    sc = np.empty((out, cols // 16), np.int8)
    mn = np.empty_like(sc)
    row, block = ctypes.c_int64(-1), ctypes.c_int64(-1)
    lib = native.library()
    fn = lib.ruvllm_repack_kquant
    fn.restype = ctypes.c_int
    ptr = ctypes.c_void_p
    fn.argtypes = [ptr, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, *[ptr] * 5, ptr, ptr]
    arrays = (src, q, d, dm, sc, mn)
    code = fn(
        *(arrays[0].ctypes.data, out, cols, NATIVE_REPACK_TYPES[ggml_type][0], bits),
        *(a.ctypes.data for a in arrays[1:]),
        ctypes.byref(row),
        ctypes.byref(block),
    )
    if code == 1:
        raise ModelFormatError(f"{ggml_type} block {block.value} of row {row.value} has a non-finite scale")
    if code == 2:
        raise BackendError("a Q6_K super-block scale above 2047 has no exact w4a8 form (load with quantization none)")
    if code != 0:
        raise BackendError(f"native repack refused {ggml_type} {shape} to {bits}-bit codes (code {code})")
    return QuantArray(
        q, d, dm, bits=bits, group_size=32, act_bits=8, panel=PANEL, sub_scale=sc, sub_offset=mn, sub_group=16
    )
