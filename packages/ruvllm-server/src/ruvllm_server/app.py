"""The Litestar app: thin handlers over :mod:`ruvllm_server.generation`, middleware, error mapping.

``create_app(settings, model=None)`` builds an app (loading ``settings.model`` in the background at
startup when no loaded model is given); ``app_factory()`` builds one from the environment for
``uvicorn --factory ruvllm_server.app:app_factory``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anyio
from litestar import Litestar, Request, Response, get, post
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.middleware import DefineMiddleware
from litestar.openapi import OpenAPIConfig
from litestar.params import Body, Parameter
from litestar.response import Stream
from litestar.types import Receive, Scope, Send
from prometheus_client import CONTENT_TYPE_LATEST

from ruvllm.plugins import load_plugins
from ruvllm_server import __version__, pooling
from ruvllm_server.anthropic.routes import ANTHROPIC_ROUTES
from ruvllm_server.embedding_api import openai_embeddings
from ruvllm_server.errors import APIError, bad_request, handle_exception, model_not_found
from ruvllm_server.generation import (
    ChatJob,
    CompletionJob,
    cancel_on_disconnect,
    check_model,
    encode_chat,
)
from ruvllm_server.generation.sse import SSE_HEADERS
from ruvllm_server.hookspecs import RouteContext, server_hooks
from ruvllm_server.middleware import RequestContextMiddleware, guard_middleware
from ruvllm_server.ollama.routes import OLLAMA_ROUTES
from ruvllm_server.pool import Entry, ModelPool
from ruvllm_server.pool_config import model_specs, pooled
from ruvllm_server.request_context import CURRENT_MODEL, request_user, served_state, track_stream
from ruvllm_server.responses import RESPONSES_ROUTES
from ruvllm_server.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingList,
    EmbeddingRequest,
    Health,
    LoadLoraAdapterRequest,
    LoraAdapterStatus,
    ModelCard,
    ModelList,
    ModelLoadRequest,
    ModelLoadStatus,
    PooledModelCard,
    Readiness,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    UnloadLoraAdapterRequest,
)
from ruvllm_server.settings import ServerConfigError, ServerSettings, load_settings
from ruvllm_server.state import ServerState, check_plugin_options

#: Named here as well as by the media type: with a union return annotation Litestar would otherwise
#: send the handler's default (application/json), and SSE clients that check it (httpx-sse) refuse it.


def _state(request: Request) -> ServerState:
    return served_state(request)


_user = request_user
_track_stream = track_stream


# --- generation -------------------------------------------------------------------------------


@post("/v1/chat/completions", status_code=200, summary="Create a chat completion", tags=["openai"])
async def chat_completions(
    request: Request, data: Annotated[ChatCompletionRequest, Body()]
) -> ChatCompletion | Stream | Response[bytes]:
    job = ChatJob(_state(request), data, _user(request))
    run = job.prepare()
    if data.stream:
        await run.compile_constraint()  # a bad schema is a 400, not an error chunk in the stream
        return Stream(_track_stream(request, job.stream(run)), media_type="text/event-stream", headers=SSE_HEADERS)
    result = await cancel_on_disconnect(request.receive, lambda: job.complete(run))
    return result if result is not None else Response(b"", status_code=499)


@post("/v1/completions", status_code=200, summary="Create a completion", tags=["openai"])
async def completions(
    request: Request, data: Annotated[CompletionRequest, Body()]
) -> Completion | Stream | Response[bytes]:
    job = CompletionJob(_state(request), data, _user(request))
    run = job.prepare()
    if data.stream:
        await run.compile_constraint()  # a bad schema is a 400, not an error chunk in the stream
        return Stream(_track_stream(request, job.stream(run)), media_type="text/event-stream", headers=SSE_HEADERS)
    result = await cancel_on_disconnect(request.receive, lambda: job.complete(run))
    return result if result is not None else Response(b"", status_code=499)


@post("/v1/embeddings", status_code=200, summary="Embeddings: mean-pooled final hidden states", tags=["openai"])
async def embeddings(request: Request, data: Annotated[EmbeddingRequest, Body()]) -> EmbeddingList:
    return await openai_embeddings(request, data)


# --- models, tokenizer ------------------------------------------------------------------------


def _card(state: ServerState) -> ModelCard:
    return ModelCard(state.model_name, state.started, max_model_len=state.max_context)


def _adapter_cards(state: ServerState) -> list[ModelCard]:
    return [
        ModelCard(name, state.started, max_model_len=state.max_context, parent=state.model_name, root=a.source)
        for name, a in state.adapters.items()
    ]


def _pool_cards(pool: ModelPool, entry: Entry) -> list[ModelCard]:
    state = entry.state if entry.status == "loaded" else None
    spec = entry.spec
    card = PooledModelCard(
        spec.name, state.started if state is not None else pool.started,
        max_model_len=state.max_context if state is not None else None,
        status=entry.status, error=entry.error, aliases=list(spec.aliases),
    )  # fmt: skip
    return [card, *(_adapter_cards(state) if state is not None else [])]


@get("/v1/models", summary="List models (the base model and its LoRA adapters)", tags=["openai"])
async def list_models(request: Request) -> ModelList:
    state = _state(request)
    if isinstance(state, ModelPool):
        return ModelList([card for entry in state.entries.values() for card in _pool_cards(state, entry)])
    return ModelList([_card(state), *_adapter_cards(state)])


@get("/v1/models/{model_id:path}", summary="Retrieve a model", tags=["openai"])
async def retrieve_model(request: Request, model_id: Annotated[str, Parameter()]) -> ModelCard:
    state = _state(request)
    model_id = model_id.lstrip("/")
    if isinstance(state, ModelPool):  # a name, an alias or an adapter of one of the models
        cards = _pool_cards(state, state.resolve(model_id))
        return next((card for card in cards if card.id == model_id), cards[0])
    if model_id != state.model_name:
        for card in _adapter_cards(state):
            if card.id == model_id:
                return card
        raise model_not_found(model_id)
    return _card(state)


@post("/v1/load_lora_adapter", status_code=200, summary="Load a PEFT LoRA adapter or X-LoRA model", tags=["adapters"])
async def load_lora_adapter(request: Request, data: Annotated[LoadLoraAdapterRequest, Body()]) -> LoraAdapterStatus:
    from ruvllm.adapters import load_adapter
    from ruvllm.errors import RuvllmError

    state = _state(request)
    if data.lora_name == state.model_name or data.lora_name in state.adapters:
        raise bad_request(f"the name {data.lora_name!r} is already taken", param="lora_name")
    assert state.model is not None
    try:
        adapter = await anyio.to_thread.run_sync(
            lambda: load_adapter(
                data.lora_path, data.lora_name, state.model.config, max_rank=state.settings.max_lora_rank
            )
        )
    except RuvllmError as exc:
        raise bad_request(str(exc), param="lora_path") from None
    state.adapters[data.lora_name] = adapter  # the next request that names it runs it
    return LoraAdapterStatus(data.lora_name, "loaded")


@post("/v1/unload_lora_adapter", status_code=200, summary="Unload a LoRA adapter", tags=["adapters"])
async def unload_lora_adapter(request: Request, data: Annotated[UnloadLoraAdapterRequest, Body()]) -> LoraAdapterStatus:
    state = _state(request)
    if state.adapters.pop(data.lora_name, None) is None:
        raise APIError(404, f"no adapter named {data.lora_name!r} is loaded", param="lora_name", code="not_found")
    # Requests already running keep their reference to it and finish on it.
    return LoraAdapterStatus(data.lora_name, "unloaded")


@post("/tokenize", status_code=200, summary="Token ids of a prompt or chat", tags=["tokenizer"])
async def tokenize(request: Request, data: Annotated[TokenizeRequest, Body()]) -> TokenizeResponse:
    state = _state(request)
    check_model(state, data.model)
    if (data.prompt is None) == (data.messages is None):
        raise bad_request("give exactly one of prompt and messages")
    if data.messages is not None:
        ids = encode_chat(state, data.messages, data.add_generation_prompt)
    else:
        ids = state.tokenizer.encode(data.prompt or "", add_special_tokens=data.add_special_tokens)
    return TokenizeResponse(len(ids), state.max_context, ids)


@post("/detokenize", status_code=200, summary="Text of token ids", tags=["tokenizer"])
async def detokenize(request: Request, data: Annotated[DetokenizeRequest, Body()]) -> DetokenizeResponse:
    state = _state(request)
    check_model(state, data.model)
    vocab = state.tokenizer.vocab_size
    bad = [t for t in data.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token ids {bad[:8]} are outside the vocabulary (0..{vocab - 1})", param="tokens")
    return DetokenizeResponse(state.tokenizer.decode(data.tokens))


@get("/tokenizer_info", summary="The tokenizer's configuration (special tokens, chat template)", tags=["tokenizer"])
async def tokenizer_info(request: Request) -> TokenizerInfo:
    state = _state(request)
    tok = state.tokenizer

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tok.id_to_token(token_id)

    inner = tok.inner
    padding = inner.padding or {}
    unk = getattr(inner.model, "unk_token", None)
    eos = tok.eos_token_ids
    return TokenizerInfo(
        # Every ruvllm tokenizer is a `tokenizers` fast tokenizer, which transformers loads as this class.
        tokenizer_class="PreTrainedTokenizerFast",
        model_max_length=state.max_context,
        bos_token=text(tok.bos_token_id),
        eos_token=text(eos[0] if eos else None),
        pad_token=padding.get("pad_token"),
        unk_token=unk if isinstance(unk, str) and inner.token_to_id(unk) is not None else None,
        add_bos_token=bool(tok.bos_token_id is not None and tok.encode("a")[:1] == [tok.bos_token_id]),
        chat_template=tok.chat_template,
    )


# --- several models ---------------------------------------------------------------------------


@post("/models/load", status_code=200, summary="Load a model now (several models)", tags=["models"])
async def load_model_now(request: Request, data: Annotated[ModelLoadRequest, Body()]) -> ModelLoadStatus:
    pool = request.app.state["ruvllm"]
    entry = pool.resolve(data.model)
    await pool.release(entry, await pool.acquire(entry))
    return ModelLoadStatus(entry.spec.name, entry.status)


@post("/models/unload", status_code=200, summary="Unload an idle model (several models)", tags=["models"])
async def unload_model_now(request: Request, data: Annotated[ModelLoadRequest, Body()]) -> ModelLoadStatus:
    pool = request.app.state["ruvllm"]
    entry = pool.resolve(data.model)
    if entry.users:
        raise APIError(409, f"the model {entry.spec.name!r} is serving {entry.users} requests", code="model_busy")
    await pool.unload(entry, "asked")
    return ModelLoadStatus(entry.spec.name, entry.status)


# --- operations -------------------------------------------------------------------------------


@get("/health", summary="Liveness (503 with the reason once the engine has stopped working)", tags=["operations"])
async def health(request: Request) -> Response[Health]:
    state = _state(request)
    figures = state.health_report()
    if state.broken:
        return Response(Health("failed", **figures, detail=state.broken), status_code=503)
    return Response(Health("ok", **figures))


@get("/ready", summary="Readiness: the model is loaded and the engine runs", tags=["operations"])
async def ready(request: Request) -> Response[Readiness]:
    state = _state(request)
    if state.ready and not state.broken:
        return Response(Readiness("ready", state.model_name))
    status = "draining" if state.draining else ("failed" if state.load_error or state.broken else "loading")
    return Response(Readiness(status, state.model_name, state.not_ready_reason), status_code=503)


@get("/metrics", summary="Prometheus metrics", tags=["operations"], include_in_schema=False)
async def metrics(request: Request) -> Response[bytes]:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


# --- the app ----------------------------------------------------------------------------------


class RuvllmApp(Litestar):
    """A Litestar app whose every HTTP request (404s and CORS preflights too) passes the request
    context middleware."""

    def __init__(self, server: ServerState, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.server = server
        self._outer = RequestContextMiddleware(super().__call__, server)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._outer(scope, receive, send)


def _current_model(state: ServerState | ModelPool) -> Any:
    """The loaded model a plugin route runs on: the request's (several models), else the one."""
    if isinstance(state, ModelPool):
        picked = CURRENT_MODEL.get()
        return picked.model if picked is not None else None
    return state.model


def _closing_streams(app: Any) -> Any:
    async def close_streams_after(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await app(scope, receive, send)
        finally:
            for stream in scope["state"].pop("ruvllm_streams", ()):
                with anyio.CancelScope(shield=True):
                    await stream.aclose()

    return close_streams_after


def create_app(settings: ServerSettings, model: Any = None, *, start_in_background: bool = False) -> Litestar:
    """The ASGI app for ``settings``; ``model`` is an already loaded ``LoadedModel`` or None (then it
    loads in the background). ``start_in_background``: a given model's engine also starts (and its
    step shapes compile) after the server listens, /ready saying how far it got meanwhile."""
    state: ServerState | ModelPool
    if pooled(settings):
        if model is not None:
            raise ServerConfigError("a server of several models loads them itself: give no loaded model")
        state = ModelPool(settings, model_specs(settings))
    else:
        state = ServerState(settings, model, start_in_background=start_in_background)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    cors = None
    if settings.cors_origins:
        cors = CORSConfig(
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID", "X-Api-Key", "Anthropic-Version"],
            expose_headers=["X-Request-ID", "Retry-After"],
            max_age=600,
        )
    handlers: list[Any] = [
        chat_completions,
        completions,
        *RESPONSES_ROUTES,
        *ANTHROPIC_ROUTES,
        *OLLAMA_ROUTES,
        embeddings,
        *pooling.POOLING_ROUTES,
        list_models,
        retrieve_model,
        tokenize,
        detokenize,
        tokenizer_info,
        health,
        ready,
        metrics,
    ]
    if settings.enable_lora_runtime_updates:
        handlers += [load_lora_adapter, unload_lora_adapter]
    if isinstance(state, ModelPool):
        handlers += [load_model_now, unload_model_now]
    # Routes plugins add (SONA's feedback and stats when its options enable it).
    host = getattr(model, "host", None) or load_plugins()  # (an embedding model carries none)
    options = settings.effective_plugin_options
    check_plugin_options(host, options)
    context = RouteContext(options, _user, model=lambda: _current_model(state))
    server_hooks(host).register_routes(register=handlers.append, context=context)
    return RuvllmApp(
        state,
        route_handlers=handlers,
        middleware=[DefineMiddleware(guard_middleware, state=state), _closing_streams],
        exception_handlers={Exception: handle_exception},
        cors_config=cors,
        lifespan=[lifespan],
        state=State({"ruvllm": state}),
        request_max_body_size=settings.max_body_bytes,
        openapi_config=OpenAPIConfig(title="ruvllm", version=__version__, path="/schema"),
        debug=False,
    )


def app_factory() -> Litestar:
    """``uvicorn --factory ruvllm_server.app:app_factory``: settings from ``RUVLLM_*`` (and the TOML
    file ``RUVLLM_CONFIG`` names); the model loads in the background after startup."""
    from ruvllm.log_setup import configure_logging

    settings = load_settings(config_file=os.environ.get("RUVLLM_CONFIG") or None)
    # A server logs its access lines at INFO unless RUVLLM_LOG says otherwise.
    os.environ.setdefault("RUVLLM_LOG", "INFO")
    configure_logging(json=settings.log_json)
    return create_app(settings)
