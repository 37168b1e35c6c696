"""SONA scoped per API key, end to end over HTTP: a live server with two keys gives each key its own
adapter. Feedback under key A changes what A's requests are served with (a new adapter version and a
higher log-probability of the rated token), B's requests stay bit-identical, B cannot rate A's
responses, and the key id the server hands the engine never contains the key. Without API keys no
request carries a key id and everything goes to the global scope.

Runs on a tiny random-weight model (milliseconds per request and per SONA capture)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from _server_fixtures import live_server
from _tiny_served_fixtures import tiny_served_model

from ruvllm import hookimpl

pytest.importorskip("ruvllm_sona")

from ruvllm_server.middleware import key_id

KEY_A = "sk-alpha-7f3c9e2d41b8"
KEY_B = "sk-bravo-0a6d5b1c93e7"
MODEL = "tiny"
PROMPT = [11, 42, 7, 63, 25, 88, 19, 50, 34, 71]
WAIT = 60.0


class EngineRequestRecorder:
    """What the engine's hooks see of each served request (registered after SONA: runs before it)."""

    def __init__(self) -> None:
        self.metadata: dict[str, dict[str, Any]] = {}

    @hookimpl
    def post_inference(self, request, result):
        self.metadata[request.request_id] = dict(request.metadata)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_served_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def recorder(model):
    rec = EngineRequestRecorder()
    model.host.register(rec, name="engine-request-recorder")
    yield rec
    model.host.pm.unregister(rec)


def _serve(model: Any, **settings: Any) -> Any:
    return live_server(model, served_model_name=MODEL, sona=True, sona_scope="api_key", num_kv_blocks=64, **settings)


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _complete(server: Any, key: str | None) -> dict[str, Any]:
    """One greedy token after PROMPT with the top-5 log-probabilities."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 5, "ignore_eos": True}
    r = httpx.post(server.url("/v1/completions"), json=body, headers=_auth(key), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stats(server: Any, key: str | None) -> dict[str, Any]:
    r = httpx.get(server.url("/v1/sona/stats"), headers=_auth(key), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_for(server: Any, key: str | None, done: Any, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT
    while True:
        stats = _stats(server, key)
        if done(stats):
            return stats
        assert time.monotonic() < deadline, f"SONA's background loop did not {what} in {WAIT:.0f} s: {stats}"
        time.sleep(0.05)


def _adapters(stats: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {a["scope"]: a for a in stats["adapters"]}


def test_feedback_under_one_key_adapts_only_that_keys_requests(model, recorder):
    id_a, id_b = key_id(KEY_A), key_id(KEY_B)
    scope_a, scope_b = f"key:{id_a}", f"key:{id_b}"
    with _serve(model, api_keys=[KEY_A, KEY_B]) as server:
        before_b = _complete(server, KEY_B)
        before_a = _complete(server, KEY_A)
        # Both keys start from the base model.
        assert before_a["choices"] == before_b["choices"]
        # Both responses captured, then one more whole cycle, so the new scopes' routing is settled
        # before any score exists (routing may copy a well-rated scope's adapter to a new one).
        cycles = _wait_for(server, KEY_A, lambda s: s["trajectories"]["captured"] == 2,
                           "capture both responses")["counters"]["cycles"]
        _wait_for(server, KEY_A, lambda s: s["counters"]["cycles"] >= cycles + 2, "run two more cycles")

        # The engine saw each request's key id, never the key; SONA scoped it by that id.
        seen_a, seen_b = recorder.metadata[before_a["id"]], recorder.metadata[before_b["id"]]
        assert seen_a["api_key_id"] == id_a and seen_b["api_key_id"] == id_b
        # Nothing taught yet: the gate applied no adapter (and had nothing to compare with), and no
        # cluster of the scope was chosen.
        gate = {"applied": False, "similarity": None, "cluster": None}
        assert seen_a["sona"] == {"scope": scope_a, "adapter_version": 0, **gate}
        assert seen_b["sona"] == {"scope": scope_b, "adapter_version": 0, **gate}
        for seen, key in ((seen_a, KEY_A), (seen_b, KEY_B)):
            assert key not in seen["api_key_id"] and seen["api_key_id"] not in key

        # B cannot rate A's response: answered like an unknown id, and nothing is learnt.
        stolen = httpx.post(server.url("/v1/feedback"), json={"response_id": before_a["id"], "score": 1.0},
                            headers=_auth(KEY_B), timeout=60)
        assert stolen.status_code == 404 and stolen.json()["error"]["param"] == "response_id"
        assert {a["scope"]: a["version"] for a in _stats(server, KEY_A)["adapters"]} == {
            "global": 0, scope_a: 0, scope_b: 0}

        fb = httpx.post(server.url("/v1/feedback"), json={"response_id": before_a["id"], "score": 1.0},
                        headers=_auth(KEY_A), timeout=60)
        assert fb.status_code == 200, fb.text
        assert fb.json()["scope"] == scope_a and fb.json()["advantage"] == pytest.approx(0.5)
        stats = _wait_for(server, KEY_A, lambda s: _adapters(s)[scope_a]["version"] >= 1, "apply the feedback")
        adapters = _adapters(stats)
        assert adapters[scope_a]["active"] and adapters[scope_a]["feedback"] == 1
        assert adapters[scope_b] | {"ewc": None} == adapters[scope_b] | {
            "version": 0, "active": False, "feedback": 0, "instant_updates": 0, "routed_from": None, "ewc": None}
        assert adapters["global"]["version"] == 0
        for text in (httpx.get(server.url("/v1/sona/stats"), headers=_auth(KEY_A)).text, fb.text):
            assert KEY_A not in text and KEY_B not in text

        after_a = _complete(server, KEY_A)
        after_b = _complete(server, KEY_B)

    # B: bit-identical to before (JSON floats round-trip exactly).
    assert after_b["choices"] == before_b["choices"]
    assert recorder.metadata[after_b["id"]]["sona"] == {"scope": scope_b, "adapter_version": 0, **gate}
    # A: served with the new adapter (the same prompt as the rated one: the gate lets it in), which
    # made the rated token more likely.
    seen = recorder.metadata[after_a["id"]]["sona"]
    assert seen["applied"] and seen["similarity"] == pytest.approx(1.0, abs=1e-3)
    assert seen["cluster"] == scope_a  # a score (no correction) teaches the scope's own adapter
    assert {k: seen[k] for k in ("scope", "adapter_version")} == {
        "scope": scope_a, "adapter_version": adapters[scope_a]["version"]}
    lp_before, lp_after = before_a["choices"][0]["logprobs"], after_a["choices"][0]["logprobs"]
    taught = lp_before["tokens"][0]
    assert lp_after["top_logprobs"][0][taught] > lp_before["token_logprobs"][0]
    assert lp_after["top_logprobs"][0] != lp_before["top_logprobs"][0]


def test_without_api_keys_requests_carry_no_key_id(model, recorder):
    with _serve(model) as server:
        out = _complete(server, None)
        seen = recorder.metadata[out["id"]]
        assert "api_key_id" not in seen
        assert seen["sona"] == {"scope": "global", "adapter_version": 0, "applied": False, "similarity": None,
                                "cluster": None}
        fb = httpx.post(server.url("/v1/feedback"), json={"response_id": out["id"], "score": 1.0}, timeout=60)
        assert fb.status_code == 200, fb.text
        assert fb.json()["scope"] == "global"
        assert [a["scope"] for a in _stats(server, None)["adapters"]] == ["global"]
