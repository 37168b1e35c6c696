"""GGUF files with k-quant blocks for tests: a NumPy round-to-nearest quantizer for Q4_K / Q5_K / Q6_K
(gguf-py decodes k-quants but cannot encode them) and a re-quantizer that writes any GGUF's matrices in
a Q4_K_M-like mix, following llama.cpp's rules, metadata and tokenizer copied as they are.

The quantizer is not llama.cpp's (which searches for the scales that minimise the error); it is plain
round-to-nearest with per-sub-block min / max and 6-bit (8-bit for Q6_K) quantized sub-scales, enough
for valid, sensible blocks. The packers here are written from the bit layouts independently of
``ruvllm_jax.quant``; tests check them against ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

QK_K = 256
#: Where the re-quantized SmolLM2 is kept between test sessions.
CACHE_DIR = Path.home() / ".cache" / "ruvllm" / "test-models"


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """float16 values ``[n]`` as their two little-endian bytes ``[n, 2]``."""
    return np.ascontiguousarray(v.astype("<f2")).view(np.uint8).reshape(-1, 2)


def _safe_inverse(v: np.ndarray) -> np.ndarray:
    return np.divide(1.0, v, out=np.zeros_like(v), where=v != 0)


def _asymmetric_k(x: np.ndarray, nmax: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K for ``x`` ``[n, 256]``: per 32 a scale and a minimum (the minimum kept <= 0, as
    llama.cpp does), both quantized to 6 bits under float16 super-scales ``d`` and ``dmin``."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / nmax
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = ((-lo).max(-1) / 63).astype(np.float16)
    sc = np.clip(np.rint(scale * _safe_inverse(d.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-lo * _safe_inverse(dmin.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    base = dmin.astype(np.float32)[:, None] * mn
    q = np.rint((sub + base[..., None]) * _safe_inverse(step)[..., None])
    return d, dmin, sc, mn, np.clip(q, 0, nmax).astype(np.uint8).reshape(n, QK_K)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and minimums ``[n, 8]`` into Q4_K's 12 bytes."""
    lo = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mid = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return np.concatenate([lo, mid, hi], axis=1).astype(np.uint8)


def _pack_low_high(q: np.ndarray, width: int) -> np.ndarray:
    """4-bit values ``[n, 2 * m * width]`` into ``m * width`` bytes: in each run of ``2 * width``
    values the first ``width`` go to the low nibbles, the next ``width`` to the high ones."""
    runs = (q & 15).reshape(q.shape[0], -1, 2, width)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(q.shape[0], -1).astype(np.uint8)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """``x`` ``[n, 256]`` -> Q4_K blocks ``[n, 144]``: d, dmin, 12 scale bytes, 128 code bytes."""
    d, dmin, sc, mn, q = _asymmetric_k(x, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, mn), _pack_low_high(q, 32)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """``x`` ``[n, 256]`` -> Q5_K blocks ``[n, 176]``: as Q4_K plus 32 bytes whose bit ``i`` of byte
    ``k`` is the fifth bit of value ``32 i + k``."""
    d, dmin, sc, mn, q = _asymmetric_k(x, 31)
    bits = ((q >> 4) & 1).reshape(-1, 8, 32)
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for i in range(8):
        qh |= bits[:, i] << i
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, mn), qh, _pack_low_high(q, 32)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """``x`` ``[n, 256]`` -> Q6_K blocks ``[n, 210]``: per 16 a signed scale (the value of largest
    magnitude maps to -32, as in llama.cpp), quantized to int8 under a float16 ``d``."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16).astype(np.float32)
    big = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    scale = big / -32
    top = np.take_along_axis(scale, np.abs(scale).argmax(-1)[:, None], -1)[:, 0]
    d = (top / -128).astype(np.float16)
    sc = np.clip(np.rint(scale * _safe_inverse(d.astype(np.float32))[:, None]), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.rint(sub * _safe_inverse(step)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(n, QK_K)
    ql = _pack_low_high(q, 64)  # value 128 c + 64 s + b: nibble s of byte 64 c + b
    hi = (q >> 4).reshape(n, 2, 4, 32)  # value 128 c + 32 t + k: bits 2t, 2t+1 of byte 32 c + k
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh.astype(np.uint8), sc.view(np.uint8), _f16_bytes(d)], axis=1)


_KQUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_K": quantize_q4_k,
    "Q5_K": quantize_q5_k,
    "Q6_K": quantize_q6_k,
}


def quantize(w: np.ndarray, ggml_type: str) -> np.ndarray:
    """A float ``[rows, cols]`` matrix as GGUF blocks ``[rows, bytes]`` (k-quants here, the rest
    through gguf-py's quantizers)."""
    import gguf

    if ggml_type in _KQUANTIZERS:
        return _KQUANTIZERS[ggml_type](w.reshape(-1, QK_K)).reshape(w.shape[0], -1)
    return gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[ggml_type])


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


#: llama.cpp's type for rows that are not whole super-blocks.
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def q4_k_m_type(name: str, cols: int, layers: int) -> str:
    """The type llama.cpp's Q4_K_M gives a matrix (tied embedding, attn_v, ffn_down as its rules,
    everything else Q4_K), except that ffn_down's plain layers alternate Q4_K with Q5_K, so a file has
    all three k-quants; rows that are not whole super-blocks fall back as llama.cpp does."""
    parts = name.split(".")
    if name in ("token_embd.weight", "output.weight"):
        t = "Q6_K"
    elif parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        layer = int(parts[1])
        if _use_more_bits(layer, layers):
            t = "Q6_K"
        else:
            t = "Q5_K" if parts[2] == "ffn_down" and layer % 3 == 0 else "Q4_K"
    else:
        t = "Q4_K"
    return t if cols % QK_K == 0 else _FALLBACK[t]


def requantize_gguf(src: Path, dst: Path, type_for: Callable[[str, int, int], str] = q4_k_m_type) -> Path:
    """Write ``src`` with every 2-D tensor re-quantized to ``type_for(name, cols, layers)`` (1-D tensors,
    metadata and tokenizer as they are; ``general.file_type`` says Q4_K_M)."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if len(shape) != 2:
            writer.add_tensor(t.name, values)
            continue
        qtype = gguf.GGMLQuantizationType[type_for(t.name, shape[1], layers)]
        writer.add_tensor(t.name, quantize(values, qtype.name), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def cached_q4_k_m(src: Path, cache_dir: Path = CACHE_DIR) -> Path:
    """``src`` re-quantized to the Q4_K_M-like mix, written once per source file and version of this
    module (keyed by a hash of both) and reused by later sessions; older versions are removed."""
    stat = src.stat()
    key = hashlib.sha256(
        f"{src.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|".encode() + Path(__file__).read_bytes()
    ).hexdigest()[:16]
    dst = cache_dir / f"{src.stem}.Q4_K_M-{key}.gguf"
    if not dst.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(f".{os.getpid()}.tmp")
        requantize_gguf(src, tmp)
        os.replace(tmp, dst)  # atomic: a concurrent session sees the whole file or none
        for stale in cache_dir.glob(f"{src.stem}.Q4_K_M-*.gguf"):
            if stale != dst:
                stale.unlink(missing_ok=True)
    return dst
