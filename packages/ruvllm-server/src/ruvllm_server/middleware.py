"""ASGI middleware of the server.

``RequestContextMiddleware`` wraps the whole app (so it also sees 404s and CORS preflights): request
id, the structured access log and the HTTP request counter. ``guard_middleware`` runs on matched
routes inside Litestar, so the errors it raises get the OpenAI shape and CORS headers: API key,
per-key rate limit, readiness and admission control.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from ruvllm.errors import RuvllmError
from ruvllm_server.errors import APIError
from ruvllm_server.limits import Overloaded
from ruvllm_server.request_context import CURRENT_MODEL

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Message, Receive, Scope, Send

    from ruvllm_server.pool import ModelPool
    from ruvllm_server.state import ServerState

access_log = structlog.get_logger("ruvllm.server.access")

#: Probes stay open with authentication on.
OPEN_PATHS = frozenset({"/health", "/ready"})
#: POST routes that take an admission slot.
GENERATION_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/messages"}
    | {"/v1/rerank", "/v1/score", "/rerank", "/score"}
    | {"/api/chat", "/api/generate", "/api/embed"}
)
#: Routes that need the model loaded (Ollama's /api/version answers before).
MODEL_PATH_PREFIXES = (
    "/v1/", "/tokenize", "/detokenize", "/api/chat", "/api/generate", "/api/embed", "/api/tags", "/api/ps", "/api/show"
)  # fmt: skip

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class RequestContextMiddleware:
    """Request id (``X-Request-ID`` echoed, or a new one), bound into every log line of the request;
    one access-log line and one counter sample per request."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        request_id = given if given and _REQUEST_ID_RE.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status = 0
        sent = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        start = time.perf_counter()
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                # Route templates, not raw paths, keep the label set bounded.
                route = scope.get("path_template") or "unmatched"
                method = scope.get("method", "")
                self.state.metrics.http_requests.labels(route, method, str(status or 500)).inc()
                if scope["path"].startswith(("/v1/", "/api/")):
                    self.state.total_requests += 1
                client = scope.get("client")
                access_log.info(
                    "request",
                    method=method,
                    path=scope["path"],
                    status=status or None,
                    ms=round((time.perf_counter() - start) * 1000, 1),
                    bytes=sent,
                    client=client[0] if client else None,
                    user=scope["state"].get("ruvllm_user"),
                )


def key_id(key: str) -> str:
    """A stable, non-secret name of an API key (for logs, rate-limit buckets and ``user``)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _authenticate(scope: Scope, keys: list[str]) -> str:
    header = _header(scope, b"authorization") or ""
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        # Anthropic's clients send the key as x-api-key.
        token = (_header(scope, b"x-api-key") or "").strip()
    if not token:
        raise APIError(
            401,
            "missing API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    # Compare against every key so timing does not reveal which (or whether a prefix) matched.
    found = None
    for key in keys:
        if hmac.compare_digest(token.encode(), key.encode()):
            found = key
    if found is None:
        raise APIError(401, "invalid API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return key_id(found)


#: With several models, the routes that answer about all of them (no model is picked or loaded).
POOL_PATHS = ("/v1/models", "/api/tags", "/api/ps", "/api/version")


class _Picked(msgspec.Struct):
    """What the guard reads of a request body to pick its model (the route reads it whole)."""

    model: str | None = None
    #: Ollama's older name for ``model`` (``/api/show``).
    name: str | None = None
    keep_alive: float | str | None = None
    prompt: str | None = None
    system: str | None = None
    messages: list[Any] | None = None


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(400, "the client closed the request before its body arrived", code="client_closed")
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            raise APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body already read given back first."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def _pick(scope: Scope, receive: Receive, limit: int) -> tuple[Receive, _Picked]:
    """The model a request names: its JSON body's ``model`` (or ``name``), a GET's ``?model=``."""
    if scope.get("method") != "POST":
        from urllib.parse import parse_qs

        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        return receive, _Picked(model=(query.get("model") or [None])[0])
    body = await _read_body(receive, limit)
    try:
        picked = msgspec.json.decode(body, type=_Picked) if body.strip() else _Picked()
    except msgspec.ValidationError as exc:
        raise APIError(400, f"invalid request body: {exc}", param="model", code="invalid_request_error") from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_request_error") from None
    return _replaying(body, receive), picked


def guard_middleware(app: ASGIApp, state: ServerState | ModelPool) -> ASGIApp:
    from ruvllm_server.pool import ModelPool

    settings = state.settings
    pool = state if isinstance(state, ModelPool) else None

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if scope["type"] != "http" or path in OPEN_PATHS:
            await app(scope, receive, send)
            return
        if settings.api_keys:
            identity = _authenticate(scope, settings.api_keys)
            # Only authenticated requests carry it: generation sends it on as the engine request's
            # ``metadata["api_key_id"]`` (SONA's per-key scope) and the feedback route checks it.
            scope["state"]["ruvllm_user"] = identity
        else:
            client = scope.get("client")
            identity = client[0] if client else "anonymous"
        # Scrapes are not client traffic: they need the key but never spend its budget.
        if state.limiter is not None and path != "/metrics":
            wait = state.limiter.acquire(identity)
            if wait > 0:
                raise APIError(
                    429,
                    f"rate limit of {settings.rate_limit:g} requests per second exceeded; retry in {wait:.2f}s",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, math.ceil(wait)))},
                )
        if path.startswith(MODEL_PATH_PREFIXES) and not state.ready:
            raise APIError(503, state.not_ready_reason, code="not_ready", headers={"Retry-After": "5"})
        if pool is not None and path.startswith(MODEL_PATH_PREFIXES) and not path.startswith(POOL_PATHS):
            await _with_model(pool, scope, receive, send)
            return
        await _admitted(state, scope, receive, send)

    async def _with_model(pool: ModelPool, scope: Scope, receive: Receive, send: Send) -> None:
        """Pick the request's model, load it if needed, hold it until the response is sent."""
        from ruvllm_server.pool_config import keep_alive_seconds

        receive, picked = await _pick(scope, receive, settings.max_body_bytes)
        entry = pool.resolve(picked.model or picked.name)
        given = picked.keep_alive is not None
        try:
            keep = keep_alive_seconds(picked.keep_alive)
        except RuvllmError as exc:
            raise APIError(400, str(exc), param="keep_alive", code="invalid_request_error") from None
        empty = not (picked.prompt or picked.system or picked.messages)
        if keep == 0 and empty and scope["path"] in ("/api/generate", "/api/chat"):
            # Ollama's way to unload a model (``ollama stop``): nothing to load first.
            await pool.unload(entry, "keep_alive")
            scope["state"]["ruvllm_unloaded"] = entry.spec.name
            await app(scope, receive, send)
            return
        served = await pool.acquire(entry)
        scope["state"]["ruvllm_model"] = served
        token = CURRENT_MODEL.set(served)
        try:
            await _admitted(served, scope, receive, send)
        finally:
            CURRENT_MODEL.reset(token)
            await pool.release(entry, served, keep, given)

    async def _admitted(served: ServerState | ModelPool, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if served.pooling is not None and path.startswith(MODEL_PATH_PREFIXES) and not path.startswith("/v1/models"):
            from ruvllm_server.pooling import POOLING_PATHS, not_generative

            if path not in POOLING_PATHS:
                raise not_generative(served.pooling.model, path)
        if scope.get("method") == "POST" and path in GENERATION_PATHS:
            try:
                async with state.admission.slot():
                    await app(scope, receive, send)
            except Overloaded:
                raise APIError(
                    503,
                    f"server overloaded: {state.admission.running} running, {state.admission.queued} queued",
                    code="overloaded",
                    headers={"Retry-After": "1"},
                ) from None
            return
        await app(scope, receive, send)

    return guarded
