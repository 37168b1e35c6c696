"""Wire types of ``/v1/responses`` (the OpenAI Responses API) as msgspec Structs, shaped as the
openai SDK's ``types.responses`` read them.

The request keeps ``input``, ``tools``, ``tool_choice`` and ``text`` loosely typed: they are checked
item by item in :mod:`ruvllm_server.responses.translate`, so an error can name the exact field
(``input[2].type``) the way OpenAI's does.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

from ruvllm_server.schemas import PositiveInt, Temperature, TopP

# --- the request -------------------------------------------------------------------------------


class ResponseRequest(Struct, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Accepted and echoed or ignored: clients (the Agents SDK) send them with their defaults.
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    seed: int | None = None


# --- output items ------------------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(Struct, tag_field="type", tag="reasoning_text"):
    text: str


class MessageItem(Struct, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    status: ItemStatus = "completed"
    role: str = "assistant"


class FunctionCallItem(Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus = "completed"


class ReasoningItem(Struct, tag_field="type", tag="reasoning"):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = []
    status: ItemStatus = "completed"


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


# --- the response ------------------------------------------------------------------------------


ResponseStatus = Literal["completed", "incomplete", "in_progress", "failed"]


class InputTokensDetails(Struct, frozen=True):
    cached_tokens: int = 0


class OutputTokensDetails(Struct, frozen=True):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class IncompleteDetails(Struct):
    reason: str


class ResponseObject(Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: ResponseStatus
    output: list[OutputItem]
    object: str = "response"
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    text: dict[str, Any] = {}
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    truncation: str = "disabled"
    user: str | None = None


class DeletedResponse(Struct):
    id: str
    object: str = "response"
    deleted: bool = True


# --- stream events (each one SSE ``event:`` + ``data:``) ---------------------------------------


class ResponseEvent(Struct, kw_only=True, tag_field="type"):
    sequence_number: int


class ResponseCreated(ResponseEvent, tag="response.created"):
    response: ResponseObject


class ResponseInProgress(ResponseEvent, tag="response.in_progress"):
    response: ResponseObject


class ResponseCompleted(ResponseEvent, tag="response.completed"):
    response: ResponseObject


class ResponseIncomplete(ResponseEvent, tag="response.incomplete"):
    response: ResponseObject


class ResponseFailed(ResponseEvent, tag="response.failed"):
    response: ResponseObject


class OutputItemAdded(ResponseEvent, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(ResponseEvent, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(ResponseEvent, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(ResponseEvent, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(ResponseEvent, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(ResponseEvent, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class ReasoningTextDelta(ResponseEvent, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(ResponseEvent, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(ResponseEvent, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(ResponseEvent, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str


class StreamError(ResponseEvent, tag="error"):
    message: str
    code: str | None = None
    param: str | None = None
