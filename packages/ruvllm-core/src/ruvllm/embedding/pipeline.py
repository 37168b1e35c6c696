"""A sentence-transformers model's own pipeline, read from its folder: ``modules.json`` (Transformer,
Pooling, Dense, Normalize, in order), each module's config, the prompts of
``config_sentence_transformers.json``, and for a cross-encoder (``*ForSequenceClassification``) its
classifier head and score activation. Modules and options not implemented are refused by name."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ruvllm.errors import ModelFormatError

#: Pooling modes in sentence-transformers' concatenation order (its legacy ``pooling_mode_*`` keys).
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
IMPLEMENTED_POOLING = ("cls", "max", "mean", "mean_sqrt_len_tokens", "lasttoken")
#: Dense / score activations by their torch class path's last part.
ACTIVATIONS = ("Identity", "Tanh", "Sigmoid")


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: missing") from None
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data


def _activation(path: Path, key: str, value: Any) -> str:
    name = str(value).rsplit(".", 1)[-1] if value else "Identity"
    if name not in ACTIVATIONS:
        raise ModelFormatError(f"{path}: {key}={value!r} is not implemented (ruvllm runs {', '.join(ACTIVATIONS)})")
    return name


@dataclass(frozen=True)
class Pooling:
    modes: tuple[str, ...] = ("mean",)


@dataclass
class Dense:
    """``activation(x @ weight.T + bias)``, ``weight [out, in]``."""

    weight: np.ndarray
    bias: np.ndarray | None
    activation: str


@dataclass
class Classifier:
    """A ``BertForSequenceClassification`` head: ``tanh(pooler(h[CLS]))``, then ``classifier``, then the
    score activation ``CrossEncoder.predict`` applies."""

    pooler_weight: np.ndarray
    pooler_bias: np.ndarray
    weight: np.ndarray
    bias: np.ndarray
    activation: str

    @property
    def num_labels(self) -> int:
        return int(self.weight.shape[0])


@dataclass
class Pipeline:
    """What runs after the encoder, and how inputs are prepared for it."""

    transformer_path: Path
    max_seq_length: int | None = None
    do_lower_case: bool = False
    pooling: Pooling | None = None
    dense: list[Dense] = field(default_factory=list)
    normalize: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    classifier: Classifier | None = None


def _pooling(path: Path) -> Pooling:
    c = _json(path / "config.json")
    mode = c.get("pooling_mode")
    if mode is not None:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:
        modes = tuple(m for key, m in _LEGACY_POOLING_KEYS.items() if c.get(key)) or ("mean",)
    for m in modes:
        if m not in POOLING_MODES:
            raise ModelFormatError(f"{path}: pooling mode {m!r} is unknown")
        if m not in IMPLEMENTED_POOLING:
            raise ModelFormatError(f"{path}: pooling mode {m!r} is not implemented")
    if c.get("include_prompt", True) is False:
        raise ModelFormatError(f"{path}: include_prompt=False (prompt tokens left out of pooling) is not implemented")
    return Pooling(modes)


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    f = path / "model.safetensors"
    if not f.is_file():
        found = ", ".join(sorted(p.name for p in path.iterdir())) if path.is_dir() else "no folder"
        raise ModelFormatError(f"{path}: no model.safetensors (ruvllm reads no pickled weights; found: {found})")
    return {k: np.asarray(v, dtype=np.float32) for k, v in load_file(str(f)).items()}


def _dense(path: Path) -> Dense:
    c = _json(path / "config.json")
    if c.get("use_residual"):
        raise ModelFormatError(f"{path}: use_residual=True is not implemented")
    for key in ("module_input_name", "module_output_name"):
        if c.get(key) not in (None, "sentence_embedding"):
            raise ModelFormatError(f"{path}: {key}={c[key]!r} is not implemented")
    t = _read_safetensors(path)
    weight = t.get("linear.weight")
    shape = (int(c["out_features"]), int(c["in_features"]))
    if weight is None or weight.shape != shape:
        raise ModelFormatError(
            f"{path}: linear.weight should be {shape}, found {None if weight is None else weight.shape}"
        )
    bias = t.get("linear.bias") if c.get("bias", True) else None
    if c.get("bias", True) and bias is None:
        raise ModelFormatError(f"{path}: bias=True but linear.bias is missing")
    return Dense(weight, bias, _activation(path, "activation_function", c.get("activation_function", "Tanh")))


def _module_kind(entry: dict[str, Any], where: Path) -> str:
    kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
    if kind not in ("Transformer", "Pooling", "Dense", "Normalize"):
        raise ModelFormatError(
            f"{where}: module {entry.get('type')!r} is not implemented (Transformer, Pooling, Dense, Normalize are)"
        )
    return kind


def is_cross_encoder(config: dict[str, Any]) -> bool:
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ())


def read_pipeline(root: Path) -> Pipeline:
    """The pipeline of the model folder ``root`` (sentence-transformers' default for a folder without
    ``modules.json``: the transformer, then mean pooling; a cross-encoder: its classifier)."""
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return _with_settings(
            root, Pipeline(root, pooling=None if is_cross_encoder(_json(root / "config.json")) else Pooling())
        )
    try:
        entries = json.loads(modules_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{modules_file}: invalid JSON ({exc})") from exc
    entries = sorted(entries, key=lambda e: int(e.get("idx", 0)))
    kinds = [_module_kind(e, modules_file) for e in entries]
    if not kinds or kinds[0] != "Transformer" or kinds.count("Transformer") != 1:
        raise ModelFormatError(f"{modules_file}: the first module, and only it, must be a Transformer ({kinds})")
    pipe = Pipeline(root / str(entries[0].get("path", "")))
    seen_normalize = False
    for entry, kind in zip(entries[1:], kinds[1:], strict=True):
        sub = root / str(entry.get("path", ""))
        if seen_normalize:
            raise ModelFormatError(f"{modules_file}: module {kind} after Normalize is not implemented")
        if kind == "Pooling":
            if pipe.pooling is not None or pipe.dense:
                raise ModelFormatError(f"{modules_file}: Pooling must come once, right after the Transformer")
            pipe.pooling = _pooling(sub)
        elif kind == "Dense":
            if pipe.pooling is None:
                raise ModelFormatError(f"{modules_file}: Dense before Pooling (on token embeddings) is not implemented")
            pipe.dense.append(_dense(sub))
        else:
            seen_normalize = pipe.normalize = True
    if pipe.pooling is None:
        raise ModelFormatError(f"{modules_file}: no Pooling module (token-level embeddings are not implemented)")
    return _with_settings(root, pipe)


def _with_settings(root: Path, pipe: Pipeline) -> Pipeline:
    sbert = pipe.transformer_path / "sentence_bert_config.json"
    if sbert.is_file():
        c = _json(sbert)
        pipe.max_seq_length = int(c["max_seq_length"]) if c.get("max_seq_length") else None
        pipe.do_lower_case = bool(c.get("do_lower_case", False))
    st = root / "config_sentence_transformers.json"
    if st.is_file():
        c = _json(st)
        prompts = c.get("prompts") or {}
        if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
            raise ModelFormatError(f"{st}: prompts must map names to strings")
        pipe.prompts = dict(prompts)
        pipe.default_prompt_name = c.get("default_prompt_name") or None
        if pipe.default_prompt_name is not None and pipe.default_prompt_name not in pipe.prompts:
            raise ModelFormatError(f"{st}: default_prompt_name {pipe.default_prompt_name!r} is not among the prompts")
        sim = c.get("similarity_fn_name")
        if sim not in (None, "cosine"):
            raise ModelFormatError(f"{st}: similarity_fn_name={sim!r} is not implemented (cosine is)")
    return pipe


def read_classifier(root: Path, config: dict[str, Any], tensor: Any, names: list[str]) -> Classifier:
    """The cross-encoder head from ``tensor(name)`` (the checkpoint's reader) and ``config.json``."""
    labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)
    st = config.get("sentence_transformers") or {}
    act = st.get("activation_fn") or config.get("sbert_ce_default_activation_function")
    activation = (
        _activation(root / "config.json", "activation_fn", act) if act else ("Sigmoid" if labels == 1 else "Identity")
    )
    if config.get("problem_type") not in (
        None,
        "regression",
        "single_label_classification",
        "multi_label_classification",
    ):
        raise ModelFormatError(f"{root}: problem_type={config['problem_type']!r} is not implemented")
    for needed in ("pooler.dense.weight", "classifier.weight"):
        if needed not in names:
            raise ModelFormatError(f"{root}: a sequence classifier without {needed} is not implemented")
    weight = np.asarray(tensor("classifier.weight"), dtype=np.float32)
    if weight.shape[0] != labels:
        raise ModelFormatError(f"{root}: classifier.weight has {weight.shape[0]} rows, num_labels is {labels}")
    return Classifier(
        np.asarray(tensor("pooler.dense.weight"), dtype=np.float32),
        np.asarray(tensor("pooler.dense.bias"), dtype=np.float32),
        weight,
        np.asarray(tensor("classifier.bias"), dtype=np.float32),
        activation,
    )
