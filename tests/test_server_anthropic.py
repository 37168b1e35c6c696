"""``/v1/messages`` (the Anthropic Messages API) through the ``anthropic`` SDK against SmolLM2: create
(equal to the chat path's answer), the event stream in Anthropic's order, stop sequences, a tool
round trip (streamed and not), structured output, count_tokens, thinking blocks from the reasoning
parser, x-api-key authentication, and bad input answered in Anthropic's error shape while the
server keeps serving."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2"
GREEDY = {"temperature": 0}  # the SDK takes no sampling fields any more: they go as extra_body
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_model):  # noqa: F811
    with live_server(smollm2_model) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def create(client: anthropic.Anthropic, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("max_tokens", 12)
    return client.messages.create(extra_body=GREEDY, **kw)


# --- create and stream ---------------------------------------------------------------------------


def test_create_answers_as_the_chat_path_does(server, client):
    history = [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": [{"type": "text", "text": "An apple."}]},
        {"role": "user", "content": [{"type": "text", "text": "And a vegetable?"}]},
    ]
    m = create(client, system="You are terse.", messages=history)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    chat = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
    same = chat.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": "An apple."},
            {"role": "user", "content": "And a vegetable?"},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert m.content[0].text == same.choices[0].message.content
    assert m.usage.output_tokens == same.usage.completion_tokens
    # Anthropic's input is the prompt split into what the prefix cache held and what it did not.
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == same.usage.prompt_tokens


def test_max_tokens_ends_the_message_with_max_tokens(client):
    m = create(client, messages=[{"role": "user", "content": "Count to one hundred."}], max_tokens=3)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_stream_sends_anthropics_event_sequence(server, client):
    kw = dict(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "Say hello."}])
    plain = client.messages.create(extra_body=GREEDY, **kw)
    # On the wire (the SDK drops pings): every event's name line matches its data's type.
    with httpx.stream("POST", server.url("/v1/messages"), json={**kw, **GREEDY, "stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    assert [json.loads(line.removeprefix("data: "))["type"] for line in lines[1::2]] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    with client.messages.stream(extra_body=GREEDY, **kw) as stream:
        events = [e for e in stream if e.type != "text"]  # "text" is the SDK's own convenience event
        final = stream.get_final_message()
    assert [e.type for e in events] == [n for n in names if n != "ping"]
    start = events[0].message
    assert start.id == final.id and start.content == [] and start.stop_reason is None
    assert start.usage.input_tokens == plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    assert events[1].index == 0 and events[1].content_block.type == "text"
    assert "".join(e.delta.text for e in events[2:-3]) == final.content[0].text == plain.content[0].text
    assert events[-2].delta.stop_reason == final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_stop_sequences_stop_with_the_sequence_named(client):
    prompt = [{"role": "user", "content": "Write one sentence about the sea."}]
    whole = create(client, messages=prompt, max_tokens=16).content[0].text
    word = whole.split()[2]
    m = create(client, messages=prompt, max_tokens=16, stop_sequences=["zzzz", word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert m.content[0].text == whole[: whole.index(word)]
    with client.messages.stream(
        model=MODEL, max_tokens=16, messages=prompt, stop_sequences=[word], extra_body=GREEDY
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word


# --- tools ----------------------------------------------------------------------------------------


def test_tool_round_trip(client):
    m = create(
        client, messages=ASK, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=40
    )
    assert m.stop_reason == "tool_use"
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    followup = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]},
    ]
    answer = create(client, messages=followup, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=16)
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")
    # The tool result is in the prompt: the count grows by it.
    without = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER])
    assert client.messages.count_tokens(model=MODEL, messages=followup, tools=[WEATHER]).input_tokens > (
        without.input_tokens
    )


def test_tool_use_streams_as_input_json_deltas(client):
    kw = dict(model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"})
    plain = client.messages.create(extra_body=GREEDY, **kw)
    with client.messages.stream(extra_body=GREEDY, **kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]
    assert starts[0].content_block.name == "get_weather" and starts[0].content_block.input == {}
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    (call,) = [b for b in plain.content if b.type == "tool_use"]
    assert json.loads(partial) == call.input == final.content[-1].input
    assert final.stop_reason == plain.stop_reason == "tool_use"


def test_structured_output_follows_the_schema(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    m = create(client, messages=ASK, max_tokens=40, output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_count_tokens_is_the_prompt_the_message_runs(client):
    kw = dict(system="Be brief.", messages=ASK, tools=[WEATHER])
    counted = client.messages.count_tokens(model=MODEL, **kw).input_tokens
    m = create(client, max_tokens=2, **kw)
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens < counted


# --- bad input ------------------------------------------------------------------------------------


def _error(r: httpx.Response, status: int, kind: str, *words: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["request_id"], body
    for w in words:
        assert w in body["error"]["message"], body


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": MODEL, "messages": ASK}, ["max_tokens"]),  # missing
        ({"model": MODEL, "max_tokens": "ten", "messages": ASK}, ["max_tokens", "int"]),  # wrong type
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": 3}]}, ["messages"]),
        (
            {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            ["messages.0.content.0.type", "image"],
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}],
            },
            ["messages.0.content.0.tool_use_id", "toolu_1"],
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                    {"role": "user", "content": "and?"},
                ],
            },
            ["messages.2", "t1"],
        ),
        ({"model": MODEL, "max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": "It"}]}, ["prefill"]),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305"}]}, ["tools.0"]),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, ["tool_choice"]),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK, "mcp_servers": []}, ["mcp_servers"]),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK, "metadata": {"x": 1}}, ["metadata.x"]),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK, "temperature": 1.5}, ["temperature"]),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK, "stop_sequences": [""]}, ["stop_sequences"]),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": ASK,
                "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}},
            },
            ["output_config.format"],
        ),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK, "output_config": {"effort": "high"}}, ["effort"]),
        (
            {"model": MODEL, "max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 9}},
            ["thinking.budget_tokens", "max_tokens"],
        ),
    ],
)
def test_bad_input_is_a_400_in_anthropics_shape(server, body, words):
    for stream in (False, True):
        r = httpx.post(server.url("/v1/messages"), json={**body, "stream": stream}, timeout=60)
        _error(r, 400, "invalid_request_error", *words)


def test_an_unknown_model_is_not_found(server, client):
    with pytest.raises(anthropic.NotFoundError) as e:
        create(client, model="claude-nope", messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-nope" in e.value.body["error"]["message"]
    r = httpx.post(server.url("/v1/messages/count_tokens"), json={"model": "claude-nope", "messages": ASK})
    _error(r, 404, "not_found_error", "claude-nope")
    assert create(client, messages=ASK, max_tokens=2).content  # and the server goes on


def _finished_aborts(server) -> float:
    text = httpx.get(server.url("/metrics")).text
    for fam in text_string_to_metric_families(text):
        if fam.name == "ruvllm_request_finished":
            return sum(
                s.value for s in fam.samples if s.name.endswith("_total") and s.labels["finish_reason"] == "abort"
            )
    return 0.0


def test_a_dropped_stream_aborts_its_request(server, client):
    before = _finished_aborts(server)
    body = {"model": MODEL, "max_tokens": 400, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}  # fmt: skip
    with httpx.stream("POST", server.url("/v1/messages"), json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        next(line for line in r.iter_lines() if line == "event: content_block_delta")
    deadline = time.monotonic() + 60
    while _finished_aborts(server) < before + 1:
        assert time.monotonic() < deadline, "the engine request was not aborted"
        time.sleep(0.2)
    stats = server.state.engine.stats()
    while stats.running or stats.blocks_used:
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
        stats = server.state.engine.stats()
    assert create(client, messages=ASK, max_tokens=2).content


def test_a_client_gone_before_the_answer_aborts_its_request(server):
    before = _finished_aborts(server)
    body = {"model": MODEL, "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story about a castle."}]}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/messages"), json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 60
    while _finished_aborts(server) < before + 1:
        assert time.monotonic() < deadline, "the engine request was not aborted"
        time.sleep(0.2)


# --- servers of their own: thinking, API keys -----------------------------------------------------


def test_thinking_blocks_come_from_the_reasoning_parser(smollm2_model):  # noqa: F811
    # deepseek_r1 reads the output as begun inside <think>: SmolLM2 never closes it, so all of it is
    # thinking and there is no text.
    with live_server(smollm2_model, reasoning_parser="deepseek_r1") as srv:
        client = anthropic.Anthropic(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)
        m = create(client, messages=ASK, max_tokens=8)
        assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking
        with client.messages.stream(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY) as stream:
            events = list(stream)
            final = stream.get_final_message()
        deltas = "".join(e.delta.thinking for e in events if e.type == "content_block_delta")
        assert deltas == m.content[0].thinking == final.content[0].thinking
        hidden = create(client, messages=ASK, max_tokens=8, thinking={"type": "disabled"})
        assert hidden.content == [] and hidden.usage.output_tokens == 8


def test_x_api_key_authenticates_beside_bearer(smollm2_model):  # noqa: F811
    with live_server(smollm2_model, api_keys=["sk-anthropic"]) as srv:
        by_key = anthropic.Anthropic(base_url=srv.base_url, api_key="sk-anthropic", max_retries=0)
        assert create(by_key, messages=ASK, max_tokens=2).content
        by_token = anthropic.Anthropic(base_url=srv.base_url, auth_token="sk-anthropic", max_retries=0)
        assert by_token.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
        wrong = anthropic.Anthropic(base_url=srv.base_url, api_key="sk-wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            create(wrong, messages=ASK)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
        r = httpx.post(srv.url("/v1/messages"), json={"model": MODEL, "max_tokens": 2, "messages": ASK})
        _error(r, 401, "authentication_error", "x-api-key")


def test_a_failure_mid_stream_is_an_error_event():
    import asyncio

    import msgspec

    from ruvllm_server.anthropic.events import MessageEvents, message_events
    from ruvllm_server.anthropic.translate import chat_request
    from ruvllm_server.anthropic.wire import MessagesRequest

    choice = {"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}
    chunk = {"id": "c", "created": 0, "model": MODEL, "object": "chat.completion.chunk", "choices": [choice]}
    failure = {"error": {"message": "the engine failed", "type": "server_error", "param": None, "code": None}}

    async def chat_stream():
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        yield b"data: " + json.dumps(failure).encode() + b"\n\ndata: [DONE]\n\n"

    async def collect() -> list[bytes]:
        request = msgspec.convert({"model": MODEL, "max_tokens": 5, "messages": ASK}, MessagesRequest)
        events = MessageEvents(chat_request(request), "msg_1", 7)
        return [piece async for piece in message_events(chat_stream(), events, lambda: None)]

    text = b"".join(asyncio.run(collect())).decode()
    names = [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "error"]
    last = json.loads(text.strip().splitlines()[-1].removeprefix("data: "))
    assert last == {"type": "error", "error": {"type": "api_error", "message": "the engine failed"}}
