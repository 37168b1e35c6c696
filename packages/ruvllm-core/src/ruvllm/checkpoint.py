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
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ruvllm.errors import ModelFormatError, UnsupportedArchitectureError, UnsupportedQuantizationError
from ruvllm.model_config import ModelConfig

if TYPE_CHECKING:
    from ruvllm.tokenizer import Tokenizer

#: GGUF tensor types ruvllm decodes (through the ``gguf`` library's reference dequantizers).
SUPPORTED_GGML_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
)

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """Hugging Face name of a GGUF tensor name, or None for tensors ruvllm does not use."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    m = _GGUF_BLOCK_RE.match(name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


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


def _fast_gguf_reader(path: Path) -> Any:
    """``gguf.GGUFReader`` parsing through a plain ndarray view of its memory map: slicing an
    ``np.memmap`` runs ``__array_finalize__`` for each of the ~150k metadata strings, which made
    opening SmolLM2 several times slower. Tensors stay zero-copy views of the mapping."""
    import gguf

    class _Reader(gguf.GGUFReader):
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

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
        self._tensors = {}
        for t in self._reader.tensors:
            hf = gguf_to_hf_name(t.name)
            if hf is not None:
                self._tensors[hf] = t
        if "model.embed_tokens.weight" not in self._tensors:
            raise ModelFormatError(f"{self.path}: GGUF has no token_embd.weight tensor")

    # -- metadata -------------------------------------------------------------------------------
    def meta(self, key: str, default: Any = None) -> Any:
        """A metadata value decoded to Python (strings, numbers, lists)."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    @cached_property
    def config(self) -> ModelConfig:
        arch = self.meta("general.architecture")
        if arch is None:
            raise ModelFormatError(f"{self.path}: GGUF has no general.architecture")

        def need(key: str) -> Any:
            v = self.meta(f"{arch}.{key}")
            if v is None:
                raise ModelFormatError(f"{self.path}: GGUF metadata lacks {arch}.{key}")
            return v

        if arch not in {"llama", "qwen2", "mistral"}:
            raise UnsupportedArchitectureError(
                f"{self.path}: architecture {arch!r} is not supported (supported: llama, mistral, qwen2)"
            )
        hidden = int(need("embedding_length"))
        n_head = int(need("attention.head_count"))
        n_kv = int(self.meta(f"{arch}.attention.head_count_kv", n_head))
        head_dim = int(self.meta(f"{arch}.attention.key_length", hidden // n_head))
        emb = self._tensors["model.embed_tokens.weight"]
        vocab = int(self.meta(f"{arch}.vocab_size", int(emb.shape[1])))
        eos = self.meta("tokenizer.ggml.eos_token_id")
        eot = self.meta("tokenizer.ggml.eot_token_id")
        eos_ids = tuple(dict.fromkeys(int(x) for x in (eos, eot) if x is not None))
        bos = self.meta("tokenizer.ggml.bos_token_id")
        return ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=n_head,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            max_position_embeddings=int(self.meta(f"{arch}.context_length", 2048)),
            rms_norm_eps=float(self.meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self.meta(f"{arch}.rope.freq_base", 10000.0)),
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            attention_bias="model.layers.0.self_attn.q_proj.bias" in self._tensors,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
            name=str(self.meta("general.name", self.path.stem)),
        )

    @property
    def chat_template(self) -> str | None:
        return self.meta("tokenizer.chat_template")

    @cached_property
    def quantization(self) -> str:
        counts = self.matrix_types()
        return counts.most_common(1)[0][0] if counts else "F32"

    def matrix_types(self) -> Counter[str]:
        """How many of the projection matrices are stored in each GGUF type (``Q5_0``: 166, ...)."""
        return Counter(t.tensor_type.name for n, t in self._tensors.items() if n.endswith("proj.weight"))

    def tokenizer(self) -> Tokenizer:
        from ruvllm.tokenizer import Tokenizer

        return Tokenizer.from_gguf(self)

    # -- tensors --------------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def _row_order(self, name: str, rows: int) -> np.ndarray | None:
        cfg = self.config
        if cfg.architecture in {"llama", "mistral"}:
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
        t = self._get(name)
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
        import gguf

        raw = self.raw_tensor(name)
        try:
            if raw.ggml_type == "F32":
                out = np.asarray(raw.data, dtype=np.float32)
            else:
                out = gguf.quants.dequantize(raw.data, gguf.GGMLQuantizationType[raw.ggml_type])
        except Exception as exc:
            raise ModelFormatError(f"{self.path}: tensor {name} could not be decoded: {exc}") from exc
        return np.ascontiguousarray(out.reshape(raw.shape), dtype=np.float32)


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
        for f in files:
            try:
                with safe_open(f, framework="numpy") as sf:
                    for k in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                        self._where[k] = f
            except Exception as exc:
                raise ModelFormatError(f"{f}: not a readable safetensors file ({exc})") from exc

    @cached_property
    def config(self) -> ModelConfig:
        c = self._hf_config
        archs = c.get("architectures") or []
        model_type = c.get("model_type", "")
        if model_type not in {"llama", "mistral", "qwen2"}:
            raise UnsupportedArchitectureError(
                f"{self.path}: architecture {model_type or archs!r} is not supported (supported: llama, mistral, qwen2)"
            )
        n_head = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        return ModelConfig(
            architecture=model_type,
            vocab_size=int(c["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(c["intermediate_size"]),
            num_layers=int(c["num_hidden_layers"]),
            num_heads=n_head,
            num_kv_heads=int(c.get("num_key_value_heads", n_head)),
            head_dim=int(c.get("head_dim") or hidden // n_head),
            max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
            rope_theta=float(c.get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)) or "lm_head.weight" not in self._where,
            attention_bias=bool(c.get("attention_bias", model_type == "qwen2")),
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=self.path.name,
        )

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
        return list(self._where)

    def tensor(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        if name not in self._where:
            raise ModelFormatError(f"{self.path}: tensor {name!r} is missing")
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
