"""Wire types of Ollama's API as msgspec Structs, shaped as the ``ollama`` Python client reads them.

``options``, ``format`` and the messages' ``tool_calls`` stay loosely typed: they are checked key by
key in :mod:`ruvllm_server.ollama.translate`, so an error names the exact field
(``options.mirostat``).
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct, field

# --- requests ----------------------------------------------------------------------------------


class OllamaMessage(Struct, kw_only=True):
    role: str
    content: str = ""
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class GenerationFields(Struct, kw_only=True):
    """What ``/api/chat`` and ``/api/generate`` share."""

    model: str
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    #: Ollama streams unless told not to.
    stream: bool = True
    #: Accepted: the one served model stays loaded whatever it says (``/api/ps``).
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatRequest(GenerationFields, kw_only=True):
    messages: list[OllamaMessage] = []
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(GenerationFields, kw_only=True):
    prompt: str = ""
    system: str | None = None
    raw: bool | None = None
    # Refused by name when given (translate.check_generate).
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[Any] | None = None


class EmbedRequest(Struct, kw_only=True):
    model: str
    input: str | list[str]
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    dimensions: int | None = None


class ShowRequest(Struct, kw_only=True):
    model: str = ""
    #: The older clients' name for ``model``.
    name: str = ""
    verbose: bool | None = None


# --- responses ---------------------------------------------------------------------------------


class Timings(Struct, kw_only=True):
    """A finished request's counts and durations (nanoseconds), as Ollama's last line has them."""

    total_duration: int
    load_duration: int
    prompt_eval_count: int
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int


class ToolCallFunction(Struct):
    name: str
    arguments: dict[str, Any]
    index: int = 0


class ToolCall(Struct):
    function: ToolCallFunction
    id: str | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class Logprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class AssistantMessage(Struct, kw_only=True, omit_defaults=True):
    content: str
    role: str = field(default_factory=lambda: "assistant")  # a factory: kept on the wire
    thinking: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatPart(Struct, kw_only=True, omit_defaults=True):
    """One line of ``/api/chat``: a piece of the answer, or (``done``) the last with the timings."""

    model: str
    created_at: str
    message: AssistantMessage
    done: bool
    done_reason: str | None = None
    logprobs: list[Logprob] | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class GeneratePart(Struct, kw_only=True, omit_defaults=True):
    """One line of ``/api/generate``."""

    model: str
    created_at: str
    response: str
    done: bool
    thinking: str | None = None
    done_reason: str | None = None
    logprobs: list[Logprob] | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class EmbedResponse(Struct, kw_only=True):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class ModelDetails(Struct, kw_only=True):
    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ListedModel(Struct, kw_only=True):
    name: str
    model: str
    modified_at: str
    size: int
    details: ModelDetails


class Tags(Struct):
    models: list[ListedModel]


class RunningModel(Struct, kw_only=True):
    name: str
    model: str
    size: int
    size_vram: int
    details: ModelDetails
    context_length: int
    #: Never: the one served model stays loaded as long as the server runs.
    expires_at: str | None = None


class Running(Struct):
    models: list[RunningModel]


class ShowResponse(Struct, kw_only=True):
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class Version(Struct):
    version: str
