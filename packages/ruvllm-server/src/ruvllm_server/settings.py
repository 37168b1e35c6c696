"""Server settings: command-line flags > ``RUVLLM_*`` environment > TOML file > defaults, in one Struct."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import tomllib

from ruvllm.backend import parse_backend_options
from ruvllm.errors import BackendError, RuvllmError


class ServerConfigError(RuvllmError):
    """A server setting is missing, unknown or out of range."""


Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class ServerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: Model reference (alias, GGUF file, HF directory, Hub repo id).
    model: str = ""
    #: The id clients send as ``model`` and see in ``/v1/models`` (default: derived from ``model``).
    served_model_name: str | None = None
    #: Several models in one server (see :mod:`ruvllm_server.pool`): more model references besides
    #: ``model``, every GGUF file and model folder in ``models_dir`` (named by file stem), and
    #: ``models_config``, a TOML file of per-model settings (``[models.NAME]`` tables). A request's
    #: ``model`` picks one; a model not loaded loads on first use.
    models: list[str] = []
    models_dir: str | None = None
    models_config: str | None = None
    #: Most models loaded at once (least recently used unloaded first beyond it).
    models_max: Positive = 3
    #: Memory the loaded models (weights + KV caches) may take (``12GiB``); default: 80% of the memory
    #: available when the server starts.
    models_memory: str | int | None = None
    #: How long a model stays loaded after its last request (Ollama's ``keep_alive``: seconds or a
    #: duration such as ``5m``; ``-1``: until the server stops; ``0``: unloaded after each request).
    #: A request may say its own (Ollama's ``keep_alive``). With one model: it stays loaded.
    keep_alive: str | float = "5m"
    #: Seconds a request waits for its model to load (and for room to load it) before a 503.
    model_load_timeout: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    backend: str | None = None
    #: ``auto``: the backend's fastest form that keeps the checkpoint's weights (see LoadOptions).
    quantization: str = "auto"
    #: Compute dtype; ``auto``: bfloat16 on a GPU, float32 on a CPU (the backend refuses what it
    #: cannot run, by name).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    #: CPU threads for the backend's kernels (default: the CPUs this process may use).
    threads: Positive | None = None
    #: The device the backend runs on (backend extra ``device``; mlx: ``auto``, ``gpu`` or ``cpu``).
    #: None: the backend's choice. A backend without the choice refuses it by name.
    device: str | None = None
    #: Load options of the backend (``--backend-option mmap_experts=true``, TOML ``[backend_options]``,
    #: ``RUVLLM_BACKEND_OPTIONS="key=value,key=value"``): ``LoadOptions.extra``, checked by the backend.
    backend_options: dict[str, str] = {}
    #: Devices the model is sharded over (backend extra ``tensor_parallel``; jax: over every process's
    #: devices when ``num_processes`` > 1). 1: no sharding.
    tensor_parallel: Positive = 1
    #: ``HOST:PORT`` of this process, process 0 of a group of ``num_processes`` (the others run
    #: ``ruvllm follow``); see docs/scaling.md. None: one process.
    coordinator: str | None = None
    num_processes: Positive = 1
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    #: Requests generating at once (admission control); more wait in a queue of ``max_queue``.
    max_concurrent: Positive = 256
    max_queue: NonNegative = 512
    #: Longest prompt + completion in tokens (default: the model's context length).
    max_context: Positive | None = None
    #: Bearer keys; none means no authentication.
    api_keys: list[str] = []
    #: Origins allowed by CORS (``*`` for any); empty disables CORS headers.
    cors_origins: list[str] = []
    #: Requests per second per API key (per client address without keys); 0 disables the limit.
    rate_limit: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: Bucket size of the rate limiter (default: the rate rounded up, at least 1).
    rate_limit_burst: Positive | None = None
    max_body_bytes: Positive = 4 * 1024 * 1024
    #: Largest ``n`` (choices per request) accepted.
    max_n: Positive = 16
    #: Longest input of /v1/embeddings, in tokens (its private KV allocation is this long).
    embedding_max_tokens: Positive = 512
    #: An embedding or cross-encoder model's: inputs one request may carry (OpenAI's limit is 2048).
    max_embedding_inputs: Positive = 2048
    #: An embedding model's Matryoshka sizes besides its full one (what ``dimensions`` may ask), when its
    #: config.json does not list them (``matryoshka_dimensions``): EmbeddingGemma's card gives 512,256,128.
    matryoshka_dimensions: list[int] = []
    block_size: Positive = 16
    num_kv_blocks: Positive | None = None
    #: Memory budget of the KV cache (``2GiB``, ``512MiB``, or bytes) when ``num_kv_blocks`` is not
    #: given; default: room for 4 sequences of the served context within half the memory available
    #: once the model is loaded (:data:`ruvllm.engine.config.DEFAULT_KV_RULE`). Blocks are sized as the
    #: backend stores them (its dtype and layout).
    kv_cache_memory: str | int | None = None
    #: Fraction of the device memory the backend reports (weights included) that weights and KV
    #: cache may use, as vLLM's; the KV cache gets what the weights leave. Only for backends on a
    #: device that reports its memory (jax on a GPU), where it defaults to 0.9; not with
    #: ``kv_cache_memory``.
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    #: Quantize the KV cache (``int8``; candle-compat also ``int4``); the backend reports the smaller
    #: blocks, so the same ``kv_cache_memory`` holds more of them. None: full precision.
    kv_cache_quantization: str | None = None
    #: The KV cache's float dtype; ``auto``: the model's compute dtype (a half-width cache under
    #: float32 compute holds twice the tokens in the same memory).
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_num_seqs: Positive = 64
    max_num_batched_tokens: Positive = 2048
    #: Where tokens are sampled: ``device`` (the backend samples after its step; only token ids and
    #: asked-for log-probabilities reach the host), ``host``, or ``auto``: the device where the
    #: backend prefers it (jax on a GPU).
    sampling: Literal["auto", "host", "device"] = "auto"
    #: Latency target of one engine step (ms): prompt chunks are sized so a step stays within it and
    #: decoding streams keep a steady inter-token latency; 0: no target.
    max_step_ms: Annotated[float, msgspec.Meta(ge=0)] = 100.0
    #: A step that carries prompt tokens may last at most this many times the decode-only step of the
    #: same streams (the smaller of this and max_step_ms applies); 0: no relative target.
    max_step_ratio: Annotated[float, msgspec.Meta(ge=0)] = 3.0
    #: Compile every step shape before /ready turns 200 (none then compiles while serving).
    precompile: bool = True
    #: Precompile also the steps that return every position's logits (``prompt_logprobs``, ``echo``
    #: with logprobs): twice the shapes; without it such requests' first steps compile while serving.
    precompile_prompt_logprobs: bool = False
    #: Launch the next decoding step before this one's outputs are made, where the backend runs steps
    #: asynchronously (jax); outputs are the same either way.
    pipeline_decode: bool = True
    #: Speculative decoding: ``ngram`` (prompt lookup over each request's own prompt and output),
    #: ``draft`` (a draft model), ``ngram+draft`` (each step, each sequence, the one that pays more);
    #: None: off. Greedy output is unchanged; a request may opt out (``"speculative": false``).
    speculative: Literal["ngram", "draft", "ngram+draft"] | None = None
    #: Most draft tokens a stream offers per step (each stream's own count adapts below it).
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    #: ``speculative="draft"``: the draft model (a reference, or ``same``: the served checkpoint) and
    #: its quantization (``w4a8`` under a float model: quantized self-drafting; None: auto).
    draft_model: str | None = None
    draft_quantization: str | None = None
    #: The draft drafts over its commonest tokens only (its output head cut to the lowest ids and the
    #: special ones, this many); the target still verifies over the whole vocabulary. None: all.
    draft_vocab_size: Positive | None = None
    enable_prefix_caching: bool = True
    #: Seconds to wait for in-flight requests at shutdown.
    drain_timeout: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    #: JSON log lines (default: when stderr is not a terminal).
    log_json: bool | None = None
    #: Tool-call parser for ``tool_choice: auto`` (default: from the chat template's tool format).
    tool_call_parser: str | None = None
    #: Split thinking into ``reasoning_content`` (``think``, ``deepseek_r1``, or a plugin's; none: off).
    reasoning_parser: str | None = None
    #: Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}`` (least recently
    #: used out first; 0: none kept), and for how many seconds each.
    responses_store_max: NonNegative = 1000
    responses_store_ttl: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    #: LoRA adapters served beside the base model, ``name=path`` (a PEFT adapter directory or a Hub
    #: repo id in the cache); a request picks one with ``model: "<name>"``.
    lora_modules: list[str] = []
    #: Largest adapter rank accepted (none: any).
    max_lora_rank: Positive | None = None
    #: Adapters kept on the device at once (LRU beyond that, uploaded again when used; none: the
    #: backend's default).
    max_loras: Positive | None = None
    #: Serve ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (behind the API keys).
    enable_lora_runtime_updates: bool = False
    #: Options for plugins, by plugin name (``--plugin-option sona.scope=user``, TOML
    #: ``[plugin_options.sona]``, ``RUVLLM_PLUGIN_OPTIONS="sona.scope=user,other.key=v"``).
    plugin_options: dict[str, dict[str, str]] = {}
    #: Shorthands for the SONA plugin's options (``sona.enabled``, ``sona.scope``, ``sona.state_dir``).
    #: Attach SONA (ruvllm-sona) to the model and serve /v1/feedback and /v1/sona/stats.
    sona: bool = False
    #: SONA's adapter scope: ``global``, ``user`` (the request's ``user``, else the API key id), ...
    sona_scope: str | None = None
    #: Where SONA keeps its state across restarts (none: in memory only).
    sona_state_dir: str | None = None

    @property
    def effective_plugin_options(self) -> dict[str, dict[str, str]]:
        """``plugin_options`` with the ``sona*`` shorthands folded in."""
        out = {name: dict(opts) for name, opts in self.plugin_options.items()}
        sona = out.setdefault("sona", {})
        if self.sona:
            sona["enabled"] = "true"
        if self.sona_scope:
            sona["scope"] = self.sona_scope
        if self.sona_state_dir:
            sona["state_dir"] = self.sona_state_dir
        if not sona:
            del out["sona"]
        return out

    @property
    def model_name(self) -> str:
        """What clients call the model."""
        if self.served_model_name:
            return self.served_model_name
        p = Path(self.model)
        # A path is shown by its file or directory name, an alias or repo id as given.
        return p.stem if p.suffix == ".gguf" else (p.name if p.is_dir() else self.model)

    def masked(self) -> dict[str, Any]:
        """The settings as a dict with secrets replaced, for printing at start."""
        out = msgspec.to_builtins(self)
        out["api_keys"] = ["***"] * len(self.api_keys)
        return out


_FIELDS = {f.name: f for f in msgspec.structs.fields(ServerSettings)}
_LIST_FIELDS = {"api_keys", "cors_origins", "lora_modules", "models"}
#: Singular spellings accepted in TOML and the environment (``RUVLLM_API_KEY``).
_ALIASES = {"api_key": "api_keys", "cors_origin": "cors_origins"}
ENV_PREFIX = "RUVLLM_"


def _normalise(source: str, raw: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_").lower()
        name = _ALIASES.get(name, name)
        if name not in _FIELDS:
            raise ServerConfigError(f"{source}: unknown setting {key!r}")
        if name in _LIST_FIELDS and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if name == "plugin_options":
            value = parse_plugin_options(value, source)
        if name == "backend_options":
            try:
                value = parse_backend_options(value)
            except BackendError as exc:
                raise ServerConfigError(f"{source}: {exc}") from None
        out[name] = value
    return out


def parse_plugin_options(value: Any, source: str = "flags") -> dict[str, dict[str, str]]:
    """``name.key=value`` strings (a list, or one comma-separated string) or a ``{name: {key: value}}``
    table -> ``{name: {key: value}}``."""
    if isinstance(value, Mapping):
        if not all(isinstance(v, Mapping) for v in value.values()):
            raise ServerConfigError(f"{source}: plugin_options must be a table of tables ([plugin_options.NAME])")
        return {str(k): {str(kk): str(vv) for kk, vv in v.items()} for k, v in value.items()}
    items = value.split(",") if isinstance(value, str) else list(value)
    out: dict[str, dict[str, str]] = {}
    for item in items:
        item = str(item).strip()
        if not item:
            continue
        key, eq, val = item.partition("=")
        name, dot, opt = key.strip().partition(".")
        if not eq or not dot or not name or not opt:
            raise ServerConfigError(f"{source}: plugin option {item!r} must look like name.key=value")
        out.setdefault(name, {})[opt] = val.strip()
    return out


def read_toml(path: str | os.PathLike[str], what: str = "config file") -> dict[str, Any]:
    """A TOML file's tables, or a one-line error naming ``what`` and the path."""
    p = Path(path).expanduser()
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ServerConfigError(f"{what} {str(path)!r} not found") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ServerConfigError(f"{what} {str(path)!r} is not valid TOML: {exc}") from None


def from_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Settings in a TOML file: top-level keys, or a ``[server]`` table."""
    p = Path(path)
    data = read_toml(path)
    if isinstance(data.get("server"), dict) and len(data) == 1:
        data = data["server"]
    return _normalise(f"config file {str(p)!r}", data)


def from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Settings named ``RUVLLM_<FIELD>`` in the environment; other RUVLLM_* variables belong to core."""
    environ = os.environ if environ is None else environ
    raw = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX) :].lower()
        name = _ALIASES.get(name, name)
        if name in _FIELDS:
            raw[name] = value
    return _normalise("environment", raw)


def load_settings(
    flags: Mapping[str, Any] | None = None,
    *,
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServerSettings:
    """Merge the sources (flags > environment > TOML > defaults). ``None`` flags count as unset."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        merged.update(from_toml(config_file))
    merged.update(from_env(environ))
    merged.update(_normalise("flags", {k: v for k, v in (flags or {}).items() if v is not None}))
    try:
        # Non-strict so that environment strings ("8000", "true") convert to their field types.
        settings = msgspec.convert(merged, ServerSettings, strict=False)
    except msgspec.ValidationError as exc:
        raise ServerConfigError(f"invalid server setting: {exc}") from None
    if 0 < settings.max_step_ratio <= 1:
        raise ServerConfigError(
            f"invalid server setting: max_step_ratio must be 0 (off) or above 1, got {settings.max_step_ratio}"
        )
    return settings
