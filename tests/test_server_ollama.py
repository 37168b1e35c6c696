"""Ollama's API (``/api/*``) through the ``ollama`` Python client against SmolLM2: chat and generate
(equal to the chat and completions paths' answers), NDJSON streams, options mapped to sampling,
``format``, tools, embed (equal to ``/v1/embeddings``), list, show, ps, version, ``name:tag`` names,
and bad input answered in Ollama's error shape while the server keeps serving."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import ollama
import openai
import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)

from ruvllm_server import __version__

MODEL = "smollm2"
GREEDY = {"temperature": 0, "num_predict": 10}
HELLO = [{"role": "user", "content": "Say hello."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
#: Steers SmolLM2 into writing a call as the json tool parser reads it (it calls no tool unasked).
CALL_SHAPE = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER["function"]["parameters"]},
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
EMBED_LIMIT = 16


@pytest.fixture(scope="module")
def server(smollm2_model):  # noqa: F811
    with live_server(smollm2_model, embedding_max_tokens=EMBED_LIMIT) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=300)


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)


# --- chat and generate -----------------------------------------------------------------------------


def test_chat_answers_as_the_chat_path_does(client, oai):
    r = client.chat(model=MODEL, messages=HELLO, options=GREEDY)
    same = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10, temperature=0)
    assert r.message.role == "assistant" and r.message.content == same.choices[0].message.content
    assert r.done and r.done_reason == "length" and r.model == MODEL
    assert r.prompt_eval_count == same.usage.prompt_tokens and r.eval_count == same.usage.completion_tokens == 10
    assert r.load_duration == 0 and r.total_duration >= r.prompt_eval_duration + r.eval_duration > 0
    lp = client.chat(model=MODEL, messages=HELLO, options=GREEDY, logprobs=True, top_logprobs=2)
    assert len(lp.logprobs) == 10 and all(len(t.top_logprobs) == 2 for t in lp.logprobs)
    assert all(t.logprob == max(a.logprob for a in t.top_logprobs) for t in lp.logprobs)  # greedy: each the best
    parts = list(client.chat(model=MODEL, messages=HELLO, options=GREEDY, logprobs=True, stream=True))
    assert [t.logprob for p in parts for t in p.logprobs or ()] == [t.logprob for t in lp.logprobs]


def test_chat_streams_ndjson_lines(server, client):
    whole = client.chat(model=MODEL, messages=HELLO, options=GREEDY)
    parts = list(client.chat(model=MODEL, messages=HELLO, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].prompt_eval_count == whole.prompt_eval_count
    body = {"model": MODEL, "messages": HELLO, "options": GREEDY}  # stream is Ollama's default
    with httpx.stream("POST", server.url("/api/chat"), json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) == len(parts) and lines[-1]["done"] is True


def test_generate_templated_and_raw(client, oai):
    prompt = "The capital of France is"
    chat = client.chat(model=MODEL, messages=[{"role": "user", "content": prompt}], options=GREEDY)
    g = client.generate(model=MODEL, prompt=prompt, options=GREEDY)
    assert g.response == chat.message.content and g.done_reason == "length"
    raw = client.generate(model=MODEL, prompt=prompt, raw=True, options=GREEDY)
    same = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert raw.response == same.choices[0].text and raw.prompt_eval_count == same.usage.prompt_tokens
    streamed = list(client.generate(model=MODEL, prompt=prompt, raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].done
    system = client.generate(model=MODEL, prompt=prompt, system="Answer in French.", options=GREEDY)
    turns = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": prompt}]
    with_system = client.chat(model=MODEL, messages=turns, options=GREEDY)
    assert system.response == with_system.message.content and system.prompt_eval_count == with_system.prompt_eval_count


def test_an_empty_request_answers_that_the_model_is_loaded(client):
    assert client.generate(model=MODEL).done_reason == "load"
    assert client.chat(model=f"{MODEL}:latest", messages=[]).done_reason == "load"


# --- options and format ----------------------------------------------------------------------------


def test_options_map_to_sampling(client):
    whole = client.chat(model=MODEL, messages=HELLO, options=GREEDY).message.content
    word = whole.split()[1]
    cut = client.chat(model=MODEL, messages=HELLO, options={**GREEDY, "stop": [word]})
    assert cut.message.content == whole[: whole.index(word)] and cut.done_reason == "stop"
    # top_k 1 is greedy whatever the temperature; a seed makes sampling repeat.
    top1 = client.chat(model=MODEL, messages=HELLO, options={"temperature": 1.5, "top_k": 1, "num_predict": 10})
    assert top1.message.content == whole
    seeded = {"temperature": 1.0, "seed": 7, "num_predict": 10, "top_p": 0.9, "repeat_penalty": 1.1}
    assert client.chat(model=MODEL, messages=HELLO, options=seeded).message.content == (
        client.chat(model=MODEL, messages=HELLO, options=seeded).message.content
    )
    # num_ctx bounds the request: what the prompt leaves is all it may generate.
    prompt_len = client.chat(model=MODEL, messages=HELLO, options={"num_predict": 1}).prompt_eval_count
    short = client.chat(model=MODEL, messages=HELLO, options={"temperature": 0, "num_ctx": prompt_len + 3})
    assert short.eval_count == 3 and short.done_reason == "length"


def test_format_json_and_schema(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    msg = [{"role": "user", "content": "Name a city in Italy, as JSON."}]
    r = client.chat(model=MODEL, messages=msg, format=schema, options={"temperature": 0, "num_predict": 30})
    jsonschema.validate(json.loads(r.message.content), schema)
    g = client.generate(model=MODEL, prompt="A JSON object with a key a:", format="json", options={"num_predict": 30})
    assert g.done_reason == "length" or isinstance(json.loads(g.response), dict)


def test_tools_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, tools=[WEATHER], format=CALL_SHAPE, options={"temperature": 0, "num_predict": 40})
    r = client.chat(messages=ask, **kw)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and r.message.content == "" and r.done_reason == "stop"
    jsonschema.validate(dict(call.function.arguments), WEATHER["function"]["parameters"])
    parts = list(client.chat(messages=ask, stream=True, **kw))
    streamed = [c for p in parts for c in p.message.tool_calls or ()]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [
        (call.function.name, dict(call.function.arguments))
    ]
    followup = [
        *ask,
        {"role": "assistant", "content": "", "tool_calls": [{"function": call.function.model_dump()}]},
        {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 21 C"},
    ]
    answer = client.chat(model=MODEL, messages=followup, tools=[WEATHER], options=GREEDY)
    assert answer.message.content and not answer.message.tool_calls


# --- embed and the model routes --------------------------------------------------------------------


def test_embed_equals_the_openai_route(client, oai):
    texts = ["A cat sat on the mat.", "Paris is in France."]
    r = client.embed(model=MODEL, input=texts)
    same = oai.embeddings.create(model=MODEL, input=texts)
    assert r.embeddings == [d.embedding for d in same.data] and r.prompt_eval_count == same.usage.prompt_tokens
    assert len(client.embed(model=f"{MODEL}:latest", input="one").embeddings) == 1
    long = " ".join(["word"] * 40)
    cut = client.embed(model=MODEL, input=long)  # truncate is Ollama's default: cut to the limit
    assert cut.prompt_eval_count == EMBED_LIMIT
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=MODEL, input=long, truncate=False)
    assert e.value.status_code == 400 and str(EMBED_LIMIT) in e.value.error


def test_embed_on_an_embedding_model_server(tmp_path):
    from _embedding_fixtures import write_bert_embedder

    from ruvllm.embedding import load_embedding_model

    model = load_embedding_model(
        str(write_bert_embedder(tmp_path / "bert", max_seq_length=32)), backend="candle-compat"
    )
    with live_server(model, served_model_name="emb") as srv:
        client = ollama.Client(host=srv.base_url, timeout=300)
        oai = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0)
        texts = ["the quick brown fox", "paris is the capital city of france"]
        r = client.embed(model="emb:latest", input=texts)
        same = oai.embeddings.create(model="emb", input=texts)
        assert r.embeddings == [d.embedding for d in same.data] and r.prompt_eval_count == same.usage.prompt_tokens
        long = " ".join(["dog"] * 80)
        assert client.embed(model="emb", input=long).prompt_eval_count == 32  # cut to the model's limit
        with pytest.raises(ollama.ResponseError) as e:
            client.embed(model="emb", input=long, truncate=False)
        assert e.value.status_code == 400 and "32" in e.value.error


def test_list_show_ps_version(server, client, smollm2_path):
    (m,) = client.list().models
    assert m.model == f"{MODEL}:latest" and m.size == smollm2_path.stat().st_size
    assert (m.details.format, m.details.family, m.details.quantization_level) == ("gguf", "llama", "Q4_1")
    assert m.details.parameter_size == "135M"
    shown = client.show(MODEL)
    assert {"completion", "embedding", "tools"} <= set(shown.capabilities)
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.context_length"] == 8192
    assert shown.template == server.state.tokenizer.chat_template
    (p,) = client.ps().models
    assert p.model == f"{MODEL}:latest" and p.context_length == server.state.max_context
    assert p.size > server.state.engine.engine.kv_cache_bytes and p.size_vram == 0 and p.expires_at is None
    assert httpx.get(server.url("/api/version")).json() == {"version": __version__}


def _random_adapter(path, config) -> str:
    """A rank-4 LoRA adapter on every layer's q_proj, in peft's file layout, with random factors."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    out, hidden, r = config.num_heads * config.head_dim, config.hidden_size, 4
    tensors = {}
    for i in range(config.num_layers):
        name = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        tensors[f"{name}.lora_A.weight"] = rng.normal(0, 0.1, (r, hidden)).astype(np.float32)
        tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.1, (out, r)).astype(np.float32)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj"], "task_type": "CAUSAL_LM"}
    (path / "adapter_config.json").write_text(json.dumps(conf))
    return str(path)


def test_every_dialect_answers_with_the_model_it_names(smollm2_model, tmp_path):  # noqa: F811
    # Two names served: the base model and a LoRA adapter on it. Each door answers a request with the
    # one it names, as the chat path does; an unknown name is each dialect's not-found.
    import anthropic

    adapter = _random_adapter(tmp_path / "french", smollm2_model.config)
    with live_server(smollm2_model, lora_modules=[f"french={adapter}"]) as srv:
        chat = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=300)
        claude = anthropic.Anthropic(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)
        local = ollama.Client(host=srv.base_url, timeout=300)
        answers = {}
        for name in (MODEL, "french"):
            want = chat.chat.completions.create(model=name, messages=HELLO, max_tokens=10, temperature=0)
            answers[name] = want.choices[0].message.content
            got = claude.messages.create(model=name, max_tokens=10, messages=HELLO, extra_body={"temperature": 0})
            assert got.content[0].text == answers[name] and got.model == name
            assert local.chat(model=f"{name}:latest", messages=HELLO, options=GREEDY).message.content == answers[name]
        assert answers[MODEL] != answers["french"]
        listed = {m.model: m.details.parent_model for m in local.list().models}
        assert listed == {f"{MODEL}:latest": "", "french:latest": f"{MODEL}:latest"}
        with pytest.raises(anthropic.NotFoundError):
            claude.messages.create(model="spanish", max_tokens=4, messages=HELLO)
        with pytest.raises(ollama.ResponseError) as e:
            local.chat(model="spanish", messages=HELLO)
        assert e.value.status_code == 404


def test_thinking_comes_from_the_reasoning_parser(smollm2_model):  # noqa: F811
    # deepseek_r1 reads the output as begun inside <think>: SmolLM2 never closes it, so all of it is
    # thinking and the content is empty.
    with live_server(smollm2_model, reasoning_parser="deepseek_r1") as srv:
        client = ollama.Client(host=srv.base_url, timeout=300)
        r = client.chat(model=MODEL, messages=HELLO, options=GREEDY, think=True)
        assert r.message.thinking and r.message.content == ""
        parts = list(client.chat(model=MODEL, messages=HELLO, options=GREEDY, think=True, stream=True))
        assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
        hidden = client.chat(model=MODEL, messages=HELLO, options=GREEDY, think=False)
        assert hidden.message.thinking is None and hidden.eval_count == 10
        assert "thinking" in client.show(MODEL).capabilities


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/api/chat", {"messages": HELLO}, 400, ["model"]),  # missing
        ("/api/chat", {"model": MODEL, "messages": "hi"}, 400, ["messages"]),  # wrong type
        ("/api/chat", {"model": "llama3:8b", "messages": HELLO}, 404, ["llama3:8b", "not found"]),
        ("/api/chat", {"model": f"{MODEL}:7b", "messages": HELLO}, 404, [f"{MODEL}:7b"]),
        ("/api/generate", {"model": "nope", "prompt": "x"}, 404, ["nope"]),
        ("/api/embed", {"model": "nope", "input": "x"}, 404, ["nope"]),
        ("/api/show", {"model": "nope"}, 404, ["nope"]),
        ("/api/chat", {"model": MODEL, "messages": [{"role": "tool", "content": "21 C"}]}, 400,
         ["tool", "messages[0]"]),
        ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400,
         ["images"]),
        ("/api/chat", {"model": MODEL, "messages": HELLO, "options": {"mirostat": 2}}, 400, ["options.mirostat"]),
        ("/api/chat", {"model": MODEL, "messages": HELLO, "options": {"num_gpu": 1}}, 400, ["options.num_gpu"]),
        ("/api/chat", {"model": MODEL, "messages": HELLO, "options": {"num_ctx": 10**6}}, 400, ["num_ctx"]),
        ("/api/chat", {"model": MODEL, "messages": HELLO, "options": {"temperature": "hot"}}, 400, ["temperature"]),
        ("/api/chat", {"model": MODEL, "messages": HELLO, "keep_alive": "soon"}, 400, ["keep_alive"]),
        ("/api/chat", {"model": MODEL, "messages": HELLO, "think": True}, 400, ["thinking"]),
        ("/api/chat", {"model": MODEL, "messages": HELLO, "format": "yaml"}, 400, ["format"]),
        ("/api/generate", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, ["suffix"]),
    ],
)  # fmt: skip
def test_bad_input_is_ollamas_error_shape(server, path, body, status, words):
    for stream in (False, True):
        r = httpx.post(server.url(path), json={**body, "stream": stream}, timeout=60)
        assert r.status_code == status, r.text
        error = r.json()
        assert set(error) == {"error"} and isinstance(error["error"], str)
        for w in words:
            assert w in error["error"], error


def test_client_errors_and_a_dropped_stream(server, client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=HELLO)
    assert e.value.status_code == 404
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "options": {"temperature": 0, "num_predict": 400}}  # fmt: skip
    with httpx.stream("POST", server.url("/api/chat"), json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line)
    stats = server.state.engine.stats()
    deadline = time.monotonic() + 60
    while stats.running or stats.blocks_used:  # the request was aborted, its blocks freed
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
        stats = server.state.engine.stats()
    assert client.chat(model=MODEL, messages=HELLO, options={"num_predict": 2}).eval_count == 2


def test_a_failure_mid_stream_is_an_error_line():
    import asyncio

    from ruvllm_server.ollama.stream import Parts, ndjson_lines
    from ruvllm_server.ollama.translate import Translated
    from ruvllm_server.schemas import ChatCompletionRequest, ChatMessage

    choice = {"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}
    chunk = {"id": "c", "created": 0, "model": MODEL, "object": "chat.completion.chunk", "choices": [choice]}
    failure = {"error": {"message": "the engine failed", "type": "server_error", "param": None, "code": None}}

    async def chat_stream():
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        yield b"data: " + json.dumps(failure).encode() + b"\n\ndata: [DONE]\n\n"

    async def collect() -> list[bytes]:
        chat = ChatCompletionRequest(model=MODEL, messages=[ChatMessage("user", "x")], stream=True)
        parts = Parts(Translated(chat, MODEL, None, True), generate=False)
        return [piece async for piece in ndjson_lines(chat_stream(), parts, lambda: None)]

    lines = [json.loads(line) for line in b"".join(asyncio.run(collect())).splitlines()]
    assert lines[0]["message"] == {"content": "Hi", "role": "assistant"} and lines[0]["done"] is False
    assert lines[1:] == [{"error": "the engine failed"}]
