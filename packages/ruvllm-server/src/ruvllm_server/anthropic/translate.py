"""An Anthropic Messages request in the chat path's terms, and a chat completion back as a message:
the one place where the two APIs meet (as :mod:`ruvllm_server.responses.translate` is for OpenAI's
Responses API).

``system`` becomes the system message; a user turn's ``tool_result`` blocks become tool messages
(each must answer a ``tool_use`` of the assistant turn before it), an assistant turn's ``tool_use``
blocks its ``tool_calls``; ``tools``, ``tool_choice`` and ``output_config.format`` become their chat
forms. Thinking blocks sent back are left out of the prompt. Errors name the Anthropic field
(``messages.2.content.0.tool_use_id``) in the message, as Anthropic's do.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ruvllm.errors import RequestError
from ruvllm_server.anthropic.wire import (
    ContentBlock,
    CountTokensRequest,
    Message,
    MessagesRequest,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    Usage,
)
from ruvllm_server.errors import APIError, bad_request
from ruvllm_server.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    JsonSchemaFormat,
    ResponseFormat,
    StreamOptions,
    ToolCallIn,
)
from ruvllm_server.schemas import Usage as ChatUsage

#: Request fields of Anthropic's platform this server does not run: refused by name when given.
UNSUPPORTED = (
    "container",
    "mcp_servers",
    "context_management",
    "inference_geo",
    "speed",
    "diagnostics",
    "user_profile_id",
    "workspace_id",
)
#: Content block types that carry something other than text (refused by name until a model reads them).
MEDIA_BLOCKS = ("image", "document", "search_result")

#: Chat-path parameter names, by prefix, as the Anthropic fields they came from.
PARAM_NAMES = (
    ("max_completion_tokens", "max_tokens"),
    ("stop", "stop_sequences"),
    ("response_format", "output_config.format"),
    ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def dotted(param: str) -> str:
    """``tools[0].name`` as Anthropic writes a field's path: ``tools.0.name``."""
    return re.sub(r"\[(\d+)\]", r".\1", param)


def anthropic_param(param: str | None, origin: list[str]) -> str | None:
    """A chat-path error's ``param`` as the Anthropic field it came from; ``origin[i]`` is the
    Anthropic path of chat message ``i``."""
    if param is None:
        return None
    m = re.match(r"messages\[(\d+)\]", param)
    if m is not None:
        i = int(m.group(1))
        return origin[i] if i < len(origin) else "messages"
    for chat, ours in PARAM_NAMES:
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            return ours
    m = re.match(r"tools\[(\d+)\]", param)
    if m is not None:
        return f"tools.{m.group(1)}"
    return dotted(param)


def renamed(exc: Exception, origin: list[str]) -> Exception:
    """A chat-path error with its ``param`` renamed to the Anthropic field (others unchanged)."""
    if isinstance(exc, APIError):
        return APIError(
            exc.status, exc.message, param=anthropic_param(exc.param, origin), code=exc.code, headers=exc.headers
        )
    if isinstance(exc, RequestError):
        return bad_request(str(exc), param=anthropic_param(exc.param, origin))
    return exc


# --- messages -----------------------------------------------------------------------------------


Located = list[tuple[str, dict[str, Any]]]  # content blocks, each with its Anthropic path


def _blocks(content: str | list[dict[str, Any]], where: str) -> Located:
    if isinstance(content, str):
        return [(where, {"type": "text", "text": content})]
    for j, block in enumerate(content):
        if not isinstance(block.get("type"), str):
            raise bad_request("a content block needs a type", param=f"{where}.{j}.type")
    return [(f"{where}.{j}", block) for j, block in enumerate(content)]


def _refuse_block(kind: str, where: str, allowed: str) -> APIError:
    if kind in MEDIA_BLOCKS:
        return bad_request(f"{kind} blocks are not supported: the served model reads text only", param=f"{where}.type")
    return bad_request(f"content block type {kind!r} is not supported here ({allowed})", param=f"{where}.type")


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request("a text block needs text (a string)", param=f"{where}.text")
    return text


def _result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise _refuse_block(str(kind), f"{where}.content.{k}", "text")
            parts.append(_text(part, f"{where}.content.{k}"))
        text = "".join(parts)
    else:
        raise bad_request("tool_result content must be a string or a list of text blocks", param=f"{where}.content")
    # The chat turn has no error flag: the model reads it in the text.
    return f"Error: {text}" if block.get("is_error") else text


def _assistant_turn(blocks: Located) -> tuple[ChatMessage, list[str]]:
    """An assistant turn and the ids of its ``tool_use`` blocks."""
    texts: list[str] = []
    calls: list[ToolCallIn] = []
    for at, block in blocks:
        kind = block["type"]
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not call_id:
                raise bad_request("a tool_use block needs an id", param=f"{at}.id")
            if not isinstance(name, str) or not name:
                raise bad_request("a tool_use block needs a name", param=f"{at}.name")
            if not isinstance(args, dict):
                raise bad_request("tool_use input must be an object", param=f"{at}.input")
            calls.append(ToolCallIn(FunctionCall(name, json.dumps(args, ensure_ascii=False)), call_id))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # the template is given the answers only
        else:
            raise _refuse_block(kind, at, "text, tool_use, thinking")
    message = ChatMessage("assistant", "".join(texts) or None, tool_calls=calls or None)
    return message, [c.id for c in calls if c.id is not None]


def _user_turn(blocks: Located, where: str, open_calls: list[str]) -> tuple[list[ChatMessage], list[str]]:
    """A user turn's tool messages (its ``tool_result`` blocks, first) and its text message, with
    the Anthropic path of each."""
    results: list[ChatMessage] = []
    paths: list[str] = []
    texts: list[str] = []
    for at, block in blocks:
        kind = block["type"]
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request("a tool_result block needs tool_use_id", param=f"{at}.tool_use_id")
            if call_id not in open_calls:
                raise bad_request(
                    f"unexpected tool_use_id {call_id!r} in a tool_result block: each tool_result must answer a "
                    "tool_use block of the previous (assistant) message",
                    param=f"{at}.tool_use_id",
                )
            results.append(ChatMessage("tool", _result_text(block, at), tool_call_id=call_id))
            paths.append(at)
        else:
            raise _refuse_block(kind, at, "text, tool_result")
    if texts or not results:
        results.append(ChatMessage("user", "".join(texts)))
        paths.append(where)
    return results, paths


def chat_messages(req: MessagesRequest | CountTokensRequest) -> tuple[list[ChatMessage], list[str]]:
    """The conversation as chat messages, and the Anthropic path each came from. Consecutive turns
    of one role are one turn, as Anthropic combines them."""
    out: list[ChatMessage] = []
    origin: list[str] = []
    system = req.system
    if isinstance(system, list):
        system = "".join(_text(b, at) for at, b in _blocks(system, "system"))
    if system:
        out.append(ChatMessage("system", system))
        origin.append("system")
    if not req.messages:
        raise bad_request("at least one message is required", param="messages")
    turns: list[tuple[str, str, Located]] = []  # role, path of its first message, blocks
    for i, m in enumerate(req.messages):
        blocks = _blocks(m.content, f"messages.{i}.content")
        if turns and turns[-1][0] == m.role:
            turns[-1][2].extend(blocks)
        else:
            turns.append((m.role, f"messages.{i}", blocks))
    open_calls: list[str] = []
    for role, where, blocks in turns:
        if role == "assistant":
            message, calls = _assistant_turn(blocks)
            out.append(message)
            origin.append(where)
            open_calls = calls
        else:
            turn, paths = _user_turn(blocks, where, open_calls)
            left = [c for c in open_calls if c not in {t.tool_call_id for t in turn}]
            if left:
                raise _unanswered(left, where)
            out += turn
            origin += paths
            open_calls = []
    if turns[-1][0] == "assistant":
        raise bad_request(
            "a final assistant turn (a prefill to continue) is not supported: end with a user turn",
            param=f"messages.{len(req.messages) - 1}.role",
        )
    return out, origin


def _unanswered(ids: list[str], where: str) -> APIError:
    return bad_request(
        f"tool_use ids were found without tool_result blocks immediately after: {', '.join(ids)}; each tool_use "
        "needs its tool_result in the next user message",
        param=where,
    )


# --- tools, thinking, output format -------------------------------------------------------------


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad_request(
                f"tool type {kind!r} is not supported: this server runs client tools (name, input_schema) only",
                param=f"tools.{i}.type",
            )
        if not isinstance(tool.get("name"), str):
            raise bad_request("a tool needs a name", param=f"tools.{i}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request("a tool needs input_schema (a JSON schema object)", param=f"tools.{i}.input_schema")
        function: dict[str, Any] = {"name": tool["name"], "parameters": schema}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None, has_tools: bool) -> tuple[str | dict[str, Any] | None, bool | None]:
    """``(tool_choice, parallel_tool_calls)`` in chat terms."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return (kind if has_tools else None), parallel  # Anthropic takes these without tools
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice of type tool needs name", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad_request(f"tool_choice type must be auto, any, tool or none, got {kind!r}", param="tool_choice.type")


def thinking_shown(thinking: dict[str, Any] | None, max_tokens: int | None) -> bool:
    """Whether thinking blocks are returned. The server's ``--reasoning-parser`` finds the thinking;
    ``budget_tokens`` is checked as Anthropic checks it, and the thinking is bounded by ``max_tokens``."""
    if thinking is None:
        return True
    kind = thinking.get("type")
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return True
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise bad_request("budget_tokens must be a positive integer", param="thinking.budget_tokens")
        if max_tokens is not None and budget >= max_tokens:
            raise bad_request("budget_tokens must be less than max_tokens", param="thinking.budget_tokens")
        return True
    raise bad_request(f"thinking type must be enabled, adaptive or disabled, got {kind!r}", param="thinking.type")


def chat_response_format(config: dict[str, Any] | None) -> ResponseFormat | None:
    if not config:
        return None
    for key, value in config.items():
        if key not in ("format", "effort"):
            raise bad_request(f"unknown field {key!r}", param=f"output_config.{key}")
        if key == "effort" and value is not None:
            raise bad_request("effort levels are not supported", param="output_config.effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        raise bad_request(f"output format type must be json_schema, got {kind!r}", param="output_config.format.type")
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("a json_schema output format needs schema", param="output_config.format.schema")
    return ResponseFormat("json_schema", JsonSchemaFormat(fmt["schema"]))


def _user(metadata: dict[str, Any] | None) -> str | None:
    for key in metadata or {}:
        if key != "user_id":
            raise bad_request("extra inputs are not permitted", param=f"metadata.{key}")
    user = (metadata or {}).get("user_id")
    if user is not None and not isinstance(user, str):
        raise bad_request("user_id must be a string", param="metadata.user_id")
    return user


# --- the request as a chat request --------------------------------------------------------------


@dataclass
class Translated:
    """A Messages request in the chat path's terms."""

    chat: ChatCompletionRequest
    #: The Anthropic path of each chat message (errors name it).
    origin: list[str]
    show_thinking: bool = True
    stop_sequences: list[str] = field(default_factory=list)


def chat_request(req: MessagesRequest | CountTokensRequest) -> Translated:
    """The chat request that runs ``req`` (a count_tokens request: the same prompt, no limit)."""
    for name in UNSUPPORTED:
        if getattr(req, name, None) is not None:
            raise bad_request("not supported by this server", param=name)
    messages, origin = chat_messages(req)
    tools = chat_tools(req.tools)
    tool_choice, parallel = chat_tool_choice(req.tool_choice, bool(tools))
    full = isinstance(req, MessagesRequest)
    max_tokens = req.max_tokens if isinstance(req, MessagesRequest) else None
    show = thinking_shown(req.thinking, max_tokens)
    try:
        chat = ChatCompletionRequest(
            model=req.model,
            messages=messages,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel,
            response_format=chat_response_format(req.output_config),
            max_tokens=max_tokens,
            stop=(req.stop_sequences or None) if isinstance(req, MessagesRequest) else None,
            temperature=req.temperature if isinstance(req, MessagesRequest) else None,
            top_p=req.top_p if isinstance(req, MessagesRequest) else None,
            top_k=req.top_k if isinstance(req, MessagesRequest) else None,
            user=_user(req.metadata) if isinstance(req, MessagesRequest) else None,
            stream=bool(full and req.stream),  # type: ignore[union-attr]
            stream_options=StreamOptions(include_usage=True) if full and req.stream else None,  # type: ignore[union-attr]
        )
    except RequestError as exc:
        raise renamed(exc, origin) from None
    stops = list(req.stop_sequences or []) if isinstance(req, MessagesRequest) else []
    return Translated(chat, origin, show, stops)


# --- the chat answer as a message ---------------------------------------------------------------


def stop_reason(
    finish_reason: str | None, matched: str | int | None, stops: list[str], called: bool
) -> tuple[StopReason, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished choice: ``matched`` is the stop string or
    token that ended it (the engine's ``stop_reason``)."""
    if finish_reason == "length":
        return "max_tokens", None
    if called or finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def usage(chat: ChatUsage | None) -> Usage:
    if chat is None:
        return Usage(0, 0, 0)
    cached = chat.prompt_tokens_details.cached_tokens if chat.prompt_tokens_details else 0
    return Usage(chat.prompt_tokens - cached, chat.completion_tokens, cached)


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object ``tool_use.input`` is. Arguments cut short by ``max_tokens``
    are not an object yet: ``{}`` (the stream's ``input_json_delta`` carries the text as it came)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def message(completion: ChatCompletion, translated: Translated, matched: str | int | None, msg_id: str) -> Message:
    choice = completion.choices[0]
    m = choice.message
    blocks: list[ContentBlock] = []
    if m.reasoning_content and translated.show_thinking:
        blocks.append(ThinkingBlock(m.reasoning_content))
    if m.content:
        blocks.append(TextBlock(m.content))
    for c in m.tool_calls or ():
        blocks.append(ToolUseBlock(c.id, c.function.name, tool_input(c.function.arguments)))
    reason, sequence = stop_reason(choice.finish_reason, matched, translated.stop_sequences, bool(m.tool_calls))
    return Message(
        id=msg_id,
        model=translated.chat.model,
        content=blocks,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=usage(completion.usage),
    )
