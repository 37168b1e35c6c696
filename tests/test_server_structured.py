"""Structured output through the OpenAI-compatible server, driven by the official openai SDK: Pydantic
models through ``chat.completions.parse``, ``json_object``, vLLM's ``structured_outputs`` and
``guided_*`` fields on chat and completions, streaming equal to non-streaming, and 400s in the
OpenAI error shape that name the parameter."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pydantic
import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)

MODEL = "smollm2"


@pytest.fixture(scope="module")
def server(smollm2_model):  # noqa: F811
    with live_server(smollm2_model) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population_millions: float


def test_sdk_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=120,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name


def test_json_object_streamed_equals_non_streamed(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": 'Return exactly this JSON object: {"answer": 4}'}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    whole = client.chat.completions.create(**kw)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices
    )
    assert streamed == text


def test_vllm_fields_on_chat_and_completions(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is water wet?"}],
        temperature=0,
        max_tokens=8,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert chat.choices[0].message.content in ("yes", "no")
    done = client.completions.create(
        model=MODEL,
        prompt="The date today is",
        temperature=0,
        max_tokens=20,
        n=2,
        extra_body={"structured_outputs": {"regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"}},
    )
    assert len(done.choices) == 2
    for c in done.choices:
        assert re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", c.text) and c.finish_reason == "stop"
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    done = client.completions.create(
        model=MODEL, prompt="JSON:", temperature=0, max_tokens=30, extra_body={"guided_json": schema}
    )
    assert set(json.loads(done.choices[0].text)) == {"ok"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        ({"guided_grammar": "start: ( oops"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}, "guided_json"),
    ],
    ids=["two-constraints", "grammar-syntax", "structured-two-keys", "schema-missing", "unknown-type", "bad-ref"],
)
def test_bad_constraints_are_400_naming_the_parameter(server, body, param):
    r = httpx.post(
        server.url("/v1/chat/completions"),
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_streamed_request_with_a_broken_schema_is_400_before_the_stream(server, path):
    """The constraint compiles before a stream's first chunk: a schema llguidance rejects is a 400 in
    OpenAI's shape naming the field, not an error chunk inside a 200 stream."""
    broken = {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": broken}}
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "response_format": fmt}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    with httpx.stream("POST", server.url(path), json=body, timeout=60) as r:
        r.read()
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].startswith("response_format"), err
