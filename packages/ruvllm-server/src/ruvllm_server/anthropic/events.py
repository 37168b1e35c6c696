"""A chat completion's stream of chunks as the Messages API's events: the one place where streamed
chat deltas (reasoning, content, tool-call deltas, usage) become ``message_start``, a
``content_block_start`` / ``content_block_delta`` / ``content_block_stop`` run per block (thinking,
text, tool_use), ``message_delta`` (stop reason, usage) and ``message_stop``, with a ``ping`` after
the start, in the order the ``anthropic`` SDK's stream reader expects."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ruvllm_server.anthropic.translate import Translated, new_id, stop_reason, usage
from ruvllm_server.anthropic.wire import (
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ErrorDetail,
    ErrorEvent,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageStart,
    MessageStop,
    Ping,
    StopDelta,
    StreamEvent,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
    Usage,
)
from ruvllm_server.generation.sse import named_event, sse_objects
from ruvllm_server.schemas import ChatCompletionChunk
from ruvllm_server.schemas import Usage as ChatUsage

#: The chat path's error ``type`` as Anthropic's (what a stream's ``error`` event carries).
ERROR_TYPES = {"server_error": "api_error", "service_unavailable": "overloaded_error"}


def encode_event(event: StreamEvent | ErrorEvent) -> bytes:
    """One SSE event: its ``event:`` line names the type, as Anthropic's stream does."""
    return named_event(event)


@dataclass
class MessageEvents:
    """Turns one message's chat chunks into events; blocks are numbered in the order they open."""

    translated: Translated
    id: str
    #: The prompt's tokens (``message_start`` says them before the prefix cache is looked up;
    #: ``message_delta`` gives the split into cached and not).
    prompt_tokens: int
    blocks: int = 0
    #: The open block's index and kind (``text``, ``thinking``, ``tool_use``), or None.
    index: int = -1
    kind: str | None = None
    #: The chat stream's tool-call index -> the block that carries it.
    calls: dict[int, int] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: ChatUsage | None = None

    def start(self) -> list[bytes]:
        shell = Message(
            id=self.id,
            model=self.translated.chat.model,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=Usage(self.prompt_tokens, 0),
        )
        return [encode_event(MessageStart(shell)), encode_event(Ping())]

    def _close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [encode_event(ContentBlockStop(self.index))]

    def _open(self, kind: str, block: ContentBlock) -> list[bytes]:
        out = self._close()
        self.index, self.kind = self.blocks, kind
        self.blocks += 1
        out.append(encode_event(ContentBlockStart(self.index, block)))
        return out

    def _delta(self, kind: str, block: Callable[[], ContentBlock], delta: Any) -> list[bytes]:
        out = [] if self.kind == kind else self._open(kind, block())
        out.append(encode_event(ContentBlockDelta(self.index, delta)))
        return out

    def chunk(self, chunk: ChatCompletionChunk) -> list[bytes]:
        if chunk.usage is not None:
            self.usage = chunk.usage
        out: list[bytes] = []
        for choice in chunk.choices:
            d = choice.delta
            if d.reasoning_content and self.translated.show_thinking:
                out += self._delta("thinking", lambda: ThinkingBlock(""), ThinkingDelta(d.reasoning_content))
            if d.content:
                out += self._delta("text", lambda: TextBlock(""), TextDelta(d.content))
            for tc in d.tool_calls or ():
                at = self.calls.get(tc.index)
                if at is None:
                    block = ToolUseBlock(tc.id or new_id("toolu"), tc.function.name or "", {})
                    out += self._open("tool_use", block)
                    at = self.calls[tc.index] = self.index
                elif at != self.index or self.kind != "tool_use":
                    continue  # a finished call takes no more arguments
                if tc.function.arguments:
                    out.append(encode_event(ContentBlockDelta(at, InputJsonDelta(tc.function.arguments))))
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
        return out

    def finish(self, matched: str | int | None) -> list[bytes]:
        """The closing events; ``matched`` is the stop string or token that ended the run."""
        out = self._close()
        reason, sequence = stop_reason(self.finish_reason, matched, self.translated.stop_sequences, bool(self.calls))
        out.append(encode_event(MessageDelta(StopDelta(reason, sequence), usage(self.usage))))
        out.append(encode_event(MessageStop()))
        return out

    def error(self, body: dict[str, Any]) -> bytes:
        err = body.get("error") or {}
        kind = str(err.get("type") or "api_error")
        message = str(err.get("message", "error"))
        if err.get("param"):
            message = f"{err['param']}: {message}"
        return encode_event(ErrorEvent(ErrorDetail(ERROR_TYPES.get(kind, kind), message)))


async def message_events(
    chat_stream: AsyncIterator[bytes], events: MessageEvents, matched: Callable[[], str | int | None]
) -> AsyncIterator[bytes]:
    """The events of one message, read from the chat path's SSE stream (its chunks decoded again:
    the chat path stays the one place that streams a run). ``matched()`` is read once the run is
    over: the stop string or token that ended it."""
    yield b"".join(events.start())
    try:
        async for piece in chat_stream:
            out: list[bytes] = []
            for obj in sse_objects(piece):
                if "error" in obj:
                    yield b"".join(out) + events.error(obj)
                    return
                out += events.chunk(msgspec.convert(obj, ChatCompletionChunk))
            if out:
                yield b"".join(out)
        yield b"".join(events.finish(matched()))
    finally:
        await chat_stream.aclose()  # type: ignore[attr-defined]


__all__ = ["MessageEvents", "encode_event", "message_events"]
