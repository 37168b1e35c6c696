"""Ollama's handlers. Thin: a request is translated once, run by the chat, completions or
embeddings path, and its answer translated back."""

from __future__ import annotations

import time
from typing import Annotated, Any

import anyio
from litestar import Request, Response, get, post
from litestar.params import Body
from litestar.response import Stream

from ruvllm.engine.types import RequestMetrics
from ruvllm_server import __version__
from ruvllm_server.embedding_api import openai_embeddings
from ruvllm_server.errors import bad_request
from ruvllm_server.generation import ChatJob, CompletionJob, Run, cancel_on_disconnect, completion_prompts
from ruvllm_server.ollama.models import listed, pool_listed, pool_running, running, show
from ruvllm_server.ollama.stream import NDJSON, Parts, ndjson_lines
from ruvllm_server.ollama.translate import (
    Translated,
    chat_request,
    check_keep_alive,
    fit_context,
    generate_request,
    now_iso,
    served_name,
)
from ruvllm_server.ollama.wire import (
    AssistantMessage,
    ChatPart,
    ChatRequest,
    EmbedRequest,
    EmbedResponse,
    GeneratePart,
    GenerateRequest,
    Running,
    ShowRequest,
    ShowResponse,
    Tags,
    Version,
)
from ruvllm_server.pool import ModelPool
from ruvllm_server.request_context import request_user, served_state, track_stream
from ruvllm_server.schemas import ChatCompletionRequest, EmbeddingRequest
from ruvllm_server.state import ServerState

#: Headers of an NDJSON stream (no proxy buffering, no caching).
NDJSON_HEADERS = {"Content-Type": NDJSON, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _state(request: Request) -> ServerState:
    return served_state(request)


def _load_or_unload(request: Request, name: str, keep_alive: float | str | None) -> tuple[str, str]:
    """A request with nothing to answer: the model is loaded (the guard did it, with several models)
    or, with ``keep_alive`` 0 and several models, was unloaded; ``(model name, done_reason)``."""
    check_keep_alive(keep_alive)
    unloaded = request.scope["state"].get("ruvllm_unloaded")
    if unloaded is not None:
        return name, "unload"
    return served_name(_state(request), name), "load"


def _metrics(run: Run) -> RequestMetrics | None:
    last = run.last.get(0)
    return last.metrics if last is not None else None


async def _answer(request: Request, translated: Translated, generate: bool) -> Any:
    """Run a translated request on its path: the NDJSON stream, or the one object."""
    state, user = _state(request), request_user(request)
    job: ChatJob | CompletionJob
    if isinstance(translated.chat, ChatCompletionRequest):
        job = ChatJob(state, translated.chat, user)
    else:
        job = CompletionJob(state, translated.chat, user)
    run = job.prepare()
    fit_context(run, translated.num_ctx)
    parts = Parts(translated, generate)
    if translated.chat.stream:
        await run.compile_constraint()  # a bad schema is a 400, not an error line in the stream
        lines = ndjson_lines(job.stream(run), parts, lambda: _metrics(run))
        return Stream(track_stream(request, lines), media_type=NDJSON, headers=NDJSON_HEADERS)
    result = await cancel_on_disconnect(request.receive, lambda: job.complete(run))
    if result is None:
        return Response(b"", status_code=499)
    return parts.answer(result, _metrics(run))


@post("/api/chat", status_code=200, summary="Chat (Ollama's API)", tags=["ollama"])
async def chat(request: Request, data: Annotated[ChatRequest, Body()]) -> ChatPart | Stream | Response[bytes]:
    if not data.messages:  # Ollama's way to load (or, with keep_alive 0, unload) a model
        model, reason = _load_or_unload(request, data.model, data.keep_alive)
        return ChatPart(
            model=model, created_at=now_iso(), message=AssistantMessage(content=""), done=True, done_reason=reason
        )
    state = _state(request)
    return await _answer(request, chat_request(data, state), generate=False)


@post("/api/generate", status_code=200, summary="Generate from a prompt (Ollama's API)", tags=["ollama"])
async def generate(
    request: Request, data: Annotated[GenerateRequest, Body()]
) -> GeneratePart | Stream | Response[bytes]:
    if not data.prompt and not data.system:
        model, reason = _load_or_unload(request, data.model, data.keep_alive)
        return GeneratePart(model=model, created_at=now_iso(), response="", done=True, done_reason=reason)
    state = _state(request)
    return await _answer(request, generate_request(data, state), generate=True)


@post("/api/embed", status_code=200, summary="Embeddings (Ollama's API)", tags=["ollama"])
async def embed(request: Request, data: Annotated[EmbedRequest, Body()]) -> EmbedResponse:
    state = _state(request)
    started = time.monotonic()
    check_keep_alive(data.keep_alive)
    model = served_name(state, data.model)
    if data.options:
        raise bad_request("embeddings take no options", param=f"options.{next(iter(data.options))}")
    texts = [data.input] if isinstance(data.input, str) else data.input
    # Ollama cuts what does not fit (truncate false refuses it): an embedding model's pipeline does
    # it itself, the generative model's embeddings take its token ids cut to their limit.
    if state.pooling is not None:
        limit = -1 if data.truncate else None
        openai = EmbeddingRequest(model=model, input=texts, dimensions=data.dimensions, truncate_prompt_tokens=limit)
    else:
        inputs: list[Any] = list(texts)
        if data.truncate and state.embedder is not None:
            inputs = [ids[: state.embedder.max_tokens] for ids in completion_prompts(state, texts)]
        openai = EmbeddingRequest(model=model, input=inputs, dimensions=data.dimensions)
    result = await openai_embeddings(request, openai)  # as /v1/embeddings answers, whatever that runs
    vectors = [d.embedding for d in sorted(result.data, key=lambda d: d.index)]
    return EmbedResponse(
        model=data.model,
        embeddings=vectors,  # type: ignore[arg-type]
        total_duration=int((time.monotonic() - started) * 1e9),
        load_duration=0,
        prompt_eval_count=result.usage.prompt_tokens,
    )


@get("/api/tags", summary="The served models (Ollama's API)", tags=["ollama"])
async def tags(request: Request) -> Tags:
    state = _state(request)
    if isinstance(state, ModelPool):
        return Tags(await anyio.to_thread.run_sync(pool_listed, state))  # reads each unloaded file's header
    return Tags(listed(state))


@get("/api/ps", summary="The loaded models (Ollama's API)", tags=["ollama"])
async def ps(request: Request) -> Running:
    state = _state(request)
    return Running(pool_running(state) if isinstance(state, ModelPool) else running(state))


@post("/api/show", status_code=200, summary="A model's details (Ollama's API)", tags=["ollama"])
async def show_model(request: Request, data: Annotated[ShowRequest, Body()]) -> ShowResponse:
    state = _state(request)
    return show(state, served_name(state, data.model or data.name))


@get("/api/version", summary="The server's version (Ollama's API)", tags=["ollama"])
async def version() -> Version:
    return Version(__version__)


#: The handlers the app registers.
OLLAMA_ROUTES = [chat, generate, embed, tags, ps, show_model, version]
