"""Every error arrives in OpenAI's shape with the right status, so the official client raises the
matching exception type; nothing a client sends causes a 500."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from _forward_wrap import wrapped_forward
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2"
HI = [{"role": "user", "content": "hi"}]
#: Our extensions: the openai client takes them through ``extra_body``.
EXTENSIONS = {"stop_token_ids", "ignore_eos", "top_k", "min_p", "repetition_penalty", "min_tokens"}


def create_chat(client: openai.OpenAI, body: dict):
    extra = {k: v for k, v in body.items() if k in EXTENSIONS}
    known = {k: v for k, v in body.items() if k not in EXTENSIONS}
    return client.chat.completions.create(**known, extra_body=extra or None)


@pytest.fixture(scope="module")
def server(smollm2_model):  # noqa: F811
    with live_server(smollm2_model, max_context=256, max_body_bytes=64 * 1024, max_n=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=60)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": "two"}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"stop": ["a", 3]}, None),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ],
)
def test_wrong_types_and_ranges_are_400(client, server, extra: dict, param: str | None) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 1, **extra}
    err = assert_openai_error(httpx.post(server.url("/v1/chat/completions"), json=body), 400)
    if param is not None:
        assert err["param"] == param
    with pytest.raises(openai.BadRequestError):
        create_chat(client, body)


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"n": 5}, "n", None),  # max_n is 4 here
        ({"logit_bias": {"abc": 1}}, "logit_bias", None),
        ({"logit_bias": {"999999": 1}}, None, None),
        ({"top_logprobs": 2}, "top_logprobs", None),
        ({"tools": [{"type": "function"}]}, "tools[0]", None),
        ({"response_format": {"type": "yaml"}}, "response_format.type", None),
        ({"max_tokens": 250}, "max_tokens", "context_length_exceeded"),
        ({"messages": [{"role": "user", "content": "word " * 400}]}, "messages", "context_length_exceeded"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
            None,
        ),
        ({"stop": ""}, "stop", None),
        ({"stop_token_ids": [10**7]}, "stop_token_ids", None),
    ],
)
def test_semantic_errors_are_400(client, extra: dict, param: str | None, code: str | None) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 1, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        create_chat(client, body)
    err = info.value.body
    assert isinstance(err, dict) and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code


def test_completions_prompt_errors(client) -> None:
    for prompt in ([], [[]], [1, "a"], [10**7], "word " * 400):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    for extra in ({"suffix": "x"}, {"best_of": 3}, {"logprobs": 21}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1, **extra)


def test_malformed_json_is_400(server) -> None:
    for raw in (b"{not json", b"[]", b'"text"', b"", b'{"model": "smollm2", "messages": [{"role": "user"}]'):
        r = httpx.post(server.url("/v1/chat/completions"), content=raw, headers={"content-type": "application/json"})
        assert_openai_error(r, 400)


def test_unknown_model_is_404(client, server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=HI, max_tokens=1)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="gpt-9", input="x")
    assert_openai_error(httpx.post(server.url("/tokenize"), json={"model": "gpt-9", "prompt": "x"}), 404)


def test_unknown_route_and_wrong_method(server) -> None:
    assert_openai_error(httpx.get(server.url("/v1/nothing-here")), 404)
    assert_openai_error(httpx.get(server.url("/v1/chat/completions")), 405)
    assert_openai_error(httpx.delete(server.url("/v1/models")), 405)


def test_body_too_large_is_413(client, server) -> None:
    big = "x" * (80 * 1024)
    r = httpx.post(
        server.url("/v1/chat/completions"), json={"model": MODEL, "messages": [{"role": "user", "content": big}]}
    )
    assert_openai_error(r, 413)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": big}], max_tokens=1)
    assert info.value.status_code == 413


def test_tokenizer_route_errors(server) -> None:
    assert_openai_error(httpx.post(server.url("/tokenize"), json={}), 400)
    assert_openai_error(httpx.post(server.url("/tokenize"), json={"prompt": "a", "messages": HI}), 400)
    assert_openai_error(httpx.post(server.url("/detokenize"), json={"tokens": [-1]}), 400, param="tokens")
    assert_openai_error(httpx.post(server.url("/detokenize"), json={"tokens": "abc"}), 400)


def test_embedding_errors(client, server) -> None:
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="hello", dimensions=8)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input=[])
    r = httpx.post(server.url("/v1/embeddings"), json={"model": MODEL, "input": "x", "encoding_format": "int8"})
    assert_openai_error(r, 400, param="encoding_format")


def _requests_by_status_class(server) -> dict[str, float]:
    """``ruvllm_http_requests_total`` summed by the first digit of its status label."""
    totals: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(server.url("/metrics")).text):
        for s in fam.samples:
            if s.name == "ruvllm_http_requests_total":
                totals[s.labels["status"][0]] = totals.get(s.labels["status"][0], 0.0) + s.value
    return totals


def test_no_5xx_recorded(server) -> None:
    """Bad requests of every kind above, sent here so the test holds alone or in any order: each is
    answered and recorded as a 4xx, and the server's counter holds no 5xx at all."""
    chat, completions = server.url("/v1/chat/completions"), server.url("/v1/completions")
    bad = [
        ("POST", chat, {"json": {"model": MODEL, "messages": HI, "temperature": "hot"}}),
        ("POST", chat, {"json": {"model": MODEL, "messages": HI, "n": 5}}),
        ("POST", chat, {"json": {"model": MODEL, "messages": HI, "max_tokens": 250}}),
        ("POST", chat, {"json": {"model": MODEL, "messages": HI, "logit_bias": {"999999": 1}}}),
        ("POST", chat, {"json": {"model": MODEL, "messages": HI, "stop_token_ids": [10**7]}}),
        ("POST", chat, {"content": b"{not json", "headers": {"content-type": "application/json"}}),
        ("POST", chat, {"json": {"model": MODEL, "messages": [{"role": "user", "content": "x" * (80 * 1024)}]}}),
        ("POST", chat, {"json": {"model": "gpt-9", "messages": HI}}),
        ("GET", chat, {}),
        ("POST", completions, {"json": {"model": MODEL, "prompt": [10**7], "max_tokens": 1}}),
        ("POST", completions, {"json": {"model": MODEL, "prompt": "word " * 400, "max_tokens": 1}}),
        ("POST", server.url("/v1/embeddings"), {"json": {"model": MODEL, "input": []}}),
        ("POST", server.url("/detokenize"), {"json": {"tokens": [-1]}}),
        ("GET", server.url("/v1/nothing-here"), {}),
    ]
    before = _requests_by_status_class(server)
    for method, url, kwargs in bad:
        r = httpx.request(method, url, timeout=60, **kwargs)
        assert 400 <= r.status_code < 500, (method, url, r.status_code, r.text)
    after = _requests_by_status_class(server)
    # Every one was counted as a 4xx: the counter sees these requests, so its lack of 5xx means something.
    assert after.get("4", 0.0) - before.get("4", 0.0) == len(bad)
    assert after.get("5", 0.0) == 0, after


def test_errors_from_the_engine_keep_their_type_while_watching_for_disconnects() -> None:
    from ruvllm.errors import RequestError
    from ruvllm_server.generation import cancel_on_disconnect

    async def never_disconnects() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def rejected() -> None:
        raise RequestError("the engine said no")

    async def answered() -> str:
        return "answer"

    with pytest.raises(RequestError, match="the engine said no"):
        asyncio.run(cancel_on_disconnect(never_disconnects, rejected))
    assert asyncio.run(cancel_on_disconnect(never_disconnects, answered)) == "answer"

    async def gone() -> dict:
        return {"type": "http.disconnect"}

    async def slow() -> str:
        await asyncio.sleep(3600)
        return "too late"

    assert asyncio.run(cancel_on_disconnect(gone, slow)) is None


def test_a_broken_engine_turns_ready_and_health_503_with_the_reason(smollm2_model) -> None:  # noqa: F811
    def dead_device(inner, batch, cache):
        raise RuntimeError("the device is gone")

    with live_server(smollm2_model) as srv:
        with wrapped_forward(smollm2_model, dead_device):
            for _ in range(3):
                r = httpx.post(
                    srv.url("/v1/completions"), json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60
                )
                assert r.status_code in (500, 503), r.text
                assert r.json()["error"]["message"]
        ready = httpx.get(srv.url("/ready"), timeout=10)
        health = httpx.get(srv.url("/health"), timeout=10)
    assert ready.status_code == 503 and "the device is gone" in ready.json()["detail"]
    assert health.status_code == 503 and "the device is gone" in health.json()["detail"]
