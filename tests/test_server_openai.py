"""The official ``openai`` client against a live server (SmolLM2 on the candle-compat backend):
chat and completions, streaming and not, sync and async, n, stop, seed, logprobs, usage with
cached tokens, models, embeddings, tokenizer routes, metrics, request ids, disconnects.

Greedy outputs, logprobs and embeddings are checked against HF transformers on the same GGUF.
"""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import numpy as np
import openai
import pytest
from _hf_reference import hf_greedy, hf_logits, hf_model
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_model):  # noqa: F811
    with live_server(smollm2_model) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(smollm2_model):  # noqa: F811
    return smollm2_model.tokenizer


def _until_eos(ids: list[int], eos: tuple[int, ...]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return ids


def test_chat_greedy_matches_reference(client, tokenizer, smollm2_path) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    prompt = tokenizer.encode_chat(QUESTION)
    ref = hf_greedy(smollm2_path, prompt, 8)
    expected = _until_eos(ref, tokenizer.eos_token_ids)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(expected)
    assert choice.finish_reason == ("stop" if len(expected) < 8 else "length")
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == min(len(expected) + 1, 8)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == MODEL and r.id.startswith("chatcmpl-") and r.object == "chat.completion"


def test_chat_stream_equals_non_stream(client) -> None:
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.id == chunks[0].id for c in chunks)


def test_completions_greedy_matches_reference_streamed_or_not(client, tokenizer, smollm2_path) -> None:
    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    expected = tokenizer.decode(hf_greedy(smollm2_path, ids, 8))
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 8)
    stream = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected


def test_completions_batch_of_prompts(client) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt=["Once upon a time", "1, 2, 3,"],
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 6
    assert all(c.finish_reason == "length" and c.text for c in r.choices)


def test_async_client_concurrent_and_streaming(server) -> None:
    async def go() -> tuple[list[str], str]:
        aclient = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)
        async with aclient:
            results = await asyncio.gather(
                *[
                    aclient.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"Say {w}"}], max_tokens=4, temperature=0
                    )
                    for w in ("hi", "yes", "no")
                ]
            )
            stream = await aclient.completions.create(
                model=MODEL, prompt="Hello", max_tokens=4, temperature=0, stream=True
            )
            text = "".join([c.choices[0].text async for c in stream if c.choices])
        return [r.choices[0].message.content for r in results], text

    texts, streamed = asyncio.run(go())
    assert len(texts) == 3 and all(isinstance(t, str) and t for t in texts)
    assert streamed


def test_n_choices(client, tokenizer) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=5, n=2, temperature=1.0, seed=7, logprobs=True
    )
    assert [c.index for c in r.choices] == [0, 1]
    # The prompt is counted once; completion tokens add up over the choices.
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(QUESTION))
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    assert all(1 <= len(c.logprobs.content) <= 5 for c in r.choices)


def test_stop_string_ends_the_choice(client) -> None:
    base = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    stop = text.strip().split()[0] if text.strip() else text
    assert stop, text
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_seed_reproducibility(client) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(
            model=MODEL, prompt="My favourite animal is", max_tokens=4, temperature=1.5, seed=seed
        )
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in range(1, 8))


def test_chat_logprobs(client) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content[:1])


def test_completion_logprobs_match_reference(client, tokenizer, smollm2_path) -> None:
    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    logits = hf_logits(smollm2_path, ids)[-1].astype(np.float64)
    ref = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    first = int(np.argmax(ref))
    assert lp.tokens[0] == tokenizer.decode([first])
    assert lp.token_logprobs[0] == pytest.approx(ref[first], abs=5e-3)
    top_ids = np.argsort(-ref)[:2]
    assert set(lp.top_logprobs[0]) == {tokenizer.decode([int(t)]) for t in top_ids}
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def _hf_prompt_logprobs(path, ids: list[int]) -> np.ndarray:
    """float64 log-softmax of HF transformers' logits at every prompt position."""
    x = hf_logits(path, ids).astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_echo_with_logprobs_scores_the_prompt_like_the_legacy_api(client, tokenizer, smollm2_path) -> None:
    """lm-evaluation-harness's log-likelihood request: echo + logprobs returns every prompt token's
    logprob (None for the first) before the completion's, against HF transformers. Sent twice, so the
    second time the prompt's blocks are in the prefix cache and must be recomputed anyway."""
    text = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid."
    ids = tokenizer.encode(text, add_special_tokens=False)
    ref = _hf_prompt_logprobs(smollm2_path, ids)
    for _ in range(2):
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(tokenizer.decode(ids))
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
        want = [ref[i - 1, ids[i]] for i in range(1, len(ids))]
        np.testing.assert_allclose(lp.token_logprobs[1 : len(ids)], want, rtol=0, atol=5e-3)
        assert lp.text_offset[: 3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
        best = [tokenizer.decode([int(np.argmax(ref[i - 1]))]) for i in range(1, len(ids))]
        assert [next(iter(t)) for t in lp.top_logprobs[1 : len(ids)]] == best
    # The log-likelihood of a continuation is the sum over its tokens: " Madrid." given the rest.
    assert r.usage.prompt_tokens == len(ids)


def test_vllm_prompt_logprobs(client, tokenizer, smollm2_path) -> None:
    ids = tokenizer.encode("Water boils at one hundred degrees", add_special_tokens=False)
    ref = _hf_prompt_logprobs(smollm2_path, ids)
    r = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry = plp[i]
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(ref[i - 1, ids[i]], abs=5e-3)
        row, mine = ref[i - 1], ref[i - 1, ids[i]]  # rank within what float32 ties allow
        assert 1 + np.count_nonzero(row > mine + 1e-3) <= own["rank"] <= 1 + np.count_nonzero(row > mine - 1e-3)
        top = np.argsort(-ref[i - 1])[:2]
        assert {int(k) for k in entry} == {ids[i], *map(int, top)}
        assert entry[str(int(top[0]))]["rank"] == 1
        assert own["decoded_token"] == tokenizer.decode([ids[i]])
    # Not streamed: a clear 400 naming the parameter.
    with pytest.raises(openai.BadRequestError, match="not streamed"):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 21})


def test_usage_reports_cached_prefix_tokens(client) -> None:
    system = "You are a careful assistant. " * 12  # a long shared prefix: several full KV blocks

    def ask(q: str):
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
            max_tokens=2,
            temperature=0,
        )

    first = ask("Name a colour.")
    second = ask("Name a fruit.")
    assert first.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= second.usage.prompt_tokens
    assert cached >= 64


def test_models_list_and_retrieve(client) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def _hf_embedding(path, ids: list[int]) -> np.ndarray:
    import torch

    model = hf_model(path)
    with torch.no_grad():
        h = model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    v = h.mean(axis=0)
    return v / np.linalg.norm(v)


def test_embeddings_match_reference(client, server, tokenizer, smollm2_path) -> None:
    texts = ["The cat sat on the mat.", "Stock markets fell sharply today, analysts said."]
    r = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1]
    ids = [tokenizer.encode(t) for t in texts]
    assert r.usage.prompt_tokens == sum(len(i) for i in ids)
    for d, tok in zip(r.data, ids, strict=True):
        got = np.asarray(d.embedding, dtype=np.float64)
        assert got.shape == (576,)
        assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-5)
        ref = _hf_embedding(smollm2_path, tok)
        np.testing.assert_allclose(got, ref, atol=2e-3)
    # Float format over plain HTTP, one input alone: the same vector as in the batch.
    body = httpx.post(
        server.url("/v1/embeddings"), json={"model": MODEL, "input": texts[1], "encoding_format": "float"}, timeout=60
    ).json()
    np.testing.assert_allclose(body["data"][0]["embedding"], r.data[1].embedding, atol=1e-5)
    b64 = httpx.post(
        server.url("/v1/embeddings"), json={"model": MODEL, "input": [ids[0]], "encoding_format": "base64"}, timeout=60
    ).json()
    raw = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(raw, r.data[0].embedding, atol=1e-6)


def test_tokenize_detokenize_round_trip(server, tokenizer) -> None:
    text = "Hello, world! Ünïcödé ✓"
    t = httpx.post(server.url("/tokenize"), json={"model": MODEL, "prompt": text}).json()
    assert t["tokens"] == tokenizer.encode(text) and t["count"] == len(t["tokens"])
    assert t["max_model_len"] > 0
    d = httpx.post(server.url("/detokenize"), json={"model": MODEL, "tokens": t["tokens"]}).json()
    assert d["prompt"] == tokenizer.decode(t["tokens"])
    chat = httpx.post(server.url("/tokenize"), json={"messages": QUESTION}).json()
    assert chat["tokens"] == tokenizer.encode_chat(QUESTION)


def test_content_parts_render_like_a_plain_string(server) -> None:
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    as_parts = httpx.post(server.url("/tokenize"), json={"messages": [{"role": "user", "content": parts}]}).json()
    plain = httpx.post(server.url("/tokenize"), json={"messages": QUESTION}).json()
    assert as_parts["tokens"] == plain["tokens"]


def test_logit_bias_and_top_k_reach_the_sampler(client, tokenizer) -> None:
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0, logit_bias={str(forced): 100}
    )
    assert r.choices[0].text == tokenizer.decode([forced])
    greedy = client.completions.create(model=MODEL, prompt="Two plus two is", max_tokens=3, temperature=0)
    top1 = client.completions.create(
        model=MODEL, prompt="Two plus two is", max_tokens=3, temperature=1.5, seed=3, extra_body={"top_k": 1}
    )
    assert top1.choices[0].text == greedy.choices[0].text


def test_request_id_echoed_or_generated(server) -> None:
    r = httpx.get(server.url("/v1/models"), headers={"X-Request-ID": "trace-abc.123"})
    assert r.headers["x-request-id"] == "trace-abc.123"
    r = httpx.get(server.url("/v1/models"))
    assert len(r.headers["x-request-id"]) == 32
    r = httpx.get(server.url("/v1/models"), headers={"X-Request-ID": "bad id with spaces"})
    assert r.headers["x-request-id"] != "bad id with spaces"


def test_openapi_schema(server) -> None:
    schema = httpx.get(server.url("/schema/openapi.json")).json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/tokenize"):
        assert path in schema["paths"]
    assert "ChatCompletionRequest" in str(schema["components"]["schemas"])


def test_health_and_ready(server) -> None:
    """``/health`` answers the RuvLLM MVP's figures, and they move as requests are served."""
    before = httpx.get(server.url("/health")).json()
    assert set(before) == {"status", "uptime_seconds", "total_requests", "cache_hit_rate", "memory_usage_mb"}
    assert before["status"] == "ok" and before["memory_usage_mb"] > 50 and 0 <= before["cache_hit_rate"] <= 1
    prompt = "Tell me about the history of the printing press in Europe, from Gutenberg onward. " * 4
    for _ in range(2):  # the second finds the first's prompt blocks in the prefix cache
        r = httpx.post(server.url("/v1/completions"), json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200
    after = httpx.get(server.url("/health")).json()
    assert after["total_requests"] == before["total_requests"] + 2
    assert after["uptime_seconds"] > before["uptime_seconds"]
    assert after["cache_hit_rate"] > 0
    ready = httpx.get(server.url("/ready"))
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def _finished_aborts(server) -> float:
    for fam in text_string_to_metric_families(httpx.get(server.url("/metrics")).text):
        if fam.name == "ruvllm_request_finished":
            return sum(
                s.value for s in fam.samples if s.name.endswith("_total") and s.labels["finish_reason"] == "abort"
            )
    return 0.0


def test_disconnect_mid_stream_aborts_the_request(server) -> None:
    before = _finished_aborts(server)
    body = {
        "model": MODEL,
        "prompt": "A long story about a dragon:",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
        assert r.status_code == 200
        # One content type, the one SSE clients check for (httpx-sse refuses any other).
        assert r.headers.get_list("content-type") == ["text/event-stream; charset=utf-8"]
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert first.startswith("data: {")
    # Leaving the block closed the connection; the engine request must end as an abort, soon.
    deadline = time.monotonic() + 60
    while _finished_aborts(server) < before + 1:
        assert time.monotonic() < deadline, "the engine request was not aborted"
        time.sleep(0.2)
    stats = server.state.engine.stats()
    deadline = time.monotonic() + 30
    while stats.running or stats.blocks_used:
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
        stats = server.state.engine.stats()


def test_disconnect_before_non_streamed_answer_aborts(server) -> None:
    before = _finished_aborts(server)
    body = {"model": MODEL, "prompt": "A long story about a castle:", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 60
    while _finished_aborts(server) < before + 1:
        assert time.monotonic() < deadline, "the engine request was not aborted"
        time.sleep(0.2)


def test_metrics_scrape(server, client) -> None:
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0)
    text = httpx.get(server.url("/metrics")).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    reqs = fams["ruvllm_http_requests"]
    chat_ok = [
        s
        for s in reqs.samples
        if s.name == "ruvllm_http_requests_total"
        and s.labels == {"route": "/v1/chat/completions", "method": "POST", "status": "200"}
    ]
    assert chat_ok and chat_ok[0].value >= 1
    ttft = {s.name: s.value for s in fams["ruvllm_time_to_first_token_seconds"].samples}
    assert ttft["ruvllm_time_to_first_token_seconds_count"] >= 1
    assert {s.name: s.value for s in fams["ruvllm_inter_token_latency_seconds"].samples}[
        "ruvllm_inter_token_latency_seconds_count"
    ] >= 1
    assert fams["ruvllm_e2e_request_latency_seconds"].samples
    assert fams["ruvllm_kv_blocks_total"].samples[0].value == 512
    assert fams["ruvllm_prompt_tokens"].samples[0].value > 0
    assert fams["ruvllm_generation_tokens"].samples[0].value > 0
    for name in (
        "ruvllm_kv_blocks_used",  # its value: test_kv_blocks_used_counts_a_running_request
        "ruvllm_num_requests_running",
        "ruvllm_num_requests_waiting",
        "ruvllm_preemptions",
        "ruvllm_prefix_cache_hit_tokens",
        "ruvllm_server_requests_in_flight",
    ):
        assert name in fams, name


def test_kv_blocks_used_counts_a_running_request(server, tokenizer) -> None:
    """While a request streams, the gauge counts at least the blocks its prompt fills; once it has
    ended (aborted by the disconnect), the engine holds none and the gauge reads 0 again."""

    def blocks_used() -> float:
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url("/metrics")).text)}
        return fams["ruvllm_kv_blocks_used"].samples[0].value

    prompt = "A long story about a castle, told slowly, chapter by chapter:"
    block_size = server.state.engine.stats().block_size
    prompt_blocks = -(-len(tokenizer.encode(prompt)) // block_size)  # ceil: a partly filled block is held too
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the request is running
        running = blocks_used()
        # The gauge is the engine's last published count: on a loaded machine the first read can
        # precede it. Read again as the stream goes on (the request runs for 400 tokens).
        for line in lines:
            if running >= prompt_blocks or line == "data: [DONE]":
                break
            if line.startswith("data: "):
                running = blocks_used()
    assert running >= prompt_blocks >= 1
    deadline = time.monotonic() + 60
    while server.state.engine.stats().running or blocks_used():
        assert time.monotonic() < deadline, server.state.engine.stats()
        time.sleep(0.2)


def test_metrics_have_the_inference_extension_protocol_names(server, client) -> None:
    """Every metric the Gateway API Inference Extension's model-server protocol lists, under ruvllm's
    names and under the vLLM names routers scrape."""
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0)
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url("/metrics")).text)}
    for prefix in ("ruvllm_", "vllm:"):
        for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
            assert fams[prefix + name].type == "gauge", prefix + name
        assert 0.0 <= fams[prefix + "kv_cache_usage_perc"].samples[0].value <= 1.0
        (info,) = fams[prefix + "cache_config_info"].samples
        assert info.labels == {"block_size": "16", "num_gpu_blocks": "512"}
        (lora,) = fams[prefix + "lora_requests_info"].samples
        assert set(lora.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
        assert lora.value > 1.7e9  # a timestamp
    assert "vllm:gpu_cache_usage_perc" in fams
