"""GGUF k-quant blocks straight into the panel form the native kernels read, in one native pass
(``native/cpu_repack.cc``): the bytes :func:`ruvllm_jax.gguf_blocks.wxa8_from_gguf_blocks`,
:func:`~ruvllm_jax.gguf_blocks.kernel_form` (or :func:`~ruvllm_jax.gguf_blocks.common_format`'s
16-wide form and widening) and :func:`ruvllm_jax.quant.to_panels` give, without their whole-matrix
NumPy passes (about a minute of an 8B Q4_K_M file's first load). Other types and shapes go the NumPy
way."""

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


def native_repack_applies(ggml_type: str, shape: tuple[int, ...], bits: int | None = None) -> bool:
    """Whether :func:`repack_kquant` takes a matrix: a type it repacks, whole panels of 16 rows and
    super-blocks of 256, the kernels' native library loaded, and ``bits`` (the 16-wide form's code
    width; None: the type's own form) from its own width to 6."""
    if ggml_type not in NATIVE_REPACK_TYPES or len(shape) != 2 or not native.available():
        return False
    out, cols = shape
    own = NATIVE_REPACK_TYPES[ggml_type][1]
    return out % PANEL == 0 and cols % 256 == 0 and (bits is None or own <= bits <= 6)


def repack_kquant(ggml_type: str, data: np.ndarray, shape: tuple[int, ...], bits: int | None = None) -> QuantArray:
    """The file's blocks in the kernels' panel form in one pass: with ``bits`` None, the type's own
    form, ``to_panels(kernel_form(wxa8_from_gguf_blocks(ggml_type, data, shape)))`` (Q4_K / Q5_K
    with their scales and mins per 32, Q6_K symmetric: the file's bytes); with ``bits``, the 16-wide
    form one weight's layers of different types share, ``to_panels(common_format(...))``'s with
    ``bits``-wide codes. The same bytes as those NumPy conversions. Data of the wrong size and
    non-finite factors are :class:`ModelFormatError`, a Q6_K factor with no exact 32-fold in float16
    (16-wide form) a :class:`BackendError` (as the NumPy conversion's; the caller adds the tensor's
    name)."""
    if not native_repack_applies(ggml_type, shape, bits):
        raise BackendError(f"no native repack of {ggml_type} {shape} to {bits}-bit codes")
    out, cols = shape
    src = np.ascontiguousarray(data, dtype=np.uint8)
    want = out * (cols // 256) * _BLOCK_BYTES[ggml_type]
    if src.size != want:
        raise ModelFormatError(
            f"{ggml_type} data of {src.size} bytes does not match its shape {out} x {cols} ({want} bytes)"
        )
    own_form = bits is None
    width = NATIVE_REPACK_TYPES[ggml_type][1] if own_form else bits
    symmetric = own_form and ggml_type == "Q6_K"
    sub = 32 if own_form and not symmetric else 16
    q = np.empty((out, cols // 32 * _GROUP_BYTES[width]), np.uint8)
    d = np.empty((out, cols // 256), np.float16)
    dm = None if symmetric else np.empty_like(d)
    sc = np.empty((out, cols // sub), np.int8)
    mn = None if symmetric else np.empty_like(sc)
    row, block = ctypes.c_int64(-1), ctypes.c_int64(-1)
    lib = native.library()
    fn = lib.ruvllm_repack_kquant
    fn.restype = ctypes.c_int
    ptr = ctypes.c_void_p
    fn.argtypes = [ptr, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, *[ptr] * 5, ptr, ptr]
    code = fn(
        *(src.ctypes.data, out, cols, NATIVE_REPACK_TYPES[ggml_type][0], width, int(own_form)),
        *(None if a is None else a.ctypes.data for a in (q, d, dm, sc, mn)),
        ctypes.byref(row),
        ctypes.byref(block),
    )
    if code == 1:
        raise ModelFormatError(f"{ggml_type} block {block.value} of row {row.value} has a non-finite scale")
    if code == 2:
        raise BackendError("a Q6_K super-block scale above 2047 has no exact w4a8 form (load with quantization none)")
    if code != 0:
        raise BackendError(f"native repack refused {ggml_type} {shape} to {width}-bit codes (code {code})")
    return QuantArray(
        q,
        d,
        dm,
        bits=width,
        group_size=32,
        zero_point=32 if symmetric else 0,
        act_bits=8,
        panel=PANEL,
        sub_scale=sc,
        sub_offset=mn,
        sub_group=sub,
    )
