"""API keys, CORS, per-key rate limiting and admission control on a live server."""

from __future__ import annotations

import hashlib
import threading
import time

import httpx
import openai
import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)

from ruvllm import hookimpl

MODEL = "smollm2"
#: One key per test that spends rate-limit tokens, so the tests do not drain each other's buckets.
KEYS = ["sk-test-one", "sk-test-two", "sk-test-three", "sk-test-four"]
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def guarded(smollm2_model):  # noqa: F811
    with live_server(
        smollm2_model, api_keys=KEYS, cors_origins=[ORIGIN], rate_limit=0.05, rate_limit_burst=3, num_kv_blocks=64
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def narrow(smollm2_model):  # noqa: F811
    """One request at a time and a queue of one."""
    with live_server(smollm2_model, max_concurrent=1, max_queue=1, num_kv_blocks=64) as srv:
        yield srv


def _client(srv, key: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url("/v1"), api_key=key or "no-key", max_retries=0, timeout=60)


def test_missing_or_wrong_key_is_401(guarded) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        _client(guarded, "sk-wrong").models.list()
    assert info.value.body["code"] == "invalid_api_key"
    r = httpx.get(guarded.url("/v1/models"))
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "authentication_error"
    for header in ("Basic c2stdGVzdC1vbmU=", "Bearer", "sk-test-one", "Bearer sk-test-on"):
        assert httpx.get(guarded.url("/v1/models"), headers={"Authorization": header}).status_code == 401
    # Everything but the probes is protected.
    assert httpx.post(guarded.url("/tokenize"), json={"prompt": "x"}).status_code == 401
    assert httpx.get(guarded.url("/metrics")).status_code == 401


def test_right_key_works_and_probes_are_open(guarded) -> None:
    models = _client(guarded, KEYS[0]).models.list()
    assert [m.id for m in models] == [MODEL]
    r = _client(guarded, KEYS[0]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(guarded.url("/health")).status_code == 200
    assert httpx.get(guarded.url("/ready")).status_code == 200


class UserRecorder:
    """A plugin that notes who each request is attributed to."""

    def __init__(self) -> None:
        self.users: list[str | None] = []

    @hookimpl
    def pre_inference(self, request) -> None:
        self.users.append(request.user)


def test_requests_are_attributed_to_the_key_or_the_given_user(guarded, smollm2_model) -> None:  # noqa: F811
    recorder = UserRecorder()
    smollm2_model.host.register(recorder, name="test-user-recorder")
    try:
        client = _client(guarded, KEYS[3])
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, user="alice")
    finally:
        smollm2_model.host.pm.unregister(recorder)
    key_id = "key-" + hashlib.sha256(KEYS[3].encode()).hexdigest()[:12]
    assert recorder.users == [key_id, "alice"]


def test_cors_preflight_and_simple_request(guarded) -> None:
    pre = httpx.options(
        guarded.url("/v1/chat/completions"),
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert pre.status_code in (200, 204), pre.text
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    # Another origin is refused.
    other = httpx.options(
        guarded.url("/v1/chat/completions"),
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert other.headers.get("access-control-allow-origin") != "https://evil.example"
    # A real request from the allowed origin carries the header, errors included.
    r = httpx.get(guarded.url("/v1/models"), headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_rate_limit_per_key(guarded) -> None:
    client = _client(guarded, KEYS[2])
    for _ in range(3):  # the burst
        client.models.list()
    with pytest.raises(openai.RateLimitError) as info:
        client.models.list()
    retry_after = int(info.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 20  # one token per 20 s
    assert info.value.body["code"] == "rate_limit_exceeded"
    # Another key has its own bucket.
    _client(guarded, KEYS[1]).models.list()


def test_auth_off_accepts_any_or_no_key(narrow) -> None:
    assert httpx.get(narrow.url("/v1/models")).status_code == 200
    assert httpx.get(narrow.url("/v1/models"), headers={"Authorization": "Bearer whatever"}).status_code == 200


def test_admission_queue_then_503(narrow) -> None:
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 300, "stream": True, "ignore_eos": True}
    queued_result: dict[str, object] = {}

    def queued_request() -> None:
        r = httpx.post(
            narrow.url("/v1/completions"), json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}, timeout=120
        )
        queued_result["status"] = r.status_code

    with httpx.stream("POST", narrow.url("/v1/completions"), json=body, timeout=60) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept referenced: dropping it would close the connection
        next(line for line in lines if line.startswith("data: "))  # the slot is taken
        waiter = threading.Thread(target=queued_request)
        waiter.start()
        deadline = time.monotonic() + 30
        while narrow.state.admission.queued < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.05)
        full = httpx.post(narrow.url("/v1/completions"), json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        assert full.status_code == 503
        assert full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "overloaded"
        with pytest.raises(openai.InternalServerError) as info:
            _client(narrow, None).completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        assert info.value.status_code == 503
    # Closing the held stream frees the slot; the queued request runs.
    waiter.join(timeout=120)
    assert queued_result.get("status") == 200
    assert narrow.state.admission.running == 0 and narrow.state.admission.queued == 0
