"""Wire types of the OpenAI-compatible API (and vLLM-style /tokenize, /detokenize) as msgspec Structs.

Requests ignore fields they do not know (clients send newer OpenAI fields); ranges that do not
depend on the model are checked here so they show in the OpenAPI schema, the rest by
``SamplingParams.validate`` and the handlers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]


# --- errors -----------------------------------------------------------------------------------


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorBody


# --- shared -----------------------------------------------------------------------------------


class StreamOptions(Struct):
    include_usage: bool | None = None


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class JsonSchemaFormat(Struct):
    schema: dict[str, Any] | bool | None = None
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Struct):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Struct):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json: dict[str, Any] | str | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(Struct, kw_only=True):
    """Fields chat and completions share (OpenAI's plus vLLM's common extensions)."""

    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: PositiveInt | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: PositiveInt | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    #: Token id (as a string, per the OpenAI spec) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # Extensions beyond OpenAI, as vLLM names them.
    top_k: NonNegativeInt | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    min_tokens: NonNegativeInt | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    #: False: no speculative decoding for this request (when the server runs it; ruvllm's extension).
    speculative: bool | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_*.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


# --- chat -------------------------------------------------------------------------------------


class ContentPart(Struct):
    type: str
    text: str | None = None


class FunctionCall(Struct):
    name: str
    #: JSON text, as the OpenAI API sends it.
    arguments: str


class ToolCallIn(Struct):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    #: An assistant turn's calls, and a tool turn's answer to one of them.
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob] | None


class ToolCallOut(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatResponseMessage(Struct):
    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    #: The model's thinking, split off by the server's reasoning parser (DeepSeek's field name).
    reasoning_content: str | None = None


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class FunctionDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None


# --- completions ------------------------------------------------------------------------------


class CompletionRequest(SamplingFields, kw_only=True):
    #: A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str | int | list[int]]
    logprobs: TopLogprobs | None = None
    echo: bool | None = None
    best_of: PositiveInt | None = None
    suffix: str | None = None
    #: vLLM's extension: the prompt tokens' log-probabilities with this many top alternatives each.
    prompt_logprobs: TopLogprobs | None = None


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Struct):
    """One token's entry in vLLM's ``prompt_logprobs`` (keyed by token id)."""

    logprob: float
    rank: int | None
    decoded_token: str


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    #: With ``prompt_logprobs``: per prompt token (None for the first), token id -> its entry.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None


# --- models -----------------------------------------------------------------------------------


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "ruvllm"
    object: str = "model"
    #: Longest prompt + completion in tokens (vLLM names it so).
    max_model_len: int | None = None
    #: For a LoRA adapter: the base model it runs on (``root`` is where it was loaded from).
    parent: str | None = None
    root: str | None = None


class PooledModelCard(ModelCard, kw_only=True):
    """A model of a server holding several: whether it is loaded now (``loaded``, ``loading``,
    ``unloading``, ``unloaded``, ``failed``, with the error), and the other names it answers to."""

    status: str
    error: str | None = None
    aliases: list[str] = []


class ModelLoadRequest(Struct):
    model: str


class ModelLoadStatus(Struct):
    model: str
    status: str


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


# --- embeddings -------------------------------------------------------------------------------


class EmbeddingRequest(Struct, kw_only=True):
    model: str
    #: A string, a list of strings, a list of token ids, or a list of token-id lists.
    input: str | list[str | int | list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: PositiveInt | None = None
    user: str | None = None
    #: An embedding model's: -1 cuts each input to the model's limit, k > 0 to k tokens; absent, a
    #: longer input is a 400 naming the limit (vLLM's name).
    truncate_prompt_tokens: int | None = None
    #: An embedding model's prompt by name (``config_sentence_transformers.json``: ``query``, ``document``...).
    prompt_name: str | None = None


class EmbeddingData(Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Struct):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


# --- tokenizer --------------------------------------------------------------------------------


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(Struct):
    prompt: str


class TokenizerInfo(Struct):
    """``GET /tokenizer_info`` as vLLM serves it: the tokenizer's configuration in the shape of
    Hugging Face's ``tokenizer_config.json`` (special tokens as text), which lm-evaluation-harness
    reads to use the server's tokenizer through ``/tokenize`` and ``/detokenize``."""

    tokenizer_class: str
    model_max_length: int
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    add_bos_token: bool = False
    chat_template: str | None = None


# --- health -----------------------------------------------------------------------------------


class Health(Struct, omit_defaults=True):
    """``/health``: liveness, with the RuvLLM MVP's figures."""

    status: str
    #: Seconds since the server started.
    uptime_seconds: float
    #: API requests (``/v1/...``, ``/api/...``) answered so far, any status.
    total_requests: int
    #: Prompt tokens found in the prefix cache / prompt tokens looked up (0 before any).
    cache_hit_rate: float
    #: This process's resident memory (RSS), MiB.
    memory_usage_mb: float
    detail: str | None = None
    #: Speculative decoding: draft tokens kept / draft tokens verified (absent before any draft).
    spec_acceptance_rate: float | None = None


class Readiness(Struct):
    status: str
    model: str
    detail: str | None = None


def encode_json(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


class LoadLoraAdapterRequest(Struct, forbid_unknown_fields=True):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: Annotated[str, Meta(min_length=1, max_length=128)]
    lora_path: Annotated[str, Meta(min_length=1)]


class UnloadLoraAdapterRequest(Struct, forbid_unknown_fields=True):
    lora_name: Annotated[str, Meta(min_length=1, max_length=128)]
    lora_int_id: int | None = None


class LoraAdapterStatus(Struct):
    lora_name: str
    status: str
