"""What a route reads from and leaves on a request beyond its body: the authenticated user, and the
streams the guard closes after the response."""

from __future__ import annotations

from collections.abc import AsyncIterator

from litestar import Request


def request_user(request: Request) -> str | None:
    """The user the API-key middleware recognised, or None."""
    return request.scope["state"].get("ruvllm_user")


def track_stream(request: Request, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``stream``, registered so the guard closes it after the response: a client that went away
    while the stream was between chunks still has its engine request aborted right away (not at
    garbage collection)."""
    request.scope["state"].setdefault("ruvllm_streams", []).append(stream)
    return stream
