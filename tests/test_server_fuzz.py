"""Hypothesis-generated request bodies (plausible fields mixed with arbitrary JSON) against every POST
route: the server answers each with 2xx or a 4xx in OpenAI's error shape, never a 5xx."""

from __future__ import annotations

import json

import httpx
import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "smollm2"

json_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def field(valid: st.SearchStrategy, invalid: st.SearchStrategy | None = None, junk: bool = True) -> st.SearchStrategy:
    """A valid value nine times in ten, else an out-of-range value or (with ``junk``) arbitrary JSON."""
    if invalid is None:
        bad = json_values
    else:
        bad = st.one_of(invalid, json_values) if junk else invalid
    return st.integers(0, 9).flatmap(lambda k: bad if k == 0 else valid)


small_text = st.text(max_size=20)
token_ids = st.lists(st.integers(min_value=0, max_value=49_151), min_size=1, max_size=6)
bad_token_ids = st.lists(st.integers(min_value=-5, max_value=10**6), max_size=6)
stop = st.one_of(small_text, st.lists(small_text, max_size=5))
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": small_text})
message = st.fixed_dictionaries(
    {
        "role": field(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), st.just("robot")),
        "content": field(
            st.one_of(small_text, st.lists(text_part, min_size=1, max_size=2)),
            st.one_of(st.none(), st.lists(st.fixed_dictionaries({"type": st.just("image_url")}), max_size=1)),
        ),
    },
    optional={"name": small_text},
)
sampling_fields = {
    "model": field(st.just(MODEL), st.just("other-model")),
    "temperature": field(st.floats(0, 2), st.floats(-1, -0.01) | st.floats(2.01, 5)),
    "top_p": field(st.floats(0.01, 1), st.floats(-0.5, 0) | st.floats(1.01, 2)),
    "top_k": field(st.integers(0, 100), st.integers(-5, -1)),
    "min_p": field(st.floats(0, 1), st.floats(1.01, 2)),
    "n": field(st.integers(1, 3), st.integers(-1, 0) | st.integers(4, 10**6)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "stop": field(stop),
    # Never missing or null: the default would generate up to the whole context.
    "max_tokens": field(st.integers(1, 3), st.integers(-2, 0) | st.integers(10**4, 2**70), junk=False),
    "presence_penalty": field(st.floats(-2, 2), st.floats(2.01, 10)),
    "frequency_penalty": field(st.floats(-2, 2), st.floats(-10, -2.01)),
    "repetition_penalty": field(st.floats(0.5, 2), st.floats(-1, 0)),
    "logit_bias": field(
        st.dictionaries(st.sampled_from(["1", "42", "300"]), st.floats(-100, 100), max_size=3),
        st.dictionaries(st.sampled_from(["x", "-3", "99999999", "1.5"]), st.floats(-150, 150), min_size=1),
    ),
    "seed": field(st.integers(0, 2**63), st.integers(-(2**70), -1) | st.integers(2**64, 2**70)),
    "user": field(small_text),
    "min_tokens": field(st.integers(0, 1), st.integers(-1, -1) | st.integers(4, 10)),
    "ignore_eos": field(st.booleans()),
    "stop_token_ids": field(st.lists(st.integers(0, 49_151), max_size=3), bad_token_ids),
}
chat_body = st.fixed_dictionaries(
    {
        "model": sampling_fields["model"],
        "messages": field(st.lists(message, min_size=1, max_size=3), st.just([])),
        "max_tokens": sampling_fields["max_tokens"],
    },
    optional={
        **{k: v for k, v in sampling_fields.items() if k not in ("model", "max_tokens")},
        "max_completion_tokens": field(st.integers(1, 3), st.integers(-1, 0), junk=False),
        "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(0, 5), st.integers(21, 30)),
        "tools": field(st.just([]), st.lists(st.just({"type": "function"}), min_size=1, max_size=1)),
        "response_format": field(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})),
    },
)
prompt = st.one_of(
    small_text.filter(bool),
    st.lists(small_text.filter(bool), min_size=1, max_size=3),
    token_ids,
    st.lists(token_ids, min_size=1, max_size=2),
)
bad_prompt = st.one_of(st.just(""), st.just([]), bad_token_ids, st.lists(bad_token_ids, max_size=2))
completion_body = st.fixed_dictionaries(
    {
        "model": sampling_fields["model"],
        "prompt": field(prompt, bad_prompt),
        "max_tokens": sampling_fields["max_tokens"],
    },
    optional={
        **{k: v for k, v in sampling_fields.items() if k not in ("model", "max_tokens")},
        "logprobs": field(st.integers(0, 5), st.integers(21, 30) | st.integers(-3, -1)),
        "echo": field(st.booleans()),
        "best_of": field(st.just(1), st.integers(0, 3)),
        "suffix": field(st.just(""), small_text),
    },
)
embedding_body = st.fixed_dictionaries(
    {"model": sampling_fields["model"], "input": field(prompt, bad_prompt)},
    optional={
        "encoding_format": field(st.sampled_from(["float", "base64"]), st.just("int8")),
        "dimensions": field(st.just(576), st.integers(-1, 600)),
        "user": field(small_text),
    },
)
tokenize_body = st.fixed_dictionaries(
    {},
    optional={
        "model": sampling_fields["model"],
        "prompt": field(small_text),
        "messages": field(st.lists(message, min_size=1, max_size=2)),
        "add_special_tokens": field(st.booleans()),
        "add_generation_prompt": field(st.booleans()),
    },
)
detokenize_body = st.fixed_dictionaries(
    {"tokens": field(token_ids, bad_token_ids)}, optional={"model": sampling_fields["model"]}
)

routes = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), chat_body),
    st.tuples(st.just("/v1/completions"), completion_body),
    st.tuples(st.just("/v1/embeddings"), embedding_body),
    st.tuples(st.just("/tokenize"), tokenize_body),
    st.tuples(st.just("/detokenize"), detokenize_body),
)


@pytest.fixture(scope="module")
def http(smollm2_model):  # noqa: F811
    with (
        live_server(smollm2_model, num_kv_blocks=256, max_n=3) as srv,
        httpx.Client(base_url=srv.base_url, timeout=120) as client,
    ):
        yield client


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and "type" in err
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        for e in events[:-1]:
            assert "error" not in json.loads(e[6:]), e


SETTINGS = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


@SETTINGS
@given(route_body=routes)
def test_generated_bodies_never_cause_5xx(http, route_body) -> None:
    route, body = route_body
    check(http.post(route, json=body))


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    route=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize"]),
    raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode),
)
def test_raw_bodies_never_cause_5xx(http, route, raw) -> None:
    check(http.post(route, content=raw, headers={"content-type": "application/json"}))
