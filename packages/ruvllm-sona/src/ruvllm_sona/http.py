"""HTTP endpoints for the server to mount: ``POST /v1/feedback`` and ``GET /v1/sona/stats``.

    from ruvllm_sona.http import sona_router
    app = Litestar(route_handlers=[..., sona_router(sona)])

The router is told which learner it serves: a :class:`~ruvllm_sona.sona.Sona`, or a function that
returns the one to serve now (None: 503), which the plugin's ``register_routes`` hook gives it for the
server's model. Without either it serves the only learner attached in this process (503 while there is
none, or several). ``api_key_id`` tells the feedback route who is calling (the server passes the
authenticated key's id), so that under the ``api_key`` scope a key can only rate its own responses.
Errors use OpenAI's error shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from ruvllm_sona import attached
from ruvllm_sona.errors import FeedbackError, SonaError, UnknownResponseError

if TYPE_CHECKING:
    from litestar import Request, Router

    from ruvllm_sona.sona import Sona


class FeedbackBody(msgspec.Struct, forbid_unknown_fields=True):
    #: The ``id`` of a chat completion / completion response (or an engine request id).
    response_id: str
    #: How good the response was, in [0, 1].
    score: float
    #: The completion the model should have given (text), optional.
    correction: str | None = None


class FeedbackResult(msgspec.Struct):
    response_id: str
    scope: str
    #: ``applied`` (the instant step ran) or ``queued`` (it runs after the background recompute).
    status: str
    advantage: float
    adapter_version: int


class _NotAttached(SonaError):
    """No SONA learner is attached in this process."""


def _error(status: int, kind: str, message: str, param: str | None = None) -> Any:
    from litestar import MediaType, Response

    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return Response(msgspec.json.encode(body), status_code=status, media_type=MediaType.JSON)


def sona_router(
    sona: Sona | Callable[[], Sona | None] | None = None,
    *,
    path: str = "/v1",
    api_key_id: Callable[[Request], str | None] | None = None,
) -> Router:
    """A Litestar router with the feedback and stats endpoints under ``path``, serving ``sona`` (a
    learner, or a function returning the one to serve now; None: the only one attached in this
    process). ``api_key_id(request)`` gives the caller's authenticated API key id (None:
    unauthenticated)."""
    from litestar import Router, get, post
    from litestar.params import Body

    from ruvllm_sona.sona import Sona

    def current() -> Sona:
        if isinstance(sona, Sona):
            return sona
        s = sona() if sona is not None else attached.only()
        if s is None:
            if sona is None and attached.count() > 1:
                raise _NotAttached("several models have SONA attached; this router was given none of them")
            raise _NotAttached("SONA is not attached to the served model")
        return s

    @post("/feedback", status_code=200)
    async def feedback(data: Annotated[FeedbackBody, Body()], request: Request) -> FeedbackResult:
        caller = api_key_id(request) if api_key_id is not None else None
        # The instant step is sub-millisecond NumPy; corrections only queue work for the
        # background thread, so this does not need a worker thread of its own.
        r = current().feedback(data.response_id, data.score, data.correction, api_key_id=caller)
        return FeedbackResult(r.response_id, r.scope, r.status, r.advantage, r.adapter_version)

    @get("/sona/stats")
    async def stats() -> dict[str, Any]:
        return current().stats()

    def handle(_: Request, exc: Exception) -> Any:
        if isinstance(exc, _NotAttached):
            return _error(503, "service_unavailable", str(exc))
        if isinstance(exc, UnknownResponseError):
            return _error(404, "not_found_error", str(exc), "response_id")
        if isinstance(exc, FeedbackError):
            return _error(400, "invalid_request_error", str(exc))
        return _error(400, "invalid_request_error", str(exc))

    return Router(path=path, route_handlers=[feedback, stats], exception_handlers={SonaError: handle})
