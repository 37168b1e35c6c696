"""What Ollama's model routes say about the served model (and its LoRA adapters): ``/api/tags``'s
list, ``/api/show``'s details and ``/api/ps``'s memory, read from the checkpoint and the engine."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from ruvllm.backend import ReportsDeviceMemory, ReportsWeightBytes
from ruvllm_server.ollama.translate import tagged
from ruvllm_server.ollama.wire import ListedModel, ModelDetails, RunningModel, ShowResponse

if TYPE_CHECKING:
    from ruvllm.checkpoint import Checkpoint
    from ruvllm_server.pool import Entry, ModelPool
    from ruvllm_server.state import ServerState


def _modified(state: ServerState) -> str:
    """When the model's file (or folder) last changed."""
    assert state.model is not None
    return _stamp(state.model.checkpoint.path)


def _stamp(path: Path) -> str:
    return datetime.fromtimestamp(path.stat().st_mtime, UTC).isoformat().replace("+00:00", "Z")


def parameter_size(n: int) -> str:
    """``135M``, ``1.5B``, as Ollama writes a model's size."""
    if n >= 10**9:
        return f"{n / 1e9:.1f}B".replace(".0B", "B")
    return f"{n / 1e6:.0f}M"


def details(state: ServerState, parent: str = "") -> ModelDetails:
    assert state.model is not None
    return checkpoint_details(state.model.checkpoint, parent)


def checkpoint_details(ck: Checkpoint, parent: str = "") -> ModelDetails:
    family = ck.config.architecture
    return ModelDetails(
        parent_model=parent,
        format=ck.format,
        family=family,
        families=[family],
        parameter_size=parameter_size(ck.config.num_parameters),
        quantization_level=ck.quantization,
    )


def _names(state: ServerState) -> list[tuple[str, str]]:
    """``(listed name, parent)`` of the base model and each adapter."""
    return [(tagged(state.model_name), ""), *((tagged(n), tagged(state.model_name)) for n in state.adapters)]


def listed(state: ServerState) -> list[ListedModel]:
    assert state.model is not None
    size, modified = state.model.checkpoint.size_bytes, _modified(state)
    return [
        ListedModel(name=name, model=name, modified_at=modified, size=size, details=details(state, parent))
        for name, parent in _names(state)
    ]


def memory(state: ServerState) -> tuple[int, int]:
    """``(bytes the model holds, of which on an accelerator)``: its weights as the backend reports
    them (else the file's size) and the KV cache."""
    assert state.model is not None and state.engine is not None
    backend_model = state.model.model
    weights = (
        backend_model.weight_bytes
        if isinstance(backend_model, ReportsWeightBytes)
        else state.model.checkpoint.size_bytes
    )
    total = weights + state.engine.engine.kv_cache_bytes
    on_device = isinstance(backend_model, ReportsDeviceMemory) and backend_model.device_memory() is not None
    return total, total if on_device else 0


def running(state: ServerState) -> list[RunningModel]:
    size, vram = memory(state)
    return [
        RunningModel(
            name=name,
            model=name,
            size=size,
            size_vram=vram,
            details=details(state, parent),
            context_length=state.max_context,
        )
        for name, parent in _names(state)
    ]


def capabilities(state: ServerState) -> list[str]:
    assert state.model is not None
    caps = ["completion", "embedding"]
    if state.model.tokenizer.chat_template and state.tool_parser is not None:
        caps.append("tools")
    if state.reasoning_parser is not None:
        caps.append("thinking")
    return caps


def show(state: ServerState, name: str) -> ShowResponse:
    """``/api/show`` of the served model ``name`` (already resolved)."""
    assert state.model is not None
    ck, c = state.model.checkpoint, state.model.config
    arch = c.architecture
    info: dict[str, Any] = {
        "general.architecture": arch,
        "general.name": c.name or state.model_name,
        "general.parameter_count": c.num_parameters,
        f"{arch}.context_length": c.max_position_embeddings,
        f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.block_count": c.num_layers,
        f"{arch}.attention.head_count": c.num_heads,
        f"{arch}.attention.head_count_kv": c.num_kv_heads,
        f"{arch}.vocab_size": c.vocab_size,
    }
    parent = tagged(state.model_name) if name != state.model_name else ""
    return ShowResponse(
        # What the model is, in a Modelfile's words: where it was loaded from.
        modelfile=f"FROM {ck.path}\n",
        parameters=f"num_ctx {state.max_context}",
        template=state.model.tokenizer.chat_template or "",
        details=details(state, parent),
        model_info=info,
        capabilities=capabilities(state),
        modified_at=_modified(state),
    )


# --- several models ----------------------------------------------------------------------------


def _unloaded(entry: Entry) -> ListedModel:
    """An unloaded model as ``/api/tags`` lists it, read from its file's header (nothing loaded)."""
    from ruvllm.checkpoint import open_checkpoint
    from ruvllm.resolve import resolve

    name = tagged(entry.spec.name)
    ck = open_checkpoint(resolve(entry.spec.settings.model))
    return ListedModel(name=name, model=name, modified_at=_stamp(ck.path), size=ck.size_bytes,
                       details=checkpoint_details(ck))  # fmt: skip


def pool_listed(pool: ModelPool) -> list[ListedModel]:
    """Every model of the server, loaded or not (a model whose file cannot be read is left out, logged)."""
    import structlog

    from ruvllm.errors import RuvllmError

    out: list[ListedModel] = []
    for entry in pool.entries.values():
        if entry.status == "loaded" and entry.state is not None and entry.state.model is not None:
            out += listed(entry.state)
            continue
        try:
            out.append(_unloaded(entry))
        except (RuvllmError, OSError) as exc:
            structlog.get_logger("ruvllm.server.ollama").warning(
                "model not listed", model=entry.spec.name, error=str(exc)
            )
    return out


def pool_running(pool: ModelPool) -> list[RunningModel]:
    """The loaded models, each with when it unloads if idle (``expires_at``; none: kept)."""
    out: list[RunningModel] = []
    for entry in pool.entries.values():
        state = entry.state
        if entry.status != "loaded" or state is None or state.model is None or state.engine is None:
            continue
        expires = pool.expires_at(entry)
        stamp = None if expires is None else datetime.fromtimestamp(expires, UTC).isoformat().replace("+00:00", "Z")
        out += [msgspec.structs.replace(m, expires_at=stamp) for m in running(state)]
    return out
