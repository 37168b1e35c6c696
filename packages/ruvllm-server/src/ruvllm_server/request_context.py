"""What a route reads from and leaves on a request beyond its body: the authenticated user, and the
streams the guard closes after the response."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from litestar import Request

if TYPE_CHECKING:
    from ruvllm_server.state import ServerState


def request_user(request: Request) -> str | None:
    """The user the API-key middleware recognised, or None."""
    return request.scope["state"].get("ruvllm_user")


def track_stream(request: Request, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``stream``, registered so the guard closes it after the response: a client that went away
    while the stream was between chunks still has its engine request aborted right away (not at
    garbage collection)."""
    request.scope["state"].setdefault("ruvllm_streams", []).append(stream)
    return stream


#: The state of the model the guard picked for the request being served (several models), for what
#: runs without the request at hand (plugin routes' ``RouteContext.model``).
CURRENT_MODEL: ContextVar[ServerState | None] = ContextVar("ruvllm_current_model", default=None)


def served_state(request: Request[Any, Any, Any]) -> ServerState:
    """The state of the model the request runs on: the one the guard picked when the server holds
    several (:mod:`ruvllm_server.pool`), else the server's one."""
    picked = request.scope["state"].get("ruvllm_model")
    return picked if picked is not None else request.app.state["ruvllm"]
