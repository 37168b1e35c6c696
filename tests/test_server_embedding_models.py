"""`ruvllm serve` on an embedding model and on a cross-encoder: /v1/embeddings in OpenAI's shape (the
openai SDK included), /v1/rerank and /v1/score, against sentence-transformers on the same tiny random
folders; bad input gets a 4xx in OpenAI's error shape and the server keeps serving."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
from _embedding_fixtures import SENTENCES, write_bert_embedder, write_cross_encoder, write_gemma_embedder
from _server_fixtures import live_server

pytest.importorskip("sentence_transformers")
ATOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-embedders")
    return {
        "bert": write_bert_embedder(root / "bert"),
        "gemma": write_gemma_embedder(root / "gemma"),
        "cross": write_cross_encoder(root / "cross"),
    }


@pytest.fixture(scope="module")
def gemma_server(folders):
    from ruvllm.embedding import load_embedding_model

    model = load_embedding_model(str(folders["gemma"]), backend="candle-compat", matryoshka_dimensions=[16, 8])
    with live_server(model, served_model_name="emb", max_embedding_inputs=300) as s:
        yield s


@pytest.fixture(scope="module")
def cross_server(folders):
    from ruvllm.embedding import load_embedding_model

    model = load_embedding_model(str(folders["cross"]), backend="candle-compat")
    with live_server(model, served_model_name="rank") as s:
        yield s


def _post(server, path: str, body: dict) -> httpx.Response:
    """POST ``body`` (naming the served model unless it names one)."""
    body = {"model": server.app.state["ruvllm"].model_name, **body}
    return httpx.post(server.url(path), json=body, timeout=60)


def test_embeddings_in_openai_shape_equal_sentence_transformers(gemma_server, folders) -> None:
    from openai import OpenAI
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folders["gemma"]), device="cpu")
    client = OpenAI(base_url=gemma_server.url("/v1"), api_key="x")
    out = client.embeddings.create(model="emb", input=SENTENCES)  # the SDK asks for base64 and decodes it
    got = np.array([d.embedding for d in out.data], dtype=np.float32)
    np.testing.assert_allclose(got, st.encode(SENTENCES), atol=ATOL)
    assert [d.index for d in out.data] == list(range(len(SENTENCES)))
    tokens = sum(len(st.tokenize([s])["input_ids"][0]) for s in SENTENCES)
    assert out.usage.prompt_tokens == out.usage.total_tokens == tokens

    one = _post(gemma_server, "/v1/embeddings", {"model": "emb", "input": SENTENCES[0], "encoding_format": "float"})
    assert one.status_code == 200
    np.testing.assert_allclose(one.json()["data"][0]["embedding"], got[0], atol=1e-6)
    q = _post(gemma_server, "/v1/embeddings", {"input": SENTENCES[:3], "prompt_name": "query", "dimensions": 8})
    ref = st.encode(SENTENCES[:3], prompt_name="query", truncate_dim=8, normalize_embeddings=True)
    np.testing.assert_allclose([d["embedding"] for d in q.json()["data"]], ref, atol=ATOL)

    ids = st.tokenize([SENTENCES[2]])["input_ids"][0].tolist()
    for body in ({"input": ids}, {"input": [ids, ids]}):
        r = _post(gemma_server, "/v1/embeddings", {**body, "encoding_format": "base64"})
        assert r.status_code == 200, r.text
        vec = np.frombuffer(base64.b64decode(r.json()["data"][-1]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(vec, got[2], atol=1e-6)


@pytest.mark.parametrize(
    ("body", "needle", "param"),
    [
        ({"input": []}, "input must not be empty", "input"),
        ({"input": ""}, "input 0 is an empty string", "input"),
        ({"input": ["ok", 3]}, "input must be a string, a list of strings", "input"),
        ({"input": [[5, 6], []]}, "input 1 is an empty token list", "input"),
        ({"input": [5, 100000]}, "token id 100000, outside 0..", "input"),
        (
            {"input": "hi", "dimensions": 12},
            "dimensions=12 is not one this model gives (accepted: 24, 16, 8",
            "dimensions",
        ),
        ({"input": "hi", "dimensions": 4096}, "dimensions=4096", "dimensions"),
        ({"input": ["a"] * 10_000}, "10000 items, more than the 300", "input"),
        ({"input": "hi", "prompt_name": "passage"}, "unknown prompt_name 'passage'", "prompt_name"),
        ({"input": " ".join(["hello"] * 60)}, "more than this model's 48", "input"),
    ],
)
def test_bad_embedding_input_is_a_clear_400(gemma_server, body, needle, param) -> None:
    r = _post(gemma_server, "/v1/embeddings", {"model": "emb", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert _post(gemma_server, "/v1/embeddings", {"input": "still serving"}).status_code == 200


def test_truncation_only_when_asked_and_chat_refused(gemma_server, folders) -> None:
    from sentence_transformers import SentenceTransformer

    long = " ".join(["hello"] * 60)
    r = _post(gemma_server, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": -1})
    assert r.status_code == 200
    ref = SentenceTransformer(str(folders["gemma"]), device="cpu").encode([long])  # truncates to max_seq_length
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], ref[0], atol=ATOL)
    assert r.json()["usage"]["prompt_tokens"] == 48
    for path, body in (
        ("/v1/chat/completions", {"model": "emb", "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"model": "emb", "prompt": "hi"}),
    ):
        r = _post(gemma_server, path, body)
        assert r.status_code == 400
        assert "an encoder that cannot generate text" in r.json()["error"]["message"]
    assert httpx.get(gemma_server.url("/v1/models")).json()["data"][0]["id"] == "emb"


def test_many_inputs_and_concurrent_requests_share_passes(gemma_server) -> None:
    """One request of 300 texts is one encoder pass; 16 requests sent while it runs join passes
    together (the batcher takes whatever waits), and each input's vector is the same in any pass."""
    service = gemma_server.app.state["ruvllm"].pooling
    texts = [f"{SENTENCES[i % len(SENTENCES)]} {i}" for i in range(300)]
    before = service.passes
    big = _post(gemma_server, "/v1/embeddings", {"input": texts})
    assert big.status_code == 200
    assert service.passes - before == 1
    vectors = np.array([d["embedding"] for d in big.json()["data"]])

    async def concurrent() -> list[list[float]]:
        async with httpx.AsyncClient(base_url=gemma_server.base_url, timeout=60) as client:
            posts = [client.post("/v1/embeddings", json={"model": "emb", "input": texts})]
            posts += [client.post("/v1/embeddings", json={"model": "emb", "input": texts[i]}) for i in range(16)]
            rs = await asyncio.gather(*posts)
        return [r.json()["data"][0]["embedding"] for r in rs[1:]]

    before = service.passes
    alone = np.array(asyncio.run(concurrent()))
    np.testing.assert_allclose(alone, vectors[:16], atol=1e-6)  # a row's vector does not depend on its pass
    assert service.passes - before < 17  # 17 requests, fewer passes


def test_rerank_and_score_on_a_cross_encoder(cross_server, folders) -> None:
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(folders["cross"]), device="cpu")
    query, docs = SENTENCES[4], SENTENCES[:4] + SENTENCES[5:]
    ref = ce.predict([(query, d) for d in docs])
    r = _post(cross_server, "/v1/rerank", {"model": "rank", "query": query, "documents": docs, "top_n": 3})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == list(np.argsort(-ref, kind="stable")[:3])
    np.testing.assert_allclose([x["relevance_score"] for x in results], np.sort(ref)[::-1][:3], atol=ATOL)
    assert results[0]["document"]["text"] == docs[results[0]["index"]]
    r = _post(
        cross_server, "/rerank", {"query": query, "documents": [{"text": d} for d in docs], "return_documents": False}
    )
    assert all(x["document"] is None for x in r.json()["results"]) and len(r.json()["results"]) == len(docs)
    s = _post(cross_server, "/v1/score", {"model": "rank", "text_1": query, "text_2": docs})
    np.testing.assert_allclose([d["score"] for d in s.json()["data"]], ref, atol=ATOL)
    s = _post(cross_server, "/v1/score", {"text_1": docs[:2], "text_2": docs[2:4]})
    np.testing.assert_allclose(
        [d["score"] for d in s.json()["data"]], ce.predict(list(zip(docs[:2], docs[2:4], strict=True))), atol=ATOL
    )
    bad = _post(cross_server, "/v1/score", {"text_1": docs[:2], "text_2": docs[:3]})
    assert bad.status_code == 400 and "text_1 has 2 items and text_2 3" in bad.json()["error"]["message"]
    emb = _post(cross_server, "/v1/embeddings", {"input": "hi"})
    assert emb.status_code == 400 and "cross-encoder" in emb.json()["error"]["message"]
    assert _post(cross_server, "/v1/rerank", {"query": query, "documents": []}).status_code == 400


def test_rerank_and_score_on_an_embedding_model_by_cosine(gemma_server, folders) -> None:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folders["gemma"]), device="cpu")
    query, docs = SENTENCES[2], SENTENCES
    q = st.encode_query([query])
    d = st.encode_document(docs)
    ref = (d @ q[0]) / np.linalg.norm(d, axis=-1) / np.linalg.norm(q[0])
    r = _post(gemma_server, "/v1/rerank", {"query": query, "documents": docs})
    assert [x["index"] for x in r.json()["results"]] == list(np.argsort(-ref, kind="stable"))
    s = _post(gemma_server, "/v1/score", {"text_1": query, "text_2": docs})
    np.testing.assert_allclose([x["score"] for x in s.json()["data"]], ref, atol=ATOL)
