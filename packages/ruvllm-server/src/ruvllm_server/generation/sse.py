"""Server-sent events: one ``data:`` event per object, the closing ``[DONE]``, and an error as an
event (once the status line is sent, a failure can only go into the stream)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from ruvllm.engine import EngineDeadError
from ruvllm.errors import RequestError
from ruvllm_server.errors import APIError
from ruvllm_server.schemas import ErrorBody, ErrorResponse

log = structlog.get_logger("ruvllm.server")

SSE_DONE = b"data: [DONE]\n\n"
#: Headers of every event-stream response (no proxy buffering, no caching).
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def named_event(event: msgspec.Struct) -> bytes:
    """One SSE event whose ``event:`` line names its type (the Struct's tag), as Anthropic's stream and
    OpenAI's Responses stream send them."""
    kind = type(event).__struct_config__.tag
    return b"event: " + str(kind).encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


def sse_objects(piece: bytes) -> list[Any]:
    """The objects of the ``data:`` events in one piece of the chat path's SSE stream (a piece may
    hold several: outputs that arrived together; ``[DONE]`` is left out). JSON escapes newlines, so
    a blank line ends an event and nothing else. The dialects read the chat path's stream so: it
    stays the one place that streams a run."""
    out = []
    for raw in piece.split(b"\n\n"):
        data = raw.removeprefix(b"data: ").strip()
        if data and data != b"[DONE]":
            out.append(msgspec.json.decode(data))
    return out


#: Stands for the text while a :class:`TextEvent` is built (no other part of the event holds it).
_SLOT = "\x00"
_SLOT_JSON = msgspec.json.encode(_SLOT)


class TextEvent:
    """The event that carries only a piece of text, the one sent for nearly every token, as bytes
    around the text: the event is encoded once with a stand-in text and split there, so a token
    costs one string encode and a join, not a tree of Structs (the bytes are the same)."""

    __slots__ = ("head", "tail")

    def __init__(self, event: Callable[[str], Any]):
        """``event(text)``: the event (a Struct) that carries ``text``."""
        self.head, self.tail = sse(event(_SLOT)).split(_SLOT_JSON)

    def __call__(self, text: str) -> bytes:
        return self.head + msgspec.json.encode(text) + self.tail


def error_event(exc: Exception) -> bytes:
    """The event for a failure mid-stream, shaped as the same error would be as a response."""
    if isinstance(exc, APIError):
        return sse(exc.body)
    if isinstance(exc, RequestError):
        return sse(ErrorResponse(ErrorBody(str(exc), "invalid_request_error", exc.param)))
    if isinstance(exc, EngineDeadError):
        return sse(ErrorResponse(ErrorBody("the server is shutting down", "service_unavailable", code="shutting_down")))
    log.exception("generation failed mid-stream")
    return sse(ErrorResponse(ErrorBody("internal server error (logged)", "server_error", code="internal_error")))
