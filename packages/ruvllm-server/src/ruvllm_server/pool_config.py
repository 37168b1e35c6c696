"""What a server of several models serves: the models the settings name (model references,
``--models-dir``, ``--models-config`` tables) with each one's own settings, aliases and keep_alive.
See :mod:`ruvllm_server.pool` for how they are loaded and unloaded."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from ruvllm_server.settings import ServerConfigError, ServerSettings, _normalise, read_toml

#: What a models-config table may set for its model besides the server's per-model settings.
POOL_KEYS = frozenset({"aliases", "keep_alive", "preload"})
#: Server settings a model may have its own value of (``[models.NAME]`` in ``--models-config``).
PER_MODEL = frozenset(
    {"model", "backend", "quantization", "dtype", "threads", "device", "backend_options", "max_context",
     "kv_cache_memory", "num_kv_blocks", "kv_cache_quantization", "kv_cache_dtype", "max_num_seqs",
     "max_num_batched_tokens", "sampling", "max_step_ms", "max_step_ratio", "precompile", "pipeline_decode",
     "speculative", "num_speculative_tokens", "draft_model", "draft_quantization", "draft_vocab_size",
     "tool_call_parser", "reasoning_parser", "lora_modules", "max_lora_rank", "max_loras", "plugin_options",
     "sona", "sona_scope", "sona_state_dir", "embedding_max_tokens", "max_embedding_inputs", "matryoshka_dimensions"}
)  # fmt: skip
#: Server settings that have no meaning with several models.
NOT_POOLED = {
    "served_model_name": "models are named by file stem or by their --models-config table",
    "enable_lora_runtime_updates": "a runtime adapter would not say which model it belongs to",
    "coordinator": "a multi-process group serves one model",
}
#: A GGUF file or a model folder (config.json, or sentence-transformers' modules.json).
_MODEL_FILES = ("config.json", "modules.json")

_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: float | str | None, what: str = "keep_alive") -> float | None:
    """Ollama's ``keep_alive`` in seconds: a number (seconds), or a Go duration (``5m``, ``1h30m``,
    ``300ms``); a negative value is None (kept until the server stops)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ServerConfigError(f"{what} must be a number of seconds or a duration such as 5m, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise ServerConfigError(
                    f"{what} must be a number of seconds or a duration such as 5m, got {value!r}"
                ) from None
            seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    return None if seconds < 0 else seconds


@dataclass
class ModelSpec:
    """One servable model: its name, its settings (the server's with its own on top), the other names
    requests may use for it, and how long it stays loaded when idle (None: until the server stops)."""

    name: str
    settings: ServerSettings
    aliases: tuple[str, ...] = ()
    keep_alive: float | None = 300.0
    preload: bool = False


def _stem(path: Path) -> str:
    return path.stem if path.suffix == ".gguf" else path.name


def _dir_models(root: str) -> list[tuple[str, str]]:
    p = Path(root).expanduser()
    if not p.is_dir():
        raise ServerConfigError(f"--models-dir {root!r} is not a directory")
    found = []
    for child in sorted(p.iterdir()):
        if (child.is_file() and child.suffix == ".gguf") or (
            child.is_dir() and any((child / f).is_file() for f in _MODEL_FILES)
        ):
            found.append((_stem(child), str(child)))
    if not found:
        raise ServerConfigError(f"--models-dir {root!r} holds no GGUF file or model folder")
    return found


def _config_tables(path: str) -> dict[str, dict[str, Any]]:
    data = read_toml(path, "--models-config")
    extra = set(data) - {"models"}
    if extra or not isinstance(data.get("models"), dict):
        raise ServerConfigError(f"--models-config {path!r}: put each model in a [models.NAME] table (found {extra})")
    tables = data["models"]
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ServerConfigError(f"--models-config {path!r}: models.{name} must be a table")
    return tables


def pooled(settings: ServerSettings) -> bool:
    """Whether the settings ask for several models (or a directory or config of them)."""
    return bool(settings.models or settings.models_dir or settings.models_config)


def model_specs(settings: ServerSettings) -> list[ModelSpec]:
    """Every model the settings name, in order (the first answers requests that name none)."""
    for key, why in NOT_POOLED.items():
        if getattr(settings, key):
            raise ServerConfigError(f"{key} is not available with several models: {why}")
    refs: dict[str, str] = {}

    def add(name: str, ref: str, source: str) -> None:
        if name in refs and refs[name] != ref:
            raise ServerConfigError(f"two models are named {name!r} ({refs[name]} and {ref}, {source})")
        refs[name] = ref

    for ref in [settings.model, *settings.models] if settings.model else list(settings.models):
        p = Path(ref).expanduser()
        add(_stem(p) if p.exists() else ref, ref, "given")
    if settings.models_dir:
        for name, ref in _dir_models(settings.models_dir):
            add(name, ref, "--models-dir")
    tables = _config_tables(settings.models_config) if settings.models_config else {}
    for name, table in tables.items():
        if "model" in table:
            add(name, str(table["model"]), "--models-config")
        elif name not in refs:
            raise ServerConfigError(f"--models-config: models.{name} gives no `model` and no other source names it")
    if not refs:
        raise ServerConfigError("no model given")
    default_keep = keep_alive_seconds(settings.keep_alive, "keep_alive")
    base = msgspec.to_builtins(settings)
    for key in ("models", "models_dir", "models_config"):
        base.pop(key)
    specs, names = [], set(refs)
    for name, ref in refs.items():
        table = dict(tables.get(name, {}))
        own = {k: table.pop(k) for k in list(table) if k in POOL_KEYS}
        unknown = [k for k in table if k.replace("-", "_") not in PER_MODEL]
        if unknown:
            raise ServerConfigError(
                f"--models-config: models.{name}: {', '.join(map(repr, unknown))} cannot be set per model "
                f"(per model: {', '.join(sorted(PER_MODEL | POOL_KEYS))})"
            )
        merged = {**base, **_normalise(f"--models-config models.{name}", table), "model": ref}
        merged["served_model_name"] = name
        try:
            model_settings = msgspec.convert(merged, ServerSettings, strict=False)
        except msgspec.ValidationError as exc:
            raise ServerConfigError(f"--models-config models.{name}: {exc}") from None
        aliases = own.get("aliases", [])
        if isinstance(aliases, str) or not all(isinstance(a, str) for a in aliases):
            raise ServerConfigError(f"--models-config models.{name}.aliases must be a list of names")
        for alias in aliases:
            if alias in names:
                raise ServerConfigError(f"--models-config models.{name}: the alias {alias!r} is already a name")
            names.add(alias)
        keep = keep_alive_seconds(own["keep_alive"], f"models.{name}.keep_alive") if "keep_alive" in own else None
        specs.append(
            ModelSpec(
                name,
                model_settings,
                tuple(aliases),
                keep if "keep_alive" in own else default_keep,
                bool(own.get("preload", False)),
            )
        )
    return specs
