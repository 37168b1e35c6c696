"""Replicas of the server on Ray Serve (``pip install 'ruvllm-server[ray]'``).

``serve run ruvllm_server.ray:build_app model=smollm2 replicas=2`` (or ``serve.run(build_app({...}))``)
deploys two deployments behind Ray's HTTP proxy:

* ``RuvllmEngine``: N replicas, each one whole ruvllm server (model, engine, every route) run in the
  replica's process. A request reaches it as a :class:`ProxiedRequest` and its answer streams back
  through the deployment handle (status and headers first, then the body as it is produced), so
  streaming chat and completions stream through Ray as they do from ``ruvllm serve``.
* ``RuvllmIngress``: what Ray's proxy calls. It reads the body, names the request's prompt text for
  the router, and calls the engine deployment through its handle, where Ray's request router picks
  the replica.

Routers (``router=``):

* ``prefix`` (default): Ray Serve's own ``PrefixCacheAffinityRouter``. Requests whose prompts share a
  prefix go to the replica that served that prefix (whose prefix cache holds it); a prompt that
  matches nothing goes to the replica holding the least text; when queue lengths differ by more than
  ``imbalanced_threshold`` (default 8 requests) it takes the less loaded of two (power of two).
* ``round_robin``: replicas in turn, whatever the prompt (the comparison point).
* ``pow2``: Ray's default (the less loaded of two random replicas).

Every other ``key=value`` is a server setting (the names of ``ruvllm serve``'s flags with
underscores, as in the TOML file); ``min_replicas``/``max_replicas`` turn on Ray's autoscaling
between those bounds. A replica whose engine broke fails Ray's health check and is replaced; a
request whose replica died answers 503 (or, mid-stream, an error event) in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog

try:
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig
    from ray.serve.handle import DeploymentHandle
    from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("ruvllm_server.ray needs Ray Serve: pip install 'ruvllm-server[ray]'") from exc

from ruvllm_server.schemas import ErrorBody, ErrorResponse, encode_json

log = structlog.get_logger("ruvllm.server.ray")

ROUTERS = ("prefix", "round_robin", "pow2")
#: The response header naming the replica (``<replica id>@<host>:<pid>``) that answered.
REPLICA_HEADER = "x-ruvllm-replica"


@dataclass
class ProxiedRequest:
    """One HTTP request, as the ingress hands it to an engine replica. ``prompt`` is the text the
    router matches: the completion prompt, the chat messages' contents, or the method and path."""

    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    prompt: str
    client: tuple[str, int] | None = None


@dataclass
class ResponseStart:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)


def routing_text(method: str, path: str, body: bytes) -> str:
    """The text a request's replica is chosen by: what its prompt renders from (a completion's
    ``prompt``, a chat's message contents in order), else ``METHOD path``."""
    text = ""
    if method == "POST" and body:
        try:
            payload = msgspec.json.decode(body)
        except msgspec.DecodeError:
            payload = None
        if isinstance(payload, dict):
            if isinstance(payload.get("messages"), list):
                text = "".join(_text_of(m.get("content") if isinstance(m, dict) else m) for m in payload["messages"])
            elif "prompt" in payload:
                text = _text_of(payload["prompt"])
    return text or f"{method} {path}"


def _text_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text_of(v) for v in value)
    if isinstance(value, dict):
        return value["text"] if isinstance(value.get("text"), str) else _text_of(value.get("content"))
    return ""


def prefix_router() -> type[RequestRouter]:
    """Ray Serve LLM's ``PrefixCacheAffinityRouter``, used as it is. Its public module
    (``ray.serve.llm``) imports ``ray[llm]``'s dependencies (pyarrow and more), which serving ruvllm
    does not need; without them the class comes from the module that defines it."""
    try:
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter
    except ImportError:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
            PrefixCacheAffinityRouter,
        )
    return PrefixCacheAffinityRouter


class RoundRobinRouter(RequestRouter):
    """Replicas in turn (ordered by id), whatever the request: the baseline the prefix router is
    measured against."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._turn = itertools.count()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        return [[ordered[next(self._turn) % len(ordered)]]]


# --- the engine replica ------------------------------------------------------------------------


class _Lifespan:
    """Runs an ASGI app's lifespan (startup now, shutdown later) as a server would."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state: dict[str, Any] = {}
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._stopped: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task[None] | None = None

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.3"}, "state": self.state}
        self._task = asyncio.create_task(self.app(scope, self._inbox.get, self._send))
        await self._inbox.put({"type": "lifespan.startup"})
        await self._started

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._stopped

    async def _send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.complete":
            self._started.set_result(None)
        elif kind == "lifespan.startup.failed":
            self._started.set_exception(RuntimeError(message.get("message") or "the server failed to start"))
        elif kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            self._stopped.set_result(None)


class RuvllmEngineReplica:
    """One ruvllm server inside a Ray Serve replica (see the module's docstring)."""

    async def __init__(self, settings: Mapping[str, Any]) -> None:
        from ruvllm_server.app import create_app
        from ruvllm_server.settings import load_settings
        from ruvllm_server.state import load_model

        self.settings = load_settings(dict(settings))
        model = await asyncio.to_thread(load_model, self.settings)
        self.app = create_app(self.settings, model)
        self.lifespan = _Lifespan(self.app)
        await self.lifespan.startup()  # the engine starts and its step shapes compile before traffic
        try:
            replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside a replica (a test calling the class directly)
            replica = "local"
        self.replica = f"{replica}@{socket.gethostname()}:{os.getpid()}"
        log.info("replica ready", replica=self.replica, model=self.settings.model_name)

    def check_health(self) -> None:
        """Ray's health check: a broken engine fails it, so Ray replaces the replica."""
        state = self.app.server
        if state.broken or state.load_error:
            raise RuntimeError(state.not_ready_reason)

    async def __call__(self, request: ProxiedRequest) -> AsyncIterator[ResponseStart | bytes]:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode(),
            "query_string": request.query.encode(),
            "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
            "client": request.client,
            "server": ("ray-serve", 0),
            "state": dict(self.lifespan.state),
        }
        sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def run() -> None:
            try:
                await self.app(scope, receive, sent.put)
            finally:
                await sent.put(None)

        task = asyncio.create_task(run())
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", ())]
                    yield ResponseStart(message["status"], [*headers, (REPLICA_HEADER, self.replica)])
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        break
            # The answer is complete: a streaming response still listens for the client's disconnect
            # (as it would on a socket that stays open), so say the exchange is over, then let it end.
            disconnected.set()
            await task  # re-raises what the app raised before answering
        finally:
            disconnected.set()  # the caller went away: the app sees a disconnect and stops generating
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def __del__(self) -> None:
        await self.lifespan.shutdown()


# --- the ingress -------------------------------------------------------------------------------


def _error_json(status: int, message: str, code: str) -> tuple[int, bytes]:
    kind = "service_unavailable" if status == 503 else "server_error"
    return status, encode_json(ErrorResponse(ErrorBody(message, kind, code=code)))


class RuvllmIngress:
    """Ray's proxy calls this; it hands the request to an engine replica chosen by the router."""

    def __init__(self, engine: DeploymentHandle) -> None:
        self.engine = engine.options(stream=True)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response, StreamingResponse

        body = await request.body()
        proxied = ProxiedRequest(
            method=request.method,
            path=request.url.path,
            query=request.url.query,
            headers=list(request.headers.items()),
            body=body,
            prompt=routing_text(request.method, request.url.path, body),
            client=(request.client.host, request.client.port) if request.client else None,
        )
        stream = self.engine.remote(proxied)
        try:
            start = await stream.__anext__()
        except Exception as exc:  # the replica died or refused before answering
            log.warning("replica failed before answering", error=f"{type(exc).__name__}: {exc}")
            status, payload = _error_json(503, "the replica serving this request failed; retry", "replica_failed")
            return Response(payload, status_code=status, media_type="application/json")
        headers = {k: v for k, v in start.headers if k.lower() not in ("content-length", "transfer-encoding")}
        if not headers.get("content-type", "").startswith("text/event-stream"):
            # A whole answer: read it all, so a replica that dies before finishing it is a clean 503.
            try:
                payload = b"".join([chunk async for chunk in stream])
            except Exception as exc:
                log.warning("replica failed mid-answer", error=f"{type(exc).__name__}: {exc}")
                status, payload = _error_json(503, "the replica serving this request failed; retry", "replica_failed")
                return Response(payload, status_code=status, media_type="application/json")
            return Response(payload, status_code=start.status, headers=headers)

        async def rest() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as exc:  # the replica died mid-stream: an error event in OpenAI's shape
                log.warning("replica failed mid-stream", error=f"{type(exc).__name__}: {exc}")
                _, payload = _error_json(503, "the replica serving this request failed", "replica_failed")
                yield b"data: " + payload + b"\n\n"

        return StreamingResponse(rest(), status_code=start.status, headers=headers)


# --- the application ---------------------------------------------------------------------------


@dataclass
class DeploymentPlan:
    """What :func:`build_app` deploys: the engine and ingress deployments' Ray Serve options and the
    server settings every engine replica starts with."""

    engine: dict[str, Any]
    ingress: dict[str, Any]
    settings: dict[str, Any]


def plan_deployment(args: Mapping[str, Any]) -> DeploymentPlan:
    """Check ``args`` (see :func:`build_app`) and turn them into deployment options; a bad value is a
    one-line :class:`~ruvllm_server.settings.ServerConfigError`, before anything is deployed."""
    from ruvllm_server.settings import ServerConfigError, load_settings

    args = dict(args)
    router = str(args.pop("router", "prefix"))
    if router not in ROUTERS:
        raise ServerConfigError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    try:
        replicas = int(args.pop("replicas", 1))
        ingress_replicas = int(args.pop("ingress_replicas", 1))
        bounds = args.pop("min_replicas", None), args.pop("max_replicas", None)
        lo, hi = (int(v) if v is not None else None for v in bounds)
        threshold = float(args.pop("imbalanced_threshold", 8))
    except ValueError as exc:
        raise ServerConfigError(f"replica counts and imbalanced_threshold must be numbers: {exc}") from None
    settings = load_settings(args)  # unknown or invalid server settings fail here, in one line
    if replicas < 1 or ingress_replicas < 1:
        raise ServerConfigError("replicas and ingress_replicas must be at least 1")

    # Ray's default of 5 ongoing requests per replica would cap a replica's batch: each replica takes
    # what its own server admits and queues (max_concurrent + max_queue); the ingress only forwards.
    admits = settings.max_concurrent + settings.max_queue
    engine: dict[str, Any] = {
        "name": "RuvllmEngine",
        "max_ongoing_requests": admits,
        "health_check_period_s": 5,
        "health_check_timeout_s": 30,
    }
    if lo is not None or hi is not None:
        lo, hi = lo if lo is not None else 1, hi if hi is not None else max(replicas, lo or 1)
        if not 1 <= lo <= hi:
            raise ServerConfigError(f"autoscaling needs 1 <= min_replicas <= max_replicas, got {lo} and {hi}")
        engine["autoscaling_config"] = AutoscalingConfig(min_replicas=lo, max_replicas=hi)
    else:
        engine["num_replicas"] = replicas
    if router == "prefix":
        engine["request_router_config"] = RequestRouterConfig(
            request_router_class=prefix_router(), request_router_kwargs={"imbalanced_threshold": threshold}
        )
    elif router == "round_robin":
        engine["request_router_config"] = RequestRouterConfig(request_router_class=RoundRobinRouter)
    ingress = {
        "name": "RuvllmIngress",
        "num_replicas": ingress_replicas,
        "max_ongoing_requests": admits * max(replicas, hi or 0),
        "ray_actor_options": {"num_cpus": 0},
    }
    return DeploymentPlan(engine, ingress, args)


def build_app(args: Mapping[str, Any]) -> Any:
    """The Ray Serve application (``serve run ruvllm_server.ray:build_app model=smollm2 replicas=2``).

    ``args``: ``replicas`` (default 1), or ``min_replicas`` and ``max_replicas`` for Ray's autoscaling
    between those bounds; ``router`` (prefix, round_robin or pow2); ``imbalanced_threshold`` (prefix
    router, default 8); ``ingress_replicas`` (default 1); and any server setting by its TOML name.
    """
    plan = plan_deployment(args)
    engine = serve.deployment(RuvllmEngineReplica).options(**plan.engine).bind(plan.settings)
    return serve.deployment(RuvllmIngress).options(**plan.ingress).bind(engine)
