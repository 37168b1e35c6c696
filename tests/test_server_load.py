"""200 concurrent streaming requests, every fifth dropped by its client after the first chunk: no
5xx, every finished stream ends with [DONE], no KV block leaks, and the server stays healthy."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2"
N_REQUESTS = 200


@pytest.fixture(scope="module")
def server(smollm2_model):  # noqa: F811
    with live_server(smollm2_model, num_kv_blocks=1024, max_num_seqs=64) as srv:
        yield srv


async def one_stream(client: httpx.AsyncClient, i: int) -> tuple[int, int, str | None, bool]:
    """``(status, data lines, last data line, dropped early)``."""
    if i % 2:
        path = "/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Item {i}: name a colour."}]}
    else:
        path = "/v1/completions"
        body = {"model": MODEL, "prompt": f"Item {i}: the colour is"}
    body.update(max_tokens=4, temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True})
    drop = i % 5 == 4
    lines = 0
    last = None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, 0, r.text, drop
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            lines += 1
            last = line
            if drop:
                break  # leaving the block closes the connection mid-stream
    return 200, lines, last, drop


@pytest.mark.slow
def test_200_concurrent_streams_with_disconnects(server) -> None:
    async def run_all() -> list[tuple[int, int, str | None, bool]]:
        limits = httpx.Limits(max_connections=N_REQUESTS + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=300) as client:
            return await asyncio.gather(*[one_stream(client, i) for i in range(N_REQUESTS)])

    results = asyncio.run(run_all())
    statuses = [r[0] for r in results]
    assert statuses == [200] * N_REQUESTS, [r for r in results if r[0] != 200][:3]
    for _, lines, last, dropped in results:
        if dropped:
            assert lines == 1
        else:
            assert last == "data: [DONE]", last
            assert lines >= 3  # role or first text, the usage chunk, [DONE]

    # Dropped requests are aborted in the engine; all KV blocks come back (prefix-cached blocks with
    # no reference count as free), nothing runs or waits, no admission slot is held.
    engine, admission = server.state.engine, server.state.admission
    deadline = time.monotonic() + 120
    while True:
        stats = engine.stats()
        if (stats.running, stats.waiting, stats.blocks_used, admission.running, admission.queued) == (0, 0, 0, 0, 0):
            break
        assert time.monotonic() < deadline, (stats, admission.running, admission.queued)
        time.sleep(0.2)

    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url("/metrics")).text)}
    statuses_seen = {s.labels["status"] for s in fams["ruvllm_http_requests"].samples if s.name.endswith("_total")}
    assert not any(s.startswith("5") for s in statuses_seen), statuses_seen
    finished = {
        s.labels["finish_reason"]: s.value for s in fams["ruvllm_request_finished"].samples if s.name.endswith("_total")
    }
    assert sum(finished.values()) == N_REQUESTS
    # Most dropped streams are still running when their client leaves (4 tokens is short, so a
    # few may finish first).
    assert finished.get("abort", 0) >= 1
    assert fams["ruvllm_kv_blocks_used"].samples[0].value == 0

    assert httpx.get(server.url("/health")).status_code == 200
    after = httpx.post(
        server.url("/v1/completions"),
        json={"model": MODEL, "prompt": "Still alive?", "max_tokens": 2, "ignore_eos": True},
        timeout=60,
    )
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2
