"""The endpoints SONA gives the server: POST /v1/feedback and GET /v1/sona/stats (a Litestar router),
with OpenAI-shaped errors."""

from __future__ import annotations

import pytest
from _sona_tiny import drain, random_tokens, serve, tiny_sona

litestar = pytest.importorskip("litestar")
from litestar.testing import TestClient  # noqa: E402

from ruvllm_sona.http import sona_router  # noqa: E402


@pytest.fixture
def client_and_sona(tmp_path):
    sona = tiny_sona(tmp_path / "m")
    serve(sona, "chatcmpl-1", random_tokens(0, 10), random_tokens(1, 5))
    drain(sona)
    app = litestar.Litestar(route_handlers=[sona_router(sona)])
    with TestClient(app) as client:
        yield client, sona


def test_feedback_applies_and_stats_show_it(client_and_sona):
    client, sona = client_and_sona
    assert sona.adapter().is_zero
    r = client.post("/v1/feedback", json={"response_id": "chatcmpl-1", "score": 1.0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "applied" and body["scope"] == "global"
    assert body["advantage"] == pytest.approx(0.5) and body["adapter_version"] == 1
    stats = client.get("/v1/sona/stats").json()
    assert stats["counters"]["feedback"] == 1 and stats["counters"]["instant_updates"] == 1
    assert stats["instant_update"]["count"] == 1 and stats["adapters"][0]["active"] is True
    assert stats["adapted"] == ["layers.0.q_proj", "layers.0.v_proj", "layers.1.q_proj", "layers.1.v_proj"]
    assert not sona.adapter().is_zero


@pytest.mark.parametrize(("body", "status", "kind"), [
    ({"response_id": "chatcmpl-404", "score": 0.5}, 404, "not_found_error"),
    ({"response_id": "chatcmpl-1", "score": 2.0}, 400, "invalid_request_error"),
    ({"response_id": "chatcmpl-1", "score": 0.5, "correction": "text"}, 400, "invalid_request_error"),
])
def test_feedback_errors(client_and_sona, body, status, kind):
    client, _ = client_and_sona
    r = client.post("/v1/feedback", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["type"] == kind
    assert r.json()["error"]["message"]


def test_malformed_body_is_a_client_error(client_and_sona):
    client, _ = client_and_sona
    assert client.post("/v1/feedback", json={"response_id": "chatcmpl-1"}).status_code == 400
    assert client.post("/v1/feedback", json={"response_id": "x", "score": "high"}).status_code == 400


def test_unattached_router_says_so():
    from ruvllm_sona import plugin

    assert plugin.active() is None
    with TestClient(litestar.Litestar(route_handlers=[sona_router()])) as client:
        r = client.get("/v1/sona/stats")
    assert r.status_code == 503 and "not attached" in r.json()["error"]["message"]


def test_a_router_given_a_lookup_serves_what_it_finds_when_asked(tmp_path):
    """The server's form: the router asks for the served model's learner per request (None until the
    model has loaded and SONA is attached: 503), not a process-wide registry."""
    found = {"sona": None}
    with TestClient(litestar.Litestar(route_handlers=[sona_router(lambda: found["sona"])])) as client:
        assert client.get("/v1/sona/stats").status_code == 503
        found["sona"] = tiny_sona(tmp_path / "m")
        r = client.get("/v1/sona/stats")
    assert r.status_code == 200 and r.json()["counters"] == found["sona"].stats()["counters"]
