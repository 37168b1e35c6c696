"""Wire types of the Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) as
msgspec Structs, shaped as the ``anthropic`` SDK's ``types`` read them.

The request keeps ``messages``' content blocks, ``system``, ``tools``, ``tool_choice``, ``thinking``
and ``output_config`` loosely typed: they are checked block by block in
:mod:`ruvllm_server.anthropic.translate`, so an error names the exact field
(``messages.2.content.0.type``) the way Anthropic's does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from ruvllm_server.schemas import NonNegativeInt, PositiveInt, TopP

# --- the request -------------------------------------------------------------------------------


class InputMessage(Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(Struct, kw_only=True):
    model: str
    messages: list[InputMessage]
    max_tokens: PositiveInt
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    #: Anthropic's range is 0..1 (OpenAI's 0..2).
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: TopP | None = None
    top_k: NonNegativeInt | None = None
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # Accepted: one tier of service here, and the prefix cache caches every prompt on its own.
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None
    # Refused by name when given (translate.UNSUPPORTED): features of Anthropic's platform.
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    inference_geo: Any = None
    speed: Any = None
    diagnostics: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None


class CountTokensRequest(Struct, kw_only=True):
    """``/v1/messages/count_tokens``: what the prompt is made of, without ``max_tokens``."""

    model: str
    messages: list[InputMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    mcp_servers: Any = None
    context_management: Any = None


class TokenCount(Struct):
    input_tokens: int


# --- the message -------------------------------------------------------------------------------


class TextBlock(Struct, tag_field="type", tag="text"):
    text: str
    citations: list[Any] | None = None


class ThinkingBlock(Struct, tag_field="type", tag="thinking"):
    thinking: str
    #: Anthropic's proof that its model wrote the thinking; a local model's thinking has none, and
    #: thinking blocks sent back are left out of the prompt (as the Responses API's reasoning items).
    signature: str = ""


class ToolUseBlock(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(Struct):
    """Input tokens as Anthropic counts them: ``input_tokens`` are the prompt tokens not read from
    the prefix cache, ``cache_read_input_tokens`` those that were (their sum is the prompt)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


class Message(Struct, kw_only=True):
    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage
    type: str = "message"
    role: str = "assistant"


# --- stream events -----------------------------------------------------------------------------


class TextDelta(Struct, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class InputJsonDelta(Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class MessageStart(Struct, tag_field="type", tag="message_start"):
    message: Message


class ContentBlockStart(Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentBlock


class ContentBlockDelta(Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(Struct):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDelta(Struct, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: Usage


class MessageStop(Struct, tag_field="type", tag="message_stop"):
    pass


class Ping(Struct, tag_field="type", tag="ping"):
    pass


# --- errors ------------------------------------------------------------------------------------


class ErrorDetail(Struct):
    type: str
    message: str


class ErrorEvent(Struct, tag_field="type", tag="error", omit_defaults=True):
    """An error: the body of a failed request (with ``request_id``) and a stream's ``error`` event
    (without)."""

    error: ErrorDetail
    request_id: str | None = None


StreamEvent = (
    MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop | Ping
)
