"""PEFT LoRA adapters users bring: ``adapter_config.json`` + ``adapter_model.safetensors`` (a
directory, or a Hub repo id already in ruvllm's cache), checked against the base model and served
per request through the backends' adapter path (:class:`ruvllm.backend.LoraAdapter`); and X-LoRA
models over such adapters (:class:`XLoraAdapter`, :func:`load_adapter` tells them apart).

Supported: LoRA (``peft_type: LORA``) on any of q/k/v/o/gate/up/down of any layer, any rank,
``lora_alpha``, ``use_rslora`` (scale ``alpha / sqrt(r)`` instead of ``alpha / r``), per-module
``rank_pattern`` / ``alpha_pattern``, ``fan_in_fan_out`` (weights stored transposed). Refused by name:
DoRA, biases, ``modules_to_save``, LoRA on embeddings or the head, other PEFT types. A module whose
shapes do not fit the base model is a one-line error naming it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path
from typing import Any

import numpy as np

from ruvllm.errors import ModelFormatError, ModelNotFoundError
from ruvllm.model_config import ModelConfig
from ruvllm.modeling import MLP_PROJECTIONS, PROJECTIONS, projection_module, projection_shape

_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
#: A mixture of experts' modules (HF names): the router, the experts, Mixtral's block.
_MOE_MODULE = re.compile(r"layers\.\d+\.(?:mlp\.(?:gate|experts)\.|block_sparse_moe\.)")


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

    @property
    def projections(self) -> set[str]:
        """The projections this adapter adapts (in some layer)."""
        return {proj for _, proj in self.params}

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
    return {p: projection_shape(cfg, p) for p in PROJECTIONS}


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


def _read_config(path: Path, where: str) -> dict[str, Any]:
    """``path``'s ``adapter_config.json``; a one-line error naming ``where`` when it is missing or unreadable."""
    try:
        conf = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterError(f"{where}: adapter_config.json is missing") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{where}: adapter_config.json is not readable JSON ({exc})") from None
    if not isinstance(conf, dict):
        raise AdapterError(f"{where}: adapter_config.json is not a JSON object")
    return conf


def load_peft_adapter(
    ref: str | Path, name: str, cfg: ModelConfig, *, max_rank: int | None = None, cache: str | None = None
) -> LoraWeights:
    """Load the PEFT LoRA adapter at ``ref`` for a base model described by ``cfg``."""
    path = adapter_dir(str(ref), cache)
    where = f"adapter {name!r} ({path})"
    conf = _read_config(path, where)
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
        if cfg.num_experts and (_MOE_MODULE.search(tname) or (m and m.group(2) in MLP_PROJECTIONS)):
            raise AdapterError(
                f"{where}: {tname!r} adapts the mixture of experts (router or experts), which ruvllm does not "
                "implement; adapters on the attention projections work"
            )
        if m is None:
            raise AdapterError(
                f"{where}: tensor {tname!r} is not a LoRA factor of a decoder projection (not supported)"
            )
        layer, proj, which = int(m.group(1)), m.group(2), m.group(3)
        if proj not in PROJECTIONS:
            raise AdapterError(f"{where}: module {proj!r} of {tname!r} is not one ruvllm adapts")
        if layer >= cfg.num_layers:
            raise AdapterError(f"{where}: {tname!r} is for layer {layer}, the base model has {cfg.num_layers}")
        arr = np.asarray(value, np.float32)
        found.setdefault((layer, proj), {})[which] = arr.T.copy() if fan_in_fan_out else arr
    params: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]] = {}
    for (layer, proj), ab in sorted(found.items()):
        module = f"model.layers.{layer}.{projection_module(proj)}.{proj}"
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


# ------------------------------------------------------------------------------------------ X-LoRA

#: Projection order within a layer, as PEFT walks a decoder layer's modules (attention, then MLP):
#: the order of X-LoRA's per-module ("layerwise") scalings.
MODULE_ORDER = PROJECTIONS
_CLASSIFIER = re.compile(r"(?:^|\.)internal_xlora_classifier\.layers\.(\d+)\.(weight|bias)$")


@dataclass(eq=False)
class AdapterMix:
    """Several LoRA adapters on one chunk, each token weighting each adapter (X-LoRA's passes).

    Projection ``proj`` of ``layer`` adds, for token ``t``, ``sum_c w[t, c] * delta_c(x_t)`` where
    ``delta_c`` is component ``c``'s LoRA update. ``weights`` is ``[n_tokens, n_components]`` (one
    weight per token and adapter for every module), or ``[n_tokens, len(modules), n_components]`` with
    ``modules`` naming each module's ``(layer, proj)`` (a module not named adds nothing). Host backends
    read :meth:`delta`; device backends with ``Capabilities.adapter_mix`` read the components' factors
    (``lora_params()``) and the weights themselves."""

    components: tuple[Any, ...]
    weights: np.ndarray
    modules: tuple[tuple[int, str], ...] = ()
    _index: dict[tuple[int, str], int] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.weights = np.asarray(self.weights, np.float32)
        want = 3 if self.modules else 2
        if self.weights.ndim != want or self.weights.shape[-1] != len(self.components):
            raise ValueError(
                f"AdapterMix weights must be [tokens, {'modules, ' if self.modules else ''}{len(self.components)}], "
                f"got {self.weights.shape}"
            )
        if self.modules and self.weights.shape[1] != len(self.modules):
            raise ValueError(f"AdapterMix has {len(self.modules)} modules and weights {self.weights.shape}")
        self._index = {m: i for i, m in enumerate(self.modules)}

    def module_weights(self, layer: int, proj: str) -> np.ndarray | None:
        """``[n_tokens, n_components]`` weights of one module, None where it has none."""
        if not self.modules:
            return self.weights
        i = self._index.get((layer, proj))
        return None if i is None else self.weights[:, i]

    def delta(self, layer: int, proj: str, x: np.ndarray) -> np.ndarray | None:
        w = self.module_weights(layer, proj)
        if w is None:
            return None
        if x.shape[0] != w.shape[0]:
            raise ValueError(f"AdapterMix has weights for {w.shape[0]} tokens, asked for {x.shape[0]}")
        out = None
        for c, comp in enumerate(self.components):
            # PEFT's X-LoRA layer: B(A(x * w)) * scale, the same as w * B(A(x)) * scale.
            d = comp.delta(layer, proj, x * w[:, c : c + 1])
            if d is not None:
                out = d if out is None else out + d
        return out


@dataclass(eq=False)
class XLoraAdapter:
    """An X-LoRA model (``peft_type: XLORA``): LoRA experts mixed per token by a classifier.

    Each step runs twice: a scaling pass over the request's shadow sequence (every expert weighted by
    ``scaling_pass_value``: the base model at PEFT's default 0) yields final hidden states; the
    classifier turns them into per-token (``layerwise``: per-token, per-module) expert weights, and the
    real pass runs the request's tokens with those weights (:class:`AdapterMix`). The engine keeps the
    shadow sequence's own KV blocks."""

    name: str
    components: tuple[LoraWeights, ...]
    #: Linear layers ``(W [out, in], b [out])``, ReLU between them.
    classifier: tuple[tuple[np.ndarray, np.ndarray], ...]
    layerwise: bool = False
    enable_softmax: bool = True
    softmax_temperature: float = 1.0
    top_k: int | None = None
    enable_softmax_topk: bool = False
    scaling_pass_value: float = 0.0
    global_scaling_weight: float = 1.0
    base_model: str | None = None
    source: str = ""
    version: int = 1
    #: Every module some expert adapts, in PEFT's order (layer, then :data:`MODULE_ORDER`).
    modules: tuple[tuple[int, str], ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        adapted = {key for c in self.components for key in c.params}
        self.modules = tuple(sorted(adapted, key=lambda m: (m[0], MODULE_ORDER.index(m[1]))))

    @property
    def max_rank(self) -> int:
        return max(c.max_rank for c in self.components)

    @property
    def projections(self) -> set[str]:
        return {proj for _, proj in self.modules}

    def _select(self, scalings: np.ndarray) -> np.ndarray:
        """PEFT's per-module top-k and top-k softmax, then the global weight (``[..., n]`` in and out)."""
        s = scalings
        if self.top_k is not None:
            keep = np.argsort(-s, axis=-1, kind="stable")[..., : self.top_k]
            mask = np.zeros(s.shape, bool)
            np.put_along_axis(mask, keep, True, axis=-1)
            s = np.where(mask, s, np.float32(0))
        if self.enable_softmax_topk:
            nonzero = s != 0  # a softmax over the kept experts only
            top = np.max(np.where(nonzero, s, -np.inf), axis=-1, keepdims=True)
            e = np.where(nonzero, np.exp(np.where(nonzero, s, 0) - np.where(np.isfinite(top), top, 0)), 0)
            total = e.sum(axis=-1, keepdims=True)
            s = np.where(nonzero, e / np.where(total > 0, total, 1), np.float32(0))
        return (s * np.float32(self.global_scaling_weight)).astype(np.float32)

    def _mix(self, per_module: np.ndarray) -> AdapterMix:
        if self.layerwise:
            return AdapterMix(self.components, per_module, self.modules)
        return AdapterMix(self.components, per_module[:, 0])

    def scaling_pass(self, num_tokens: int) -> AdapterMix | None:
        """The adapters of the scaling pass over ``num_tokens`` tokens; None: the base model (every
        expert weighted 0, PEFT's default)."""
        shape = (num_tokens, len(self.modules) if self.layerwise else 1, len(self.components))
        w = self._select(np.full(shape, self.scaling_pass_value, np.float32))
        return None if not w.any() else self._mix(w)

    def mix(self, hidden: np.ndarray) -> AdapterMix:
        """The real pass's adapters for tokens whose scaling-pass final hidden states are ``hidden``."""
        h = np.asarray(hidden, np.float32)
        for i, (w, b) in enumerate(self.classifier):
            h = h @ w.T + b
            if i < len(self.classifier) - 1:
                h = np.maximum(h, 0)
        n = len(self.components)
        logits = h.reshape(h.shape[0], -1, n)  # [T, modules or 1, n]
        if self.enable_softmax:
            z = logits / np.float32(self.softmax_temperature)
            z = np.exp(z - z.max(axis=-1, keepdims=True))
            logits = z / z.sum(axis=-1, keepdims=True)
        return self._mix(self._select(logits.astype(np.float32)))


def _peft_type(path: Path) -> str | None:
    try:
        return json.loads((path / "adapter_config.json").read_text(encoding="utf-8")).get("peft_type")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def load_adapter(
    ref: str | Path, name: str, cfg: ModelConfig, *, max_rank: int | None = None, cache: str | None = None
) -> LoraWeights | XLoraAdapter:
    """A PEFT adapter at ``ref``: LoRA, or an X-LoRA model (``peft_type: XLORA``)."""
    path = adapter_dir(str(ref), cache)
    if _peft_type(path) == "XLORA":
        return load_xlora_adapter(path, name, cfg, max_rank=max_rank, cache=cache)
    return load_peft_adapter(path, name, cfg, max_rank=max_rank, cache=cache)


def _expert_dir(base: Path, key: str, value: Any, cache: str | None) -> Path:
    """Where an X-LoRA expert lives: its path relative to the X-LoRA directory, as given (a
    directory or a Hub repo id in the cache), or the directory's sub-folder named after it."""
    for candidate in (base / str(value), Path(str(value)).expanduser(), base / key):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    return adapter_dir(str(value), cache)


def load_xlora_adapter(
    ref: str | Path, name: str, cfg: ModelConfig, *, max_rank: int | None = None, cache: str | None = None
) -> XLoraAdapter:
    """Load the X-LoRA model at ``ref``: ``adapter_config.json`` (PEFT's ``XLoraConfig``), its LoRA
    experts (the ``adapters`` mapping, in order: expert ``i`` is the classifier's class ``i``) and the
    classifier's linear layers from ``adapter_model.safetensors``
    (``...internal_xlora_classifier.layers.{i}.weight`` / ``.bias``)."""
    path = adapter_dir(str(ref), cache)
    where = f"X-LoRA adapter {name!r} ({path})"
    conf = _read_config(path, where)
    if conf.get("peft_type") != "XLORA":
        raise AdapterError(f"{where}: peft_type {conf.get('peft_type')!r} is not XLORA")
    experts = conf.get("adapters")
    if not isinstance(experts, dict) or not experts:
        raise AdapterError(f"{where}: 'adapters' must name at least one LoRA expert")
    if int(conf.get("hidden_size") or 0) != cfg.hidden_size:
        raise AdapterError(
            f"{where}: hidden_size {conf.get('hidden_size')} does not match the base model's {cfg.hidden_size}"
        )
    top_k = conf.get("top_k_lora")
    if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= len(experts)):
        raise AdapterError(f"{where}: top_k_lora {top_k!r} must be between 1 and the {len(experts)} experts")
    if conf.get("enable_softmax_topk") and top_k is None:
        raise AdapterError(f"{where}: enable_softmax_topk needs top_k_lora")
    temperature = float(conf.get("softmax_temperature", 1.0))
    if not temperature > 0:
        raise AdapterError(f"{where}: softmax_temperature must be positive, got {temperature}")
    components = []
    for key, value in experts.items():
        try:
            expert = _expert_dir(path, str(key), value, cache)
        except ModelNotFoundError as exc:
            raise AdapterError(f"{where}: expert {key!r}: {exc}") from None
        lora = load_peft_adapter(expert, f"{name}/{key}", cfg, max_rank=max_rank, cache=cache)
        components.append(lora)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterError(f"{where}: adapter_model.safetensors (the classifier) is missing")
    from safetensors.numpy import load_file

    found: dict[int, dict[str, np.ndarray]] = {}
    for tname, value in load_file(str(weights_file)).items():
        m = _CLASSIFIER.search(tname)
        if m is None:
            raise AdapterError(f"{where}: tensor {tname!r} is not a layer of the X-LoRA classifier")
        found.setdefault(int(m.group(1)), {})[m.group(2)] = np.asarray(value, np.float32)
    depth = int(conf.get("xlora_depth", 1))
    if len(found) != depth:
        raise AdapterError(
            f"{where}: the classifier has {len(found)} linear layers in adapter_model.safetensors, "
            f"xlora_depth is {depth}"
        )
    layerwise = bool(conf.get("layerwise_scalings", False))
    xl = XLoraAdapter(
        name,
        tuple(components),
        (),
        layerwise=layerwise,
        enable_softmax=bool(conf.get("enable_softmax", True)),
        softmax_temperature=temperature,
        top_k=top_k,
        enable_softmax_topk=bool(conf.get("enable_softmax_topk", False)),
        scaling_pass_value=float(conf.get("scaling_pass_value", 0.0)),
        global_scaling_weight=float(conf.get("global_scaling_weight", 1.0)),
        base_model=conf.get("base_model_name_or_path"),
        source=str(path),
    )
    n_out = len(components) * (len(xl.modules) if layerwise else 1)
    size = int(conf.get("xlora_size", 2048))
    layers = []
    for i, idx in enumerate(sorted(found)):
        wb = found[idx]
        if set(wb) != {"weight", "bias"}:
            raise AdapterError(f"{where}: classifier layer {idx} has no {'bias' if 'weight' in wb else 'weight'}")
        w, b = wb["weight"], wb["bias"]
        inp = cfg.hidden_size if i == 0 else size
        out = n_out if i == depth - 1 else size
        if w.shape != (out, inp) or b.shape != (out,):
            raise AdapterError(
                f"{where}: classifier layer {idx} has weight {w.shape} and bias {b.shape}; "
                f"expected ({out}, {inp}) and ({out},)"
            )
        layers.append((w, b))
    xl.classifier = tuple(layers)
    return xl


def checked_lora_factors(
    entries: Any, name: str, num_layers: int, shape_of: Callable[[str], tuple[int, int]]
) -> list[tuple[int, str, np.ndarray, np.ndarray]]:
    """An adapter's ``lora_params()`` (``{(layer, projection): (A, B, scale)}``) checked against a
    model of ``num_layers`` layers whose projection ``p`` is ``shape_of(p)`` = ``(out, in)``:
    ``(layer, projection, A [r, in], scale * B [out, r])`` in float32, rank-0 entries left out. Any
    entry that does not fit is a :class:`~ruvllm.errors.BackendError` naming the adapter ``name``,
    the layer and the projection. Backends that apply adapters from their factors share this."""
    from ruvllm.errors import BackendError

    if not isinstance(entries, Mapping):
        raise BackendError(f"{name}.lora_params() returned {type(entries).__name__}, not a mapping")
    out_entries: list[tuple[int, str, np.ndarray, np.ndarray]] = []
    for key, value in entries.items():
        if not (isinstance(key, tuple) and len(key) == 2):
            raise BackendError(f"adapter {name}: key {key!r} is not (layer, projection)")
        layer, proj = key
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise BackendError(f"adapter {name}: layer {layer!r} is not an integer")
        if not 0 <= layer < num_layers:
            raise BackendError(f"adapter {name}: layer {layer} is outside the model's layers 0..{num_layers - 1}")
        if proj not in PROJECTIONS:
            raise BackendError(f"adapter {name}: unknown projection {proj!r} (known: {', '.join(PROJECTIONS)})")
        try:
            a, b, scale = value
        except (TypeError, ValueError):
            raise BackendError(f"adapter {name}: layer {layer} {proj} is not (A, B, scale)") from None
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        out, inp = shape_of(proj)
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != inp or b.shape[0] != out or a.shape[0] != b.shape[1]:
            raise BackendError(
                f"adapter {name}: layer {layer} {proj} has A {a.shape} and B {b.shape}, "
                f"expected A (r, {inp}) and B ({out}, r)"
            )
        if not isinstance(scale, Real) or not math.isfinite(scale):
            raise BackendError(f"adapter {name}: layer {layer} {proj} has scale {scale!r}, not a finite number")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise BackendError(f"adapter {name}: layer {layer} {proj} has non-finite factors")
        if a.shape[0]:  # rank 0 adds nothing
            # Scale folded into B in float32, as the NumPy backend's delta does.
            out_entries.append((int(layer), proj, a, b * np.float32(scale)))
    return out_entries
