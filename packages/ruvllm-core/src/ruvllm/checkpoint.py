"""Checkpoints on disk (GGUF files, Hugging Face safetensors directories) behind one interface.

Backends ask a :class:`Checkpoint` for tensors by their Hugging Face names, in Hugging Face layout
(``[out_features, in_features]``; GGUF's permuted Q/K rows are put back), either dequantized to
float32 or, for GGUF, as raw quantized blocks so a backend can keep them quantized.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ruvllm import architectures
from ruvllm.architectures import Family
from ruvllm.errors import ModelFormatError, UnsupportedQuantizationError
from ruvllm.model_config import ModelConfig

if TYPE_CHECKING:
    from ruvllm.tokenizer import Tokenizer

#: GGUF tensor types ruvllm decodes (through the ``gguf`` library's reference dequantizers, which
#: compute each weight as ggml's own does: Q2_K's ``d sc q - dmin m`` and Q3_K's ``d (sc - 32) q`` are
#: one float32 rounding of the exact value, or none).
SUPPORTED_GGML_TYPES = frozenset(
    {
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4",
    }
)  # fmt: skip
#: MXFP4 blocks: one E8M0 scale byte, then 32 4-bit E2M1 codes; scale 0xFF is NaN (OCP MX spec).
_MXFP4_BLOCK_BYTES = 17


def _check_blocks(ggml_type: str, data: np.ndarray, where: str) -> None:
    """Refuse blocks whose scale is not a number (an MXFP4 scale of 0xFF) by the tensor's name."""
    if ggml_type != "MXFP4":
        return
    scales = np.asarray(data).reshape(-1, _MXFP4_BLOCK_BYTES)[:, 0]
    bad = np.flatnonzero(scales == 0xFF)
    if bad.size:
        raise ModelFormatError(f"{where}: MXFP4 block {int(bad[0])} has scale 0xFF (NaN in E8M0); the file is corrupt")

_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, fam: Family | None = None) -> str | None:
    """Canonical (Hugging Face style) name of a GGUF tensor name, or None for tensors ruvllm does not
    use or that are fused (see :mod:`ruvllm.architectures`)."""
    fam = fam or architectures.family("llama")
    glob = architectures.gguf_global_name(name)
    if glob is not None:
        return glob
    m = _GGUF_BLOCK_RE.match(name)
    if m:
        suffix = fam.gguf_layer_name(m.group(2))
        if suffix == "self_attn.sinks":  # HF names it without ``.weight``
            return f"model.layers.{m.group(1)}.{suffix}"
        if suffix is not None:
            return f"model.layers.{m.group(1)}.{suffix}.{m.group(3)}"
    return None


@dataclass(frozen=True)
class _Part:
    """A canonical tensor that is rows ``lo:hi`` of a fused stored tensor."""

    source: str
    lo: int
    hi: int


def _fused_parts(
    names: list[str], fused: Any, cfg: ModelConfig, layer_re: re.Pattern[str], canonical_prefix: Callable[[str], str]
) -> dict[str, _Part]:
    """Canonical name -> row range of its fused source, for every fused tensor in ``names``."""
    parts: dict[str, _Part] = {}
    for name in names:
        m = layer_re.match(name)
        if not m or m.group(2) not in fused:
            continue
        lo = 0
        for part, rows in fused[m.group(2)]:
            n = rows(cfg)
            parts[f"{canonical_prefix(m.group(1))}{part}.{m.group(3)}"] = _Part(name, lo, lo + n)
            lo += n
    return parts


def unpermute_rows(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation (interleaved RoPE -> rotate-half layout)."""
    # llama.cpp stores HF row (head, half, j) at (head, j, half); row r of the result names its GGUF row.
    idx = np.arange(rows)
    return idx.reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)


@dataclass(frozen=True)
class RawTensor:
    """A tensor as stored: ``ggml_type`` names the encoding, ``data`` holds one row of blocks per
    output row (``uint8`` for quantized types), ``shape`` is the logical HF shape."""

    ggml_type: str
    data: np.ndarray
    shape: tuple[int, ...]

    def dequantize(self) -> np.ndarray:
        """The values as C-contiguous float32 in ``shape``, by the ``gguf`` library's dequantizers (a
        float32 tensor as it is): what :meth:`Checkpoint.tensor` returns, so a backend that keeps the
        blocks (``mmap_experts``) and decodes them later gets the same floats."""
        import gguf

        if self.ggml_type == "F32":
            out = np.asarray(self.data, dtype=np.float32)
        else:
            out = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType[self.ggml_type])
        return np.ascontiguousarray(out.reshape(self.shape), dtype=np.float32)


class Checkpoint(ABC):
    """A model on disk: its config, tensors by Hugging Face name, tokenizer and chat template."""

    format: str
    path: Path

    @property
    @abstractmethod
    def config(self) -> ModelConfig: ...

    @abstractmethod
    def tensor_names(self) -> list[str]: ...

    @abstractmethod
    def tensor(self, name: str) -> np.ndarray:
        """The tensor ``name`` as float32 in Hugging Face layout."""

    def raw_tensor(self, name: str) -> RawTensor:
        """The tensor ``name`` as stored (quantized blocks kept); float formats give float data."""
        arr = self.tensor(name)
        return RawTensor("F32", arr, arr.shape)

    @abstractmethod
    def tokenizer(self) -> Tokenizer: ...

    @property
    @abstractmethod
    def chat_template(self) -> str | None: ...

    @property
    @abstractmethod
    def quantization(self) -> str:
        """The dominant storage type of the weight matrices (e.g. ``Q4_1``, ``BF16``)."""

    def matrix_types(self) -> Counter[str]:
        """How many projection matrices are stored in each quantized block type (GGUF); empty for
        formats that store plain floats."""
        return Counter()

    @property
    def size_bytes(self) -> int:
        p = self.path
        return sum(f.stat().st_size for f in p.iterdir() if f.is_file()) if p.is_dir() else p.stat().st_size


class _Bytes(bytes):
    """A metadata string's bytes, as ``ReaderField.contents()`` reads a part (``tobytes()``)."""

    def tobytes(self) -> bytes:
        return bytes(self)


def _fast_gguf_reader(path: Path) -> Any:
    """``gguf.GGUFReader`` parsing through a plain ndarray view of its memory map: slicing an
    ``np.memmap`` runs ``__array_finalize__`` for each of the ~150k metadata strings, which made
    opening SmolLM2 several times slower. Metadata arrays are read whole: the library takes each
    element apart into numpy views (two per string), 2.5 s of a 1.5B Qwen's 151k-token vocabulary and
    merges; here a string array's items are :class:`_Bytes` and a number array one ndarray, which
    ``ReaderField.contents()`` reads as it reads the library's parts. Tensors stay zero-copy views of
    the mapping."""
    import struct

    import gguf

    vt = gguf.GGUFValueType

    class _Reader(gguf.GGUFReader):
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
            if self.byte_order != "I" or raw_type != vt.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            n, itype, offs = int(alen[0]), int(raw_itype[0]), orig_offs + 12
            if itype == vt.STRING:
                buf, items = self._plain, []
                for _ in range(n):
                    (length,) = struct.unpack_from("<Q", buf, offs)
                    items.append(_Bytes(buf[offs + 8 : offs + 8 + length]))
                    offs += 8 + length
                if offs > len(buf):
                    raise ValueError("a metadata string array runs past the end of the file")
                return offs - orig_offs, [raw_itype, alen, *items], list(range(2, 2 + n)), [vt.ARRAY, vt.STRING]
            nptype = self.gguf_scalar_to_np.get(vt(itype))
            if nptype is None or n == 0:  # nested arrays: the library's way
                return super()._get_field_parts(orig_offs, raw_type)
            values = self._get(offs, nptype, n)
            if len(values) != n:
                raise ValueError("a metadata array runs past the end of the file")
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], [vt.ARRAY, vt(itype)]

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            _check_tensor_extents(path, start_offs, fields, len(self._plain))
            super()._build_tensors(start_offs, fields)

    return _Reader(path, "r")


def _check_tensor_extents(path: Path, start: int, fields: list, size: int) -> None:
    """Every tensor's rows are whole blocks of its type and its data lies inside the file: otherwise
    the gguf library fails without naming the tensor, or (truncated at the end) hands back fewer
    bytes than the shape implies."""
    import gguf

    for f in fields:
        _, name_data, _, dims, raw_type, offset = f.parts
        name = bytes(name_data).decode("utf-8", "replace")
        try:
            qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
        except ValueError:
            continue  # an unknown type: the library's own error says which
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if len(dims) and int(dims[0]) % block:
            raise ModelFormatError(
                f"{path}: tensor {name} ({qtype.name}) has rows of {int(dims[0])} values, not whole blocks of {block}"
            )
        end = start + int(offset[0]) + int(np.prod(dims, dtype=np.uint64)) // block * type_size
        if end > size:
            raise ModelFormatError(
                f"{path}: tensor {name} is truncated: its {qtype.name} data ends at byte {end}, the file has {size}"
            )


class GGUFCheckpoint(Checkpoint):
    format = "gguf"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._reader = _fast_gguf_reader(self.path)
        except ModelFormatError:
            raise
        except Exception as exc:  # the gguf library raises ValueError, struct.error, IndexError...
            raise ModelFormatError(f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        arch = self.meta("general.architecture")
        if arch is None:
            raise ModelFormatError(f"{self.path}: GGUF has no general.architecture")
        self.family = architectures.family_of_gguf(str(arch), str(self.path))
        #: Every stored tensor by its GGUF name; ``_tensors`` by canonical name (fused ones left out).
        self._stored = {t.name: t for t in self._reader.tensors}
        self._tensors = {}
        for t in self._reader.tensors:
            hf = gguf_to_hf_name(t.name, self.family)
            if hf is not None:
                self._tensors[hf] = t
        if "model.embed_tokens.weight" not in self._tensors:
            raise ModelFormatError(f"{self.path}: GGUF has no token_embd.weight tensor")
        self._parts = _fused_parts(
            list(self._stored), self.family.gguf_fused, self.config, _GGUF_BLOCK_RE, lambda n: f"model.layers.{n}."
        )
        #: Each expert's matrix (canonical name) -> (stored 3-D tensor, expert index).
        self._experts: dict[str, tuple[Any, int]] = {}
        for t in self._reader.tensors:
            m = _GGUF_BLOCK_RE.match(t.name)
            # Matrices [experts, out, in] and biases [experts, out] (gpt-oss).
            if m and m.group(2) in architectures.GGUF_EXPERTS and len(t.shape) == (3 if m.group(3) == "weight" else 2):
                proj = architectures.GGUF_EXPERTS[m.group(2)]
                for e in range(int(t.shape[-1])):
                    self._experts[f"model.layers.{m.group(1)}.mlp.experts.{e}.{proj}.{m.group(3)}"] = (t, e)

    def mapping(self) -> np.ndarray:
        """The whole file as a read-only ``uint8`` view of its memory map: every raw tensor's ``data``
        is a view into it, so a backend that reads blocks in place (``mmap_experts``) can address
        them by offset."""
        return self._reader.data

    # -- metadata -------------------------------------------------------------------------------
    def meta(self, key: str, default: Any = None) -> Any:
        """A metadata value decoded to Python (strings, numbers, lists)."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    @cached_property
    def config(self) -> ModelConfig:
        def stored_tensor(name: str) -> np.ndarray:
            import gguf

            t = self._stored[name]
            return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(-1)

        def token_id(text: str) -> int | None:
            tokens = self._token_texts()
            return tokens.get(text)

        cfg = architectures.config_from_gguf(
            self.meta,
            stored_tensor,
            lambda name: name in self._stored,
            int(self._tensors["model.embed_tokens.weight"].shape[1]),
            str(self.path),
            token_id,
        )
        if not cfg.name:
            cfg = replace(cfg, name=self.path.stem)
        return cfg

    def _token_texts(self) -> dict[str, int]:
        if not hasattr(self, "_token_index"):
            tokens = self.meta("tokenizer.ggml.tokens") or []
            self._token_index = {t: i for i, t in enumerate(tokens)}
        return self._token_index

    @property
    def chat_template(self) -> str | None:
        """The file's template, else its family's own (a Gemma-3 GGUF often has none)."""
        return self.meta("tokenizer.chat_template") or self.family.chat_template_text()

    @cached_property
    def quantization(self) -> str:
        counts = self.matrix_types()
        return counts.most_common(1)[0][0] if counts else "F32"

    def matrix_types(self) -> Counter[str]:
        """How many of the projection matrices are stored in each GGUF type (``Q5_0``: 166, ...)."""
        types = Counter(t.tensor_type.name for n, t in self._tensors.items() if n.endswith("proj.weight"))
        for name, part in self._parts.items():
            if name.endswith("proj.weight"):
                types[self._stored[part.source].tensor_type.name] += 1
        for t, _e in self._experts.values():
            types[t.tensor_type.name] += 1
        return types

    def tokenizer(self) -> Tokenizer:
        from ruvllm.tokenizer import Tokenizer

        return Tokenizer.from_gguf(self)

    # -- tensors --------------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return list(self._tensors) + list(self._parts) + list(self._experts)

    def _row_order(self, name: str, rows: int) -> np.ndarray | None:
        cfg = self.config
        if self.family.gguf_permuted_qk:
            if ".self_attn.q_proj." in name:
                return unpermute_rows(rows, cfg.num_heads)
            if ".self_attn.k_proj." in name:
                return unpermute_rows(rows, cfg.num_kv_heads)
        return None

    def _get(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self.path}: tensor {name!r} is missing") from None

    def raw_tensor(self, name: str) -> RawTensor:
        part = self._parts.get(name)
        if part is not None:  # rows of a fused tensor: whole rows of blocks, so still in its own format
            whole = self._raw(self._stored[part.source], name)
            rows = whole.data[part.lo : part.hi]
            return RawTensor(whole.ggml_type, rows, (part.hi - part.lo, *whole.shape[1:]))
        if name in self._experts:  # one expert of a stacked tensor: its own blocks, in the file's format
            stacked, e = self._experts[name]
            whole = self._raw(stacked, name)
            data = whole.data.reshape(*whole.shape[:-1], -1)[e]
            _check_blocks(whole.ggml_type, data, f"{self.path}: tensor {stacked.name} (expert {e})")
            return RawTensor(whole.ggml_type, data, whole.shape[1:])
        raw = self._raw(self._get(name), name)
        _check_blocks(raw.ggml_type, raw.data, f"{self.path}: tensor {name}")
        return raw

    def _raw(self, t: Any, name: str) -> RawTensor:
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_GGML_TYPES:
            raise UnsupportedQuantizationError(
                f"{self.path}: tensor {t.name} uses quantization type {qtype}, which ruvllm does not support "
                f"(supported: {', '.join(sorted(SUPPORTED_GGML_TYPES))})"
            )
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = np.asarray(t.data)
        if data.ndim == 1 and len(shape) == 2:
            data = data.reshape(shape[0], -1)
        order = self._row_order(name, shape[0]) if len(shape) == 2 else None
        if order is not None:
            data = data[order]
        return RawTensor(qtype, data, shape)

    def tensor(self, name: str) -> np.ndarray:
        raw = self.raw_tensor(name)
        try:
            return raw.dequantize()
        except Exception as exc:
            raise ModelFormatError(f"{self.path}: tensor {name} could not be decoded: {exc}") from exc


class SafetensorsCheckpoint(Checkpoint):
    """A Hugging Face model directory: config.json, *.safetensors, tokenizer.json."""

    format = "safetensors"

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file():
            raise ModelFormatError(f"{self.path}: no config.json")
        try:
            self._hf_config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelFormatError(f"{cfg_file}: invalid JSON ({exc})") from exc
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{self.path}: no *.safetensors files")
        self._where: dict[str, Path] = {}
        self._dtypes: dict[str, str] = {}
        self._fused_cache: tuple[str | None, Any] = (None, None)
        for f in files:
            try:
                with safe_open(f, framework="numpy") as sf:
                    for k in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                        self._where[k] = f
            except Exception as exc:
                raise ModelFormatError(f"{f}: not a readable safetensors file ({exc})") from exc

    @cached_property
    def family(self) -> Family:
        c = self._hf_config
        return architectures.family_of_hf(str(c.get("model_type") or c.get("architectures") or ""), str(self.path))

    @cached_property
    def config(self) -> ModelConfig:
        has_head = "lm_head.weight" in self._where
        cfg = architectures.config_from_hf(self._hf_config, str(self.path), has_lm_head=has_head)
        return replace(cfg, name=self.path.name)

    @cached_property
    def _canonical(self) -> dict[str, tuple[str, _Part | Callable[[np.ndarray], np.ndarray] | None]]:
        """Canonical name -> (stored name, row range when it is part of a fused tensor, or how to cut
        one expert out of a fused expert tensor)."""
        fam = self.family
        out: dict[str, tuple[str, _Part | Callable[[np.ndarray], np.ndarray] | None]] = {}
        # A bare backbone saved on its own (Gemma3TextModel, Qwen3Model: ``layers.0...``, ``embed_tokens``)
        # names its tensors without the ``model.`` a causal LM's carry; a task head's backbone (BERT's
        # ``bert.``) with one of its own.
        bare = fam.layout == "decoder" and not any(n.startswith("model.") for n in self._where)
        for stored in self._where:
            name = f"model.{stored}" if bare else stored
            if fam.hf_backbone_prefix and name.startswith(fam.hf_backbone_prefix):
                name = name[len(fam.hf_backbone_prefix) :]
            views = architectures.hf_expert_views(fam, name, self.config.num_experts)
            if views:
                out.update((canonical, (stored, view)) for canonical, view in views.items())
                continue
            m = _HF_LAYER_RE.match(name)
            if m and m.group(2) in fam.hf_fused:
                continue
            if m and fam.hf_layer_name(m.group(2)) != m.group(2):
                out[f"model.layers.{m.group(1)}.{fam.hf_layer_name(m.group(2))}.{m.group(3)}"] = (stored, None)
            else:
                out[name] = (stored, None)
        parts = _fused_parts(list(self._where), fam.hf_fused, self.config, _HF_LAYER_RE, lambda n: f"model.layers.{n}.")
        for name, part in parts.items():
            out[name] = (part.source, part)
        return out

    @property
    def chat_template(self) -> str | None:
        tc = self.path / "tokenizer_config.json"
        if tc.is_file():
            tmpl = json.loads(tc.read_text()).get("chat_template")
            if isinstance(tmpl, list):  # named templates: take "default"
                tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), None)
            if tmpl:
                return str(tmpl)
        jinja = self.path / "chat_template.jinja"
        return jinja.read_text() if jinja.is_file() else None

    @property
    def quantization(self) -> str:
        from safetensors import safe_open

        name = next((n for n in self._where if n.endswith("proj.weight")), next(iter(self._where)))
        with safe_open(self._where[name], framework="numpy") as sf:
            return str(sf.get_slice(name).get_dtype())

    def tokenizer(self) -> Tokenizer:
        from ruvllm.tokenizer import Tokenizer

        return Tokenizer.from_hf_dir(self.path, chat_template=self.chat_template)

    def tensor_names(self) -> list[str]:
        return list(self._canonical)

    def tensor(self, name: str) -> np.ndarray:
        if name not in self._canonical:
            raise ModelFormatError(f"{self.path}: tensor {name!r} is missing")
        stored, part = self._canonical[name]
        if callable(part):  # one expert of a fused expert tensor (read once for all its experts)
            if self._fused_cache[0] != stored:
                self._fused_cache = (stored, self._stored_tensor(stored))
            return np.ascontiguousarray(part(self._fused_cache[1]))
        t = self._stored_tensor(stored)
        if part is not None:
            if t.shape[0] != part.hi and part.hi > t.shape[0]:
                raise ModelFormatError(
                    f"{self.path}: fused tensor {stored} has {t.shape[0]} rows, the config implies more"
                )
            t = np.ascontiguousarray(t[part.lo : part.hi])
        if self.family.hf_norm_offset and architectures.is_norm(name):
            t = t + np.float32(self.family.hf_norm_offset)  # Gemma applies 1 + w (GGUF files hold 1 + w)
        return t

    def _stored_tensor(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(self._where[name], framework="numpy") as sf:
            sl = sf.get_slice(name)
            if sl.get_dtype() == "BF16":
                # NumPy has no bfloat16: widen the raw 16-bit patterns into float32's top half.
                return self._bf16_tensor(name)
            return np.ascontiguousarray(sf.get_tensor(name), dtype=np.float32)

    def _bf16_tensor(self, name: str) -> np.ndarray:
        import struct

        f = self._where[name]
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
            info = header[name]
            start, end = info["data_offsets"]
            fh.seek(8 + n + start)
            raw = np.frombuffer(fh.read(end - start), dtype=np.uint16)
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a GGUF file or a Hugging Face safetensors directory."""
    p = Path(path)
    if p.is_dir():
        return SafetensorsCheckpoint(p)
    with open(p, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(f"{p}: not a GGUF file (magic {magic!r}) and not a model directory")
    return GGUFCheckpoint(p)
