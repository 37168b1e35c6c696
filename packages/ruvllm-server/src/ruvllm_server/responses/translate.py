"""A Responses request in the chat path's terms, and a chat completion back as a response: the one
place where the two APIs meet (as llama.cpp's server converts ``/v1/responses`` to its chat path).

Items of ``input`` become chat messages (``function_call`` items an assistant turn's ``tool_calls``,
``function_call_output`` items tool messages); ``tools``, ``tool_choice`` and ``text.format`` become
their chat forms. Errors name the Responses field (``input[2].type``, ``text.format.schema``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ruvllm.errors import RequestError
from ruvllm_server.errors import APIError, bad_request
from ruvllm_server.responses.wire import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponseRequest,
    ResponseStatus,
    ResponseUsage,
)
from ruvllm_server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    JsonSchemaFormat,
    ResponseFormat,
    StreamOptions,
    ToolCallIn,
    Usage,
)

#: Content part types whose text a message keeps (output_text: an assistant turn sent back).
TEXT_PARTS = ("input_text", "output_text", "text")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")

#: Chat-path parameter names, by prefix, as the Responses fields they came from.
PARAM_NAMES = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_param(param: str | None) -> str | None:
    """A chat-path error's ``param`` as the Responses field it came from."""
    if param is None:
        return None
    for chat, responses in PARAM_NAMES:
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            return responses + param[len(chat) :]
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".")
    return param


def renamed(exc: Exception) -> Exception:
    """A chat-path error with its ``param`` renamed to the Responses field (others unchanged)."""
    if isinstance(exc, APIError):
        return APIError(exc.status, exc.message, param=responses_param(exc.param), code=exc.code, headers=exc.headers)
    if isinstance(exc, RequestError):
        param = responses_param(exc.param)
        return bad_request(str(exc), param=param)
    return exc


# --- input --------------------------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"content part type {kind!r} is not supported (only input_text and output_text)",
                param=f"{where}[{j}].type",
            )
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """``input`` as chat messages. Consecutive ``function_call`` items make one assistant turn."""
    if isinstance(items, str):
        return [ChatMessage("user", items)]
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise bad_request(
                    f"role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}", param=f"{where}.role"
                )
            out.append(ChatMessage(role, _text_of(item.get("content", ""), f"{where}.content")))
        elif kind == "function_call":
            missing = [k for k in ("call_id", "name", "arguments") if not isinstance(item.get(k), str)]
            if missing:
                raise bad_request(f"a function_call item needs {', '.join(missing)}", param=f"{where}.{missing[0]}")
            call = ToolCallIn(FunctionCall(item["name"], item["arguments"]), item["call_id"])
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls and not last.content:
                last.tool_calls.append(call)
            else:
                out.append(ChatMessage("assistant", None, tool_calls=[call]))
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request("a function_call_output item needs call_id", param=f"{where}.call_id")
            output = item.get("output", "")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            out.append(ChatMessage("tool", text, tool_call_id=item["call_id"]))
        elif kind == "reasoning":
            continue  # a reasoning item sent back: the template is given the answers only
        else:
            raise bad_request(
                f"input item type {kind!r} is not supported (message, function_call, function_call_output, reasoning)",
                param=f"{where}.type",
            )
    return out


def output_messages(output: list[OutputItem]) -> list[ChatMessage]:
    """A response's output as the chat turns a follow-up conversation continues from."""
    content = "".join(p.text for item in output if isinstance(item, MessageItem) for p in item.content)
    calls = [
        ToolCallIn(FunctionCall(item.name, item.arguments), item.call_id)
        for item in output
        if isinstance(item, FunctionCallItem)
    ]
    return [ChatMessage("assistant", content or None, tool_calls=calls or None)]


# --- tools and text.format ----------------------------------------------------------------------


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(
                f"tool type {kind!r} is not supported: this server runs function tools only", param=f"tools[{i}].type"
            )
        if not isinstance(tool.get("name"), str):
            raise bad_request("a function tool needs a name", param=f"tools[{i}].name")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None, has_tools: bool) -> str | dict[str, Any] | None:
    if choice in ("auto", "none") and not has_tools:
        return None  # OpenAI takes these without tools; the chat path refuses any choice then
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        f"tool_choice type {choice.get('type')!r} is not supported: none, auto, required or a function",
        param="tool_choice",
    )


def chat_response_format(text: dict[str, Any] | None) -> ResponseFormat | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        schema = fmt.get("schema")
        if schema is None:
            raise bad_request("text.format json_schema needs schema", param="text.format.schema")
        return ResponseFormat(
            "json_schema", JsonSchemaFormat(schema, fmt.get("name"), fmt.get("description"), fmt.get("strict"))
        )
    raise bad_request(
        f"text.format type must be text, json_object or json_schema, got {kind!r}", param="text.format.type"
    )


# --- the request as a chat request --------------------------------------------------------------


def check_supported(req: ResponseRequest) -> None:
    """Refuse what this server does not do, naming the field (before anything runs or is stored)."""
    if req.background:
        raise bad_request("background mode is not supported", param="background")


@dataclass
class Translated:
    """A response request in the chat path's terms."""

    chat: ChatCompletionRequest
    #: The conversation before this turn's output, without ``instructions`` (which a follow-up
    #: through ``previous_response_id`` does not inherit, as OpenAI does).
    history: list[ChatMessage] = field(default_factory=list)


def chat_request(req: ResponseRequest, model: str, earlier: list[ChatMessage]) -> Translated:
    """The chat request that runs ``req``, continuing ``earlier`` (a stored conversation)."""
    check_supported(req)
    history = [*earlier, *input_messages(req.input)]
    if not history:
        raise bad_request("input must not be empty", param="input")
    messages = [ChatMessage("system", req.instructions), *history] if req.instructions else list(history)
    try:
        chat = ChatCompletionRequest(
            model=req.model or model,
            messages=messages,
            tools=chat_tools(req.tools),
            tool_choice=chat_tool_choice(req.tool_choice, bool(req.tools)),
            parallel_tool_calls=req.parallel_tool_calls,
            response_format=chat_response_format(req.text),
            max_completion_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            user=req.user,
            stream=bool(req.stream),
            stream_options=StreamOptions(include_usage=True) if req.stream else None,
        )
    except RequestError as exc:
        raise renamed(exc) from None
    return Translated(chat, history)


# --- the chat answer as a response --------------------------------------------------------------


@dataclass
class Answer:
    """What one run produced, in the terms a response is built from."""

    content: str | None
    calls: list[tuple[str, str, str]]  # (call_id, name, arguments)
    reasoning: str | None
    finish_reason: str | None
    usage: Usage | None
    #: Item ids, so a streamed response's final object names the items its events named.
    ids: dict[str, str] = field(default_factory=dict)


def output_items(answer: Answer) -> list[OutputItem]:
    incomplete = answer.finish_reason == "length"
    status: ItemStatus = "incomplete" if incomplete else "completed"
    ids = answer.ids
    items: list[OutputItem] = []
    if answer.reasoning:
        items.append(ReasoningItem(ids.get("reasoning") or new_id("rs"), [ReasoningText(answer.reasoning)]))
    if answer.content or not answer.calls:
        items.append(MessageItem(ids.get("message") or new_id("msg"), [OutputText(answer.content or "")], status))
    for k, (call_id, name, arguments) in enumerate(answer.calls):
        items.append(FunctionCallItem(ids.get(f"call{k}") or new_id("fc"), call_id, name, arguments))
    return items


def response_usage(usage: Usage | None) -> ResponseUsage | None:
    if usage is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return ResponseUsage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, InputTokensDetails(cached))


@dataclass
class ResponseShell:
    """The fields of a response known before it runs (echoed from the request)."""

    req: ResponseRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def build(
        self, status: ResponseStatus, output: list[OutputItem] | None = None, usage: Usage | None = None
    ) -> ResponseObject:
        req = self.req
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            model=self.model,
            status=status,
            output=output or [],
            usage=response_usage(usage),
            incomplete_details=IncompleteDetails("max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions,
            metadata=req.metadata or {},
            parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=req.temperature,
            top_p=req.top_p,
            tool_choice=req.tool_choice or "auto",
            tools=req.tools or [],
            text=req.text or {"format": {"type": "text"}},
            max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id,
            store=req.store is not False,
            user=req.user,
        )

    def finish(self, answer: Answer) -> ResponseObject:
        status: ResponseStatus = "incomplete" if answer.finish_reason == "length" else "completed"
        return self.build(status, output_items(answer), answer.usage)
