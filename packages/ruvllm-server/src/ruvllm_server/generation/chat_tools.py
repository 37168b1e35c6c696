"""What tools do to a chat request: the tool choice read from the request, the prompt and output
constraint that follow from it, the calls found in a finished choice, and, while streaming, content
and tool-call deltas told apart as the text comes (what may still become a call is held back)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ruvllm.structured import StructuredOutput
from ruvllm_server.errors import bad_request
from ruvllm_server.generation.requests import structured_output
from ruvllm_server.schemas import ChatChunkChoice, ChatCompletionRequest, ChatDelta, FunctionDelta, ToolCallDelta
from ruvllm_server.tools import (
    ToolCall,
    ToolParser,
    calls_from_partial_required,
    calls_from_required,
    check_tools,
    named_schema,
    required_schema,
    tool_system_prompt,
)


@dataclass
class ToolSetup:
    """How one chat request uses tools: ``mode`` none / auto / required / named."""

    tools: list[dict[str, Any]]
    mode: str
    name: str | None = None
    parallel: bool = True


def tool_setup(req: ChatCompletionRequest) -> ToolSetup | None:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    tools = check_tools(req.tools)
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice in ("none", "auto", "required"):
        return ToolSetup(tools, choice or "auto", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        named_schema(tools, name)  # an unknown name is a 400 naming tool_choice
        return ToolSetup(tools, "named", name, parallel)
    raise bad_request(
        "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


def tool_prompt(
    setup: ToolSetup, req: ChatCompletionRequest, template_reads_tools: bool, messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any], StructuredOutput | None]:
    """``(messages, chat template keywords, output constraint)`` for a request with tools: a forced
    call is constrained to the tools' schema; the tools go to a template that reads them, or into
    the system message as instructions."""
    structured = None
    template_kw: dict[str, Any] = {}
    if setup.mode in ("required", "named") and structured_output(req) is not None:
        raise bad_request("a forced tool call cannot also have an output constraint", param="tool_choice")
    # A forced call takes strict mode's fixed form: the name before the arguments, and the arguments
    # of a strict function (additionalProperties false) in their schema's order with bounded numbers.
    if setup.mode == "named":
        schema = named_schema(setup.tools, setup.name)
        structured = StructuredOutput.json_schema(schema, param="tool_choice", strict=True)
    elif setup.mode == "required":
        schema = required_schema(setup.tools, setup.parallel)
        structured = StructuredOutput.json_schema(schema, param="tools", strict=True)
    if template_reads_tools:
        template_kw["tools"] = setup.tools  # as transformers passes them
    elif setup.mode != "none":
        messages = with_system_text(messages, tool_system_prompt(setup.tools, setup.parallel))
    return messages, template_kw, structured


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``messages`` with ``text`` added to the system message (a new one first if there is none)."""
    if messages and messages[0].get("role") in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{text}".strip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def split_calls(
    setup: ToolSetup | None, parser: ToolParser | None, named_call_id: str, text: str, finish_reason: str | None
) -> tuple[str | None, list[ToolCall], str | None]:
    """(content, tool calls, finish reason) of a finished choice's text."""
    if setup is None or setup.mode == "none":
        return text, [], finish_reason
    if setup.mode == "named":  # the arguments, as far as they got (finish_reason says whether whole)
        return None, [ToolCall(setup.name or "", text, named_call_id)], finish_reason
    if setup.mode == "required":
        if finish_reason == "stop":
            return None, calls_from_required(text), "tool_calls"
        # Cut short: the complete calls, and the one being written as far as it got.
        calls = calls_from_partial_required(text)
        return (None, calls, finish_reason) if calls else (text, [], finish_reason)
    if finish_reason != "stop":
        return text, [], finish_reason
    assert parser is not None
    parsed = parser.parse(text, setup.tools)
    if not parsed.tool_calls:
        return text, [], finish_reason
    return parsed.content, parsed.tool_calls, "tool_calls"


@dataclass
class ChoiceTools:
    """Per-choice tool-call state while streaming (auto mode holds back what may be a call)."""

    text: str = ""
    emitted: int = 0
    call_at: int | None = None
    started_named: bool = False


def tool_deltas(
    setup: ToolSetup,
    parser: ToolParser | None,
    named_call_id: str,
    index: int,
    st: ChoiceTools,
    piece: str,
    finish_reason: str | None,
) -> list[ChatChunkChoice]:
    """The stream's entries of choice ``index`` (a chunk each) for one engine delta when the request
    has tools: content as it comes, except what is (or may become) a tool call, which goes out as
    tool-call deltas (id and name first, then argument fragments)."""
    st.text += piece
    out: list[ChatChunkChoice] = []

    def content(text: str) -> None:
        if text:
            out.append(ChatChunkChoice(index, ChatDelta(content=text), None, None))

    if setup.mode == "named":
        if not st.started_named:
            st.started_named = True
            first = ToolCallDelta(0, FunctionDelta(setup.name, ""), named_call_id, "function")
            out.append(ChatChunkChoice(index, ChatDelta(tool_calls=[first]), None, None))
        if piece:
            delta = ToolCallDelta(0, FunctionDelta(arguments=piece))
            out.append(ChatChunkChoice(index, ChatDelta(tool_calls=[delta]), None, None))
        if finish_reason:
            out.append(ChatChunkChoice(index, ChatDelta(), None, finish_reason))
        return out
    if setup.mode == "auto" and st.call_at is None and parser is not None:
        pending = st.text[st.emitted :]
        # A parser whose calls open the output cannot find one once content went out.
        open_ = st.emitted == 0 or not parser.markers_at_start
        at = parser.call_start(pending) if open_ else None
        if at is not None:
            st.call_at = st.emitted + at
            content(pending[:at])
            st.emitted = st.call_at
        elif finish_reason is None:
            keep = parser.may_start(pending) if open_ else 0
            content(pending[: len(pending) - keep])
            st.emitted += len(pending) - keep
    elif setup.mode == "none":
        content(st.text[st.emitted :])
        st.emitted = len(st.text)
    if finish_reason is None:
        return out
    _, calls, reason = split_calls(setup, parser, named_call_id, st.text, finish_reason)
    if calls:
        for k, c in enumerate(calls):
            head = ToolCallDelta(k, FunctionDelta(c.name, ""), c.id, "function")
            out.append(ChatChunkChoice(index, ChatDelta(tool_calls=[head]), None, None))
            out.append(
                ChatChunkChoice(
                    index,
                    ChatDelta(tool_calls=[ToolCallDelta(k, FunctionDelta(arguments=c.arguments))]),
                    None,
                    None,
                )
            )
    else:
        content(st.text[st.emitted :])
    st.emitted = len(st.text)
    out.append(ChatChunkChoice(index, ChatDelta(), None, reason))
    return out
