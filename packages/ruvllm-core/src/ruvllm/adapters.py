"""PEFT LoRA adapters users bring: ``adapter_config.json`` + ``adapter_model.safetensors`` (a
directory, or a Hub repo id already in ruvllm's cache), checked against the base model and served
per request through the backends' adapter path (:class:`ruvllm.backend.LoraAdapter`).

Supported: LoRA (``peft_type: LORA``) on any of q/k/v/o/gate/up/down of any layer, any rank,
``lora_alpha``, ``use_rslora`` (scale ``alpha / sqrt(r)`` instead of ``alpha / r``), per-module
``rank_pattern`` / ``alpha_pattern``, ``fan_in_fan_out`` (weights stored transposed). Refused by name:
DoRA, biases, ``modules_to_save``, LoRA on embeddings or the head, other PEFT types. A module whose
shapes do not fit the base model is a one-line error naming it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ruvllm.errors import ModelFormatError, ModelNotFoundError
from ruvllm.model_config import ModelConfig

#: PEFT module name -> the canonical projection names the backends adapt.
_PROJ = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class AdapterError(ModelFormatError):
    """An adapter cannot be loaded or does not fit the base model."""


@dataclass(eq=False)
class LoraWeights:
    """A loaded LoRA adapter (implements :class:`ruvllm.backend.LoraAdapter`): per ``(layer, proj)``,
    ``A [r, in]``, ``B [out, r]`` (float32) and the scale. Immutable once loaded."""

    name: str
    params: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]
    base_model: str | None = None
    source: str = ""
    version: int = 1
    max_rank: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.max_rank = max((a.shape[0] for a, _, _ in self.params.values()), default=0)

    def lora_params(self) -> Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]:
        return self.params

    def delta(self, layer: int, proj: str, x: np.ndarray) -> np.ndarray | None:
        entry = self.params.get((layer, proj))
        if entry is None:
            return None
        a, b, scale = entry
        return (scale * ((x @ a.T) @ b.T)).astype(np.float32)


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each projection of the base model."""
    q, kv, h, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (f, h),
        "up_proj": (f, h),
        "down_proj": (h, f),
    }


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rule: a pattern key applies to a module whose name ends with it (regex, at a dot)."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def adapter_dir(ref: str, cache: str | None = None) -> Path:
    """A local directory, or a Hub repo id already in ruvllm's cache (``ruvllm download`` fetches)."""
    p = Path(ref).expanduser()
    if p.is_dir():
        return p
    from ruvllm.resolve import hub_cache_dir, looks_like_repo_id

    if not looks_like_repo_id(ref):
        raise ModelNotFoundError(f"adapter {ref!r} not found: not a directory and not a Hugging Face repo id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(ref, cache_dir=hub_cache_dir(cache), local_files_only=True))
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"adapter {ref!r} is not in the cache: run `ruvllm download {ref}` while online"
        ) from None


def load_peft_adapter(
    ref: str | Path, name: str, cfg: ModelConfig, *, max_rank: int | None = None, cache: str | None = None
) -> LoraWeights:
    """Load the PEFT LoRA adapter at ``ref`` for a base model described by ``cfg``."""
    path = adapter_dir(str(ref), cache)
    where = f"adapter {name!r} ({path})"
    try:
        conf = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterError(f"{where}: adapter_config.json is missing") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{where}: adapter_config.json is not readable JSON ({exc})") from None
    if conf.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {conf.get('peft_type')!r} is not supported (only LORA)")
    for key, neutral in (("use_dora", False), ("bias", "none"), ("modules_to_save", None)):
        if conf.get(key, neutral) not in (neutral, [], None if neutral is None else neutral):
            raise AdapterError(f"{where}: {key}={conf.get(key)!r} is not supported")
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterError(f"{where}: adapter_model.safetensors is missing")
    from safetensors.numpy import load_file

    tensors = load_file(str(weights_file))
    r_default, alpha_default = int(conf.get("r", 8)), float(conf.get("lora_alpha", 8))
    rank_pattern, alpha_pattern = conf.get("rank_pattern") or {}, conf.get("alpha_pattern") or {}
    rslora, fan_in_fan_out = bool(conf.get("use_rslora", False)), bool(conf.get("fan_in_fan_out", False))
    shapes = _expected_shapes(cfg)
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for tname, value in tensors.items():
        m = _TENSOR.search(tname)
        if m is None:
            raise AdapterError(
                f"{where}: tensor {tname!r} is not a LoRA factor of a decoder projection (not supported)"
            )
        layer, proj, which = int(m.group(1)), m.group(2), m.group(3)
        if proj not in _PROJ:
            raise AdapterError(f"{where}: module {proj!r} of {tname!r} is not one ruvllm adapts")
        if layer >= cfg.num_layers:
            raise AdapterError(f"{where}: {tname!r} is for layer {layer}, the base model has {cfg.num_layers}")
        arr = np.asarray(value, np.float32)
        found.setdefault((layer, proj), {})[which] = arr.T.copy() if fan_in_fan_out else arr
    params: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]] = {}
    for (layer, proj), ab in sorted(found.items()):
        module = (
            f"model.layers.{layer}.{'mlp' if proj in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{proj}"
        )
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: {module} has lora_{'B' if 'A' in ab else 'A'} missing")
        a, b = ab["A"], ab["B"]
        out, inp = shapes[proj]
        r = int(_pattern_value(rank_pattern, module, r_default))
        if a.shape != (r, inp) or b.shape != (out, r):
            raise AdapterError(
                f"{where}: {module} has lora_A {a.shape} and lora_B {b.shape}; the base model needs "
                f"({r}, {inp}) and ({out}, {r})"
            )
        if max_rank is not None and r > max_rank:
            raise AdapterError(f"{where}: {module} has rank {r}, above max_lora_rank {max_rank}")
        alpha = float(_pattern_value(alpha_pattern, module, alpha_default))
        scale = alpha / (r**0.5) if rslora else alpha / r
        params[(layer, proj)] = (a, b, scale)
    if not params:
        raise AdapterError(f"{where}: adapter_model.safetensors holds no LoRA factors")
    return LoraWeights(name, params, conf.get("base_model_name_or_path"), str(path))
