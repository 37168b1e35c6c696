"""A chat completion's stream of chunks as the Responses API's typed events: the one place where
streamed chat deltas (content, reasoning, tool-call deltas, usage) become ``response.*`` events, in
the order the openai SDK's stream reader expects, each with its ``sequence_number``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ruvllm_server.generation.sse import named_event, sse_objects
from ruvllm_server.responses.translate import ResponseShell, new_id, responses_param
from ruvllm_server.responses.wire import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    ItemStatus,
    MessageItem,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseEvent,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseObject,
    ResponseStatus,
    StreamError,
)
from ruvllm_server.schemas import ChatCompletionChunk, ToolCallDelta, Usage


def encode_event(event: ResponseEvent) -> bytes:
    """One SSE event: its ``event:`` line names the type, as OpenAI's stream does."""
    return named_event(event)


@dataclass
class _Open:
    """The output item being written: its index in ``output`` and the text so far."""

    index: int
    item: OutputItem
    text: list[str] = field(default_factory=list)


@dataclass
class ResponseEvents:
    """Turns one response's chat chunks into events; ``output`` holds the finished items in order."""

    shell: ResponseShell
    seq: int = 0
    output: list[OutputItem] = field(default_factory=list)
    current: _Open | None = None
    calls: dict[int, _Open] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: Usage | None = None

    def _next(self, cls: type[ResponseEvent], **fields: Any) -> bytes:
        event = cls(sequence_number=self.seq, **fields)
        self.seq += 1
        return encode_event(event)

    def start(self) -> list[bytes]:
        shell = self.shell.build("in_progress")
        return [self._next(ResponseCreated, response=shell), self._next(ResponseInProgress, response=shell)]

    # --- items ------------------------------------------------------------------------------------

    def _open(self, item: OutputItem) -> list[bytes]:
        self.current = _Open(len(self.output), item)
        self.output.append(item)  # replaced by the finished item on close
        out = [self._next(OutputItemAdded, output_index=self.current.index, item=item)]
        if isinstance(item, MessageItem):
            part: OutputText | ReasoningText = OutputText("")
        elif isinstance(item, ReasoningItem):
            part = ReasoningText("")
        else:
            return out
        out.append(
            self._next(ContentPartAdded, item_id=item.id, output_index=self.current.index, content_index=0, part=part)
        )
        return out

    def _close(self) -> list[bytes]:
        cur, self.current = self.current, None
        if cur is None:
            return []
        text = "".join(cur.text)
        item = cur.item
        where = {"item_id": item.id, "output_index": cur.index}
        out = []
        if isinstance(item, MessageItem):
            status: ItemStatus = "incomplete" if self.finish_reason == "length" else "completed"
            done: OutputItem = MessageItem(item.id, [OutputText(text)], status)
            out.append(self._next(OutputTextDone, content_index=0, text=text, **where))
            out.append(self._next(ContentPartDone, content_index=0, part=OutputText(text), **where))
        elif isinstance(item, ReasoningItem):
            done = ReasoningItem(item.id, [ReasoningText(text)])
            out.append(self._next(ReasoningTextDone, content_index=0, text=text, **where))
            out.append(self._next(ContentPartDone, content_index=0, part=ReasoningText(text), **where))
        else:
            assert isinstance(item, FunctionCallItem)
            done = FunctionCallItem(item.id, item.call_id, item.name, text)
            out.append(self._next(FunctionCallArgumentsDone, name=item.name, arguments=text, **where))
        self.output[cur.index] = done
        out.append(self._next(OutputItemDone, output_index=cur.index, item=done))
        return out

    def _write(self, kind: type[OutputItem], piece: str) -> list[bytes]:
        out = []
        if self.current is None or not isinstance(self.current.item, kind):
            out += self._close()
            if kind is MessageItem:
                out += self._open(MessageItem(new_id("msg"), [], "in_progress"))
            else:
                out += self._open(ReasoningItem(new_id("rs"), [], status="in_progress"))
        assert self.current is not None
        self.current.text.append(piece)
        where = {"item_id": self.current.item.id, "output_index": self.current.index, "content_index": 0}
        delta = OutputTextDelta if kind is MessageItem else ReasoningTextDelta
        out.append(self._next(delta, delta=piece, **where))
        return out

    def _call(self, tc: ToolCallDelta) -> list[bytes]:
        out = []
        cur = self.calls.get(tc.index)
        if cur is None:
            out += self._close()
            call_id = tc.id or new_id("call")
            out += self._open(FunctionCallItem(new_id("fc"), call_id, tc.function.name or "", "", "in_progress"))
            assert self.current is not None
            cur = self.calls[tc.index] = self.current
        elif cur is not self.current:
            return out  # a finished call does not take more arguments
        if tc.function.arguments:
            cur.text.append(tc.function.arguments)
            item = cur.item
            out.append(
                self._next(
                    FunctionCallArgumentsDelta, item_id=item.id, output_index=cur.index, delta=tc.function.arguments
                )
            )
        return out

    # --- chunks -----------------------------------------------------------------------------------

    def chunk(self, chunk: ChatCompletionChunk) -> list[bytes]:
        if chunk.usage is not None:
            self.usage = chunk.usage
        out: list[bytes] = []
        for choice in chunk.choices:
            d = choice.delta
            if d.reasoning_content:
                out += self._write(ReasoningItem, d.reasoning_content)
            if d.content:
                out += self._write(MessageItem, d.content)
            for tc in d.tool_calls or ():
                out += self._call(tc)
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
        return out

    def finish(self) -> tuple[list[bytes], ResponseObject]:
        """The closing events and the finished response (an empty message when nothing was said, as
        the non-streamed response has)."""
        out = self._close()
        if not any(isinstance(i, (MessageItem, FunctionCallItem)) for i in self.output):
            out += self._open(MessageItem(new_id("msg"), [], "in_progress"))
            out += self._close()
        status: ResponseStatus = "incomplete" if self.finish_reason == "length" else "completed"
        response = self.shell.build(status, list(self.output), self.usage)
        final = ResponseIncomplete if status == "incomplete" else ResponseCompleted
        out.append(self._next(final, response=response))
        return out, response

    def error(self, body: dict[str, Any]) -> bytes:
        err = body.get("error") or {}
        param = responses_param(err.get("param"))
        return self._next(StreamError, message=str(err.get("message", "error")), code=err.get("code"), param=param)


async def response_events(
    chat_stream: AsyncIterator[bytes], events: ResponseEvents
) -> AsyncIterator[tuple[bytes, ResponseObject | None]]:
    """``(event bytes, the finished response or None)`` for each event, read from the chat path's
    SSE stream (its chunks decoded again: the chat path stays the one place that streams a run).
    One piece of that stream may hold several events (outputs that arrived together)."""
    for b in events.start():
        yield b, None
    async for piece in chat_stream:
        for obj in sse_objects(piece):
            if "error" in obj:
                yield events.error(obj), None
                return
            for b in events.chunk(msgspec.convert(obj, ChatCompletionChunk)):
                yield b, None
    closing, response = events.finish()
    for b in closing[:-1]:
        yield b, None
    yield closing[-1], response


__all__ = ["ResponseEvents", "encode_event", "response_events"]
