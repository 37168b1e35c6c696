"""Serving an embedding or cross-encoder model (``ruvllm serve`` on a sentence-transformers folder or a
``*ForSequenceClassification``): /v1/embeddings in OpenAI's shape, /v1/rerank and /v1/score.

Requests meet in one batcher: whatever is waiting when the encoder frees up runs as one pass (up to
:data:`STEP_INPUTS` inputs), so a request of 256 texts and 16 concurrent small ones share passes. An
encoder pass keeps nothing between passes (no KV cache). Chat and completions are refused with a 400
saying why (:func:`not_generative`)."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import anyio
import numpy as np
import structlog
from litestar import Request, post
from litestar.params import Body

from ruvllm.embedding import EmbeddingModel, Encoded, heads, is_encoder_folder, load_embedding_model
from ruvllm_server.errors import APIError, bad_request, model_not_found
from ruvllm_server.pooling_schemas import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
)
from ruvllm_server.request_context import served_state
from ruvllm_server.schemas import EmbeddingData, EmbeddingList, EmbeddingRequest, EmbeddingUsage

if TYPE_CHECKING:
    from ruvllm_server.settings import ServerSettings
    from ruvllm_server.state import ServerState

log = structlog.get_logger("ruvllm.server.pooling")

#: Inputs one encoder pass takes from the waiting requests.
STEP_INPUTS = 256
#: The routes an encoder model serves (with /v1/models); every other model route gets a 400.
POOLING_PATHS = frozenset({"/v1/embeddings", "/v1/rerank", "/v1/score", "/rerank", "/score", "/api/embed"})


def serves_pooling(settings: ServerSettings) -> bool:
    """Whether ``settings.model`` is a folder to serve as embeddings or scores."""
    from pathlib import Path

    from ruvllm.errors import RuvllmError
    from ruvllm.resolve import resolve

    try:
        path = Path(resolve(settings.model))
    except RuvllmError:
        return False
    return is_encoder_folder(path)


def load_pooling_model(settings: ServerSettings) -> EmbeddingModel:
    from ruvllm.backend import LoadOptions
    from ruvllm_server.settings import ServerConfigError

    refused = {
        "lora_modules": settings.lora_modules,
        "speculative": settings.speculative,
        "tensor_parallel": settings.tensor_parallel > 1,
        "coordinator": settings.coordinator,
    }
    for name, value in refused.items():
        if value:
            raise ServerConfigError(f"{name} does not apply to an embedding or cross-encoder model")
    extra: dict[str, object] = dict(settings.backend_options)
    if settings.threads is not None:
        extra["threads"] = settings.threads
    quantization = "none" if settings.quantization in (None, "auto") else settings.quantization
    options = LoadOptions(quantization=quantization, dtype=settings.dtype, extra=extra)
    return load_embedding_model(
        settings.model, backend=settings.backend, options=options, matryoshka_dimensions=settings.matryoshka_dimensions
    )


def not_generative(model: EmbeddingModel, path: str) -> APIError:
    what = "a cross-encoder (it scores text pairs)" if model.kind == "cross-encoder" else "an embedding model"
    serves = "/v1/rerank and /v1/score" if model.kind == "cross-encoder" else "/v1/embeddings, /v1/rerank and /v1/score"
    return bad_request(
        f"{path} is not served: {model.name} is {what}, an encoder that cannot generate text; it serves {serves}",
        param="model",
        code="model_not_generative",
    )


@dataclass
class _Job:
    encoded: Encoded
    kind: str  # "embed" | "score"
    future: asyncio.Future[np.ndarray] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class PoolingService:
    """The loaded model and its batcher."""

    def __init__(self, model: EmbeddingModel, settings: ServerSettings) -> None:
        self.model = model
        self.max_inputs = settings.max_embedding_inputs
        self._queue: asyncio.Queue[_Job] | None = None
        self._worker: asyncio.Task[None] | None = None
        self.passes = 0

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(self._worker, return_exceptions=True)

    async def run(self, encoded: Encoded, kind: str) -> np.ndarray:
        assert self._queue is not None
        job = _Job(encoded, kind)
        await self._queue.put(job)
        return await job.future

    async def _run(self) -> None:
        assert self._queue is not None
        while True:
            jobs = [await self._queue.get()]
            while not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            for kind in ("embed", "score"):
                group = [j for j in jobs if j.kind == kind and not j.future.done()]
                while group:
                    step, n = [], 0
                    while group and (not step or n + len(group[0].encoded.token_ids) <= STEP_INPUTS):
                        step.append(group.pop(0))
                        n += len(step[-1].encoded.token_ids)
                    await self._step(step, kind)

    async def _step(self, jobs: list[_Job], kind: str) -> None:
        merged = Encoded(
            [ids for j in jobs for ids in j.encoded.token_ids],
            None if kind == "embed" else [t for j in jobs for t in (j.encoded.token_types or ())],
        )
        run = self.model.embed_encoded if kind == "embed" else self.model.score_encoded
        try:
            out = await anyio.to_thread.run_sync(run, merged)
        except Exception as exc:  # the requests of this pass get the error; the batcher goes on
            for j in jobs:
                if not j.future.done():
                    j.future.set_exception(exc)
            return
        self.passes += 1
        start = 0
        for j in jobs:
            n = len(j.encoded.token_ids)
            if not j.future.done():
                j.future.set_result(out[start : start + n])
            start += n

    # -- requests --------------------------------------------------------------------------------

    def check_count(self, n: int, param: str) -> None:
        if n == 0:
            raise bad_request(f"{param} must not be empty", param=param)
        if n > self.max_inputs:
            raise bad_request(
                f"{param} has {n} items, more than the {self.max_inputs} one request may carry", param=param
            )

    def encode_inputs(self, data: EmbeddingRequest) -> Encoded:
        model = self.model
        raw = data.input
        if isinstance(raw, str):
            return model.tokenize(
                [raw], prompt=model.prompt_text(data.prompt_name), truncate=data.truncate_prompt_tokens
            )
        self.check_count(len(raw), "input")
        if all(isinstance(x, str) for x in raw):
            texts: list[str] = raw  # type: ignore[assignment]
            return model.tokenize(
                texts, prompt=model.prompt_text(data.prompt_name), truncate=data.truncate_prompt_tokens
            )
        if all(isinstance(x, int) for x in raw):
            return model.check_ids([raw], truncate=data.truncate_prompt_tokens)  # type: ignore[list-item]
        if all(isinstance(x, list) for x in raw):
            return model.check_ids(raw, truncate=data.truncate_prompt_tokens)  # type: ignore[arg-type]
        raise bad_request(
            "input must be a string, a list of strings, a list of token ids or a list of token-id lists", param="input"
        )

    async def embed_vectors(self, encoded: Encoded, dimensions: int | None) -> np.ndarray:
        self.model.check_dimensions(dimensions)
        return heads.truncate(await self.run(encoded, "embed"), dimensions)

    async def score(self, pairs: Sequence[tuple[str, str]], truncate: int | None) -> tuple[np.ndarray, int]:
        """One score per pair, and the tokens read."""
        model = self.model
        if model.kind == "cross-encoder":
            enc = model.tokenize_pairs(pairs, truncate=truncate)
            scores = await self.run(enc, "score")
            if scores.shape[1] != 1:
                raise bad_request(f"{model.name} has {scores.shape[1]} labels; a score needs one", param="model")
            return scores[:, 0], enc.tokens
        firsts = sorted({a for a, _ in pairs})
        seconds = sorted({b for _, b in pairs})
        qa = model.tokenize(firsts, prompt=model.prompt_text(model.role_prompt("query")), truncate=truncate)
        qb = model.tokenize(seconds, prompt=model.prompt_text(model.role_prompt("document")), truncate=truncate)
        va, vb = await asyncio.gather(self.run(qa, "embed"), self.run(qb, "embed"))
        va, vb = heads.normalize(va), heads.normalize(vb)
        ia, ib = {t: i for i, t in enumerate(firsts)}, {t: i for i, t in enumerate(seconds)}
        scores = np.array([float(va[ia[a]] @ vb[ib[b]]) for a, b in pairs], dtype=np.float32)
        return scores, qa.tokens + qb.tokens


def _service(request: Request) -> PoolingService:
    state: ServerState = served_state(request)
    if state.pooling is None:
        raise bad_request(
            f"{request.url.path} needs an embedding or cross-encoder model; {state.model_name} generates text",
            param="model",
        )
    return state.pooling


def _check_name(request: Request, name: str | None) -> None:
    state: ServerState = served_state(request)
    if name is not None and name != state.model_name and name not in state.aliases:
        raise model_not_found(name)


async def embeddings(request: Request, data: EmbeddingRequest) -> EmbeddingList:
    """/v1/embeddings on an embedding model (called by the app's embeddings handler)."""
    service = _service(request)
    _check_name(request, data.model)
    if service.model.kind == "cross-encoder":
        raise bad_request(f"{service.model.name} is a cross-encoder: it serves /v1/rerank and /v1/score", param="model")
    encoded = service.encode_inputs(data)
    vectors = await service.embed_vectors(encoded, data.dimensions)
    items = []
    for i, v in enumerate(vectors):
        if data.encoding_format == "base64":
            items.append(EmbeddingData(i, base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")))
        else:
            items.append(EmbeddingData(i, v.tolist()))
    state: ServerState = served_state(request)
    return EmbeddingList(items, state.model_name, EmbeddingUsage(encoded.tokens, encoded.tokens))


def _doc_text(doc: str | RerankDocument) -> str:
    return doc if isinstance(doc, str) else doc.text


async def _rerank(request: Request, data: RerankRequest) -> RerankResponse:
    service = _service(request)
    _check_name(request, data.model)
    service.check_count(len(data.documents), "documents")
    if data.top_n is not None and data.top_n < 1:
        raise bad_request("top_n must be at least 1", param="top_n")
    texts = [_doc_text(d) for d in data.documents]
    scores, tokens = await service.score([(data.query, t) for t in texts], data.truncate_prompt_tokens)
    order = sorted(range(len(texts)), key=lambda i: (-float(scores[i]), i))[: data.top_n or len(texts)]
    results = [
        RerankResult(i, float(scores[i]), RerankDocument(texts[i]) if data.return_documents else None) for i in order
    ]
    state: ServerState = served_state(request)
    return RerankResponse(f"rerank-{uuid.uuid4().hex}", state.model_name, RerankUsage(tokens), results)


@post("/v1/rerank", status_code=200, summary="Rerank documents for a query (Jina / Cohere shape)", tags=["pooling"])
async def rerank(request: Request, data: Annotated[RerankRequest, Body()]) -> RerankResponse:
    return await _rerank(request, data)


@post("/rerank", status_code=200, summary="Rerank (vLLM's and llama.cpp's path)", tags=["pooling"])
async def rerank_alias(request: Request, data: Annotated[RerankRequest, Body()]) -> RerankResponse:
    return await _rerank(request, data)


async def _score(request: Request, data: ScoreRequest) -> ScoreResponse:
    service = _service(request)
    _check_name(request, data.model)
    firsts = [data.text_1] if isinstance(data.text_1, str) else data.text_1
    seconds = [data.text_2] if isinstance(data.text_2, str) else data.text_2
    service.check_count(len(firsts), "text_1")
    service.check_count(len(seconds), "text_2")
    if len(firsts) == 1:
        pairs = [(firsts[0], t) for t in seconds]
    elif len(seconds) == 1:
        pairs = [(t, seconds[0]) for t in firsts]
    elif len(firsts) == len(seconds):
        pairs = list(zip(firsts, seconds, strict=True))
    else:
        raise bad_request(
            f"text_1 has {len(firsts)} items and text_2 {len(seconds)}: give one of them once, or both the same count",
            param="text_2",
        )
    service.check_count(len(pairs), "text_2")
    scores, tokens = await service.score(pairs, data.truncate_prompt_tokens)
    state: ServerState = served_state(request)
    return ScoreResponse(
        f"score-{uuid.uuid4().hex}",
        int(time.time()),
        state.model_name,
        [ScoreData(i, float(s)) for i, s in enumerate(scores)],
        ScoreUsage(tokens, tokens),
    )


@post("/v1/score", status_code=200, summary="Score text pairs (vLLM's shape)", tags=["pooling"])
async def score(request: Request, data: Annotated[ScoreRequest, Body()]) -> ScoreResponse:
    return await _score(request, data)


@post("/score", status_code=200, summary="Score text pairs (vLLM's path)", tags=["pooling"])
async def score_alias(request: Request, data: Annotated[ScoreRequest, Body()]) -> ScoreResponse:
    return await _score(request, data)


POOLING_ROUTES: list[Any] = [rerank, rerank_alias, score, score_alias]
