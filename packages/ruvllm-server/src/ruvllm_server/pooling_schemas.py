"""Wire types of the routes an embedding or cross-encoder model serves besides /v1/embeddings:
``/v1/rerank`` (the Jina / Cohere shape vLLM and llama.cpp accept) and ``/v1/score`` (vLLM's)."""

from __future__ import annotations

from msgspec import Struct


class RerankDocument(Struct):
    text: str


class RerankRequest(Struct, kw_only=True):
    query: str
    #: Texts, or objects with a ``text`` (Cohere's form).
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    #: -1: cut each query-document input to the model's limit; k > 0: to k tokens; absent: refuse longer.
    truncate_prompt_tokens: int | None = None


class RerankResult(Struct):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(Struct):
    total_tokens: int


class RerankResponse(Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreRequest(Struct, kw_only=True):
    #: One text scored against each of ``text_2``, or a list paired item by item with ``text_2``.
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: int | None = None


class ScoreData(Struct):
    index: int
    score: float
    object: str = "score"


class ScoreUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage
    object: str = "list"
