"""Server-sent events: one ``data:`` event per object, the closing ``[DONE]``, and an error as an
event (once the status line is sent, a failure can only go into the stream)."""

from __future__ import annotations

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
