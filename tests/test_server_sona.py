"""``sona=True``: the server attaches SONA to the model, mounts /v1/feedback and /v1/sona/stats
behind its own middleware, and feedback on a served completion (by its response id) is applied."""

from __future__ import annotations

import httpx
import openai
import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)

pytest.importorskip("ruvllm_sona")

MODEL = "smollm2"
KEY = "sk-sona-test"


@pytest.fixture(scope="module")
def server(smollm2_model):  # noqa: F811
    from ruvllm_sona import plugin

    with live_server(smollm2_model, sona=True, api_keys=[KEY], num_kv_blocks=64) as srv:
        assert plugin.active() is not None
        yield srv
    assert plugin.active() is None  # detached at shutdown


def test_feedback_on_a_served_completion(server) -> None:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=3, temperature=0
    )
    auth = {"Authorization": f"Bearer {KEY}"}
    fb = httpx.post(server.url("/v1/feedback"), json={"response_id": r.id, "score": 1.0}, headers=auth, timeout=60)
    assert fb.status_code == 200, fb.text
    assert fb.json()["response_id"] == r.id and fb.json()["status"] in ("applied", "queued")
    stats = httpx.get(server.url("/v1/sona/stats"), headers=auth, timeout=60)
    assert stats.status_code == 200 and stats.json()["counters"]["feedback"] == 1
    # The SONA routes sit behind the server's middleware: no key, no access.
    assert httpx.get(server.url("/v1/sona/stats")).status_code == 401
    unknown = httpx.post(server.url("/v1/feedback"), json={"response_id": "chatcmpl-nope", "score": 0.5}, headers=auth)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "response_id"
    # Generation still works with the adapter SONA now applies.
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=3, temperature=0
    )
    assert again.usage.completion_tokens >= 1
