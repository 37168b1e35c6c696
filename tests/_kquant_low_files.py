"""GGUF Q2_K and Q3_K blocks for tests: a NumPy round-to-nearest quantizer for each, written from
ggml's bit layouts (gguf-py decodes them but cannot encode them), and random valid blocks.

Importing this module registers both quantizers with :func:`_kquant_files.quantize`, so
``requantize_gguf`` writes them too. (They live here rather than in ``_kquant_files``, whose bytes key
the cached SmolLM2 Q4_K_M: an edit there would write that file again.)

Layouts (``QK_K`` = 256 values per super-block, sub-blocks of 16):

* Q2_K, 84 bytes: 16 scale bytes (``sc`` in the low nibble, ``m`` in the high one), 64 bytes of
  2-bit codes (value ``128 c + 32 t + k`` in bits ``2 t`` of byte ``32 c + k``), float16 ``d`` and
  ``dmin``; ``w = d sc q - dmin m``.
* Q3_K, 110 bytes: 32 ``hmask`` bytes (value ``32 b + k``'s third bit is bit ``b`` of byte ``k``; set
  means no offset), 64 bytes of low 2-bit codes as Q2_K's, 12 bytes of 6-bit scales (low nibbles of
  scales ``j`` and ``j + 8`` in byte ``j``, the high bit pairs of scale ``4 t + i`` in bits ``2 t`` of
  byte ``8 + i``), float16 ``d``; ``w = d (s - 32) (q - 4)`` with ``q`` the 3-bit code.
"""

from __future__ import annotations

from dataclasses import dataclass

import _kquant_files
import numpy as np
from _kquant_files import QK_K, _f16_bytes, _safe_inverse

#: Bytes per super-block.
Q2_K_BYTES = 84
Q3_K_BYTES = 110


@dataclass(frozen=True)
class KQuantParts:
    """The fields a quantizer chose, per super-block ``[n, ...]``: the exact weights they define are
    :meth:`values` (independent of any decoder)."""

    d: np.ndarray  # float16 [n]
    dmin: np.ndarray | None  # float16 [n] (Q2_K)
    scales: np.ndarray  # [n, 16]: Q2_K's sc (0..15), Q3_K's s - 32 (-32..31)
    mins: np.ndarray | None  # [n, 16]: Q2_K's m (0..15)
    codes: np.ndarray  # [n, 256]: Q2_K's q (0..3), Q3_K's q - 4 (-4..3)

    def values(self) -> np.ndarray:
        """The weights ``[n, 256]`` in float64: exact, no rounding."""
        d = self.d.astype(np.float64)[:, None, None]
        step = d * self.scales[..., None]
        w = step * self.codes.reshape(-1, 16, 16)
        if self.dmin is not None:
            w = w - self.dmin.astype(np.float64)[:, None, None] * self.mins[..., None]
        return w.reshape(-1, QK_K)


def _pack_2bit(q: np.ndarray) -> np.ndarray:
    """2-bit values ``[n, 256]`` -> 64 bytes: value ``128 c + 32 t + k`` in bits ``2 t`` of byte ``32 c + k``."""
    runs = (q.astype(np.uint8) & 3).reshape(q.shape[0], 2, 4, 32)
    return (runs[:, :, 0] | (runs[:, :, 1] << 2) | (runs[:, :, 2] << 4) | (runs[:, :, 3] << 6)).reshape(-1, 64)


def q2_k_parts(x: np.ndarray) -> KQuantParts:
    """Q2_K's fields for ``x`` ``[n, 256]``: per 16 a scale and a minimum (kept <= 0), both 4-bit
    under float16 super-scales."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / 3
    d = (scale.max(-1) / 15).astype(np.float16)
    dmin = ((-lo).max(-1) / 15).astype(np.float16)
    sc = np.clip(np.rint(scale * _safe_inverse(d.astype(np.float32))[:, None]), 0, 15).astype(np.int64)
    mn = np.clip(np.rint(-lo * _safe_inverse(dmin.astype(np.float32))[:, None]), 0, 15).astype(np.int64)
    step = d.astype(np.float32)[:, None] * sc
    base = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.rint((sub + base[..., None]) * _safe_inverse(step)[..., None]), 0, 3).astype(np.int64)
    return KQuantParts(d, dmin, sc, mn, q.reshape(n, QK_K))


def q3_k_parts(x: np.ndarray) -> KQuantParts:
    """Q3_K's fields for ``x`` ``[n, 256]``: per 16 a signed scale (the value of largest magnitude
    maps to -4, as in llama.cpp), 6-bit under a float16 ``d`` (the largest scale maps to -32)."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16).astype(np.float32)
    big = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    scale = big / -4
    top = np.take_along_axis(scale, np.abs(scale).argmax(-1)[:, None], -1)[:, 0]
    d = (top / -32).astype(np.float16)
    sc = np.clip(np.rint(scale * _safe_inverse(d.astype(np.float32))[:, None]), -32, 31).astype(np.int64)
    step = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.rint(sub * _safe_inverse(step)[..., None]), -4, 3).astype(np.int64)
    return KQuantParts(d, None, sc, None, q.reshape(n, QK_K))


def pack_q2_k(p: KQuantParts) -> np.ndarray:
    """Q2_K blocks ``[n, 84]`` of ``p``."""
    scales = (p.scales | (p.mins << 4)).astype(np.uint8)
    return np.concatenate([scales, _pack_2bit(p.codes), _f16_bytes(p.d), _f16_bytes(p.dmin)], axis=1)


def pack_q3_k(p: KQuantParts) -> np.ndarray:
    """Q3_K blocks ``[n, 110]`` of ``p``."""
    n = p.codes.shape[0]
    q = p.codes + 4  # 0..7
    high = ((q >> 2) & 1).astype(np.uint8).reshape(n, 8, 32)  # value 32 b + k: bit b of byte k
    hmask = np.zeros((n, 32), np.uint8)
    for b in range(8):
        hmask |= high[:, b] << b
    s = (p.scales + 32).astype(np.uint8)  # 0..63
    low = (s[:, :8] & 15) | ((s[:, 8:] & 15) << 4)
    pairs = (s >> 4).reshape(n, 4, 4)  # [t, i]: scale 4 t + i
    hi = pairs[:, 0] | (pairs[:, 1] << 2) | (pairs[:, 2] << 4) | (pairs[:, 3] << 6)
    return np.concatenate([hmask, _pack_2bit(q), low, hi, _f16_bytes(p.d)], axis=1).astype(np.uint8)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    return pack_q2_k(q2_k_parts(x))


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    return pack_q3_k(q3_k_parts(x))


def random_parts(ggml_type: str, n: int, rng: np.random.Generator) -> KQuantParts:
    """``n`` super-blocks with every field drawn at random over its whole range (scales of either sign
    and size, codes at their extremes), float16 super-scales of assorted magnitudes."""
    d = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 1, n)).astype(np.float16)
    if ggml_type == "Q2_K":
        dmin = np.abs(rng.standard_normal(n) * 10.0 ** rng.integers(-4, 1, n)).astype(np.float16)
        return KQuantParts(
            d, dmin, rng.integers(0, 16, (n, 16)), rng.integers(0, 16, (n, 16)), rng.integers(0, 4, (n, QK_K))
        )
    return KQuantParts(d, None, rng.integers(-32, 32, (n, 16)), None, rng.integers(-4, 4, (n, QK_K)))


PACKERS = {"Q2_K": pack_q2_k, "Q3_K": pack_q3_k}
PARTS = {"Q2_K": q2_k_parts, "Q3_K": q3_k_parts}

_kquant_files._KQUANTIZERS.update({"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k})
