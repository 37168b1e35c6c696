"""``/v1/embeddings`` answered, apart from the route that serves it: an embedding model's own pipeline
(:mod:`ruvllm_server.pooling`), else the served generative model's pooled hidden states. Ollama's
``/api/embed`` calls the same function, so both doors give the same vectors."""

from __future__ import annotations

import base64

import anyio
from litestar import Request

from ruvllm_server import pooling
from ruvllm_server.errors import bad_request
from ruvllm_server.generation import check_model, completion_prompts
from ruvllm_server.request_context import served_state
from ruvllm_server.schemas import EmbeddingData, EmbeddingList, EmbeddingRequest, EmbeddingUsage


async def openai_embeddings(request: Request, data: EmbeddingRequest) -> EmbeddingList:
    """The OpenAI-shaped answer to ``data`` from the server of ``request``."""
    state = served_state(request)
    if state.pooling is not None:  # an embedding model's own pipeline
        return await pooling.embeddings(request, data)
    check_model(state, data.model)
    embedder = state.embedder
    assert embedder is not None
    if data.dimensions is not None and data.dimensions != embedder.dimensions:
        raise bad_request(
            f"dimensions cannot be changed: this model's embeddings have {embedder.dimensions}", param="dimensions"
        )
    inputs = completion_prompts(state, data.input)
    vectors = await anyio.to_thread.run_sync(embedder.embed, inputs)
    items = []
    for i, v in enumerate(vectors):
        if data.encoding_format == "base64":
            items.append(EmbeddingData(i, base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")))
        else:
            items.append(EmbeddingData(i, v.tolist()))
    tokens = sum(len(ids) for ids in inputs)
    return EmbeddingList(items, state.model_name, EmbeddingUsage(tokens, tokens))
