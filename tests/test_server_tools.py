"""Tool calling through the server with the openai SDK on SmolLM2: forced calls (a named function,
``required``) whose arguments validate against the function's schema, streamed calls that reassemble
into the non-streamed ones, ``auto`` parsed by the template's parser or a plugin's, a multi-turn
conversation with a tool result, and 400s naming the parameter."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from _server_fixtures import TIME, WEATHER, live_server, smollm2_model  # noqa: F401  (fixture)

MODEL = "smollm2"
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(smollm2_model):  # noqa: F811
    with live_server(smollm2_model) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)


def _streamed_calls(client, **kw) -> tuple[list[dict], str]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert slot["id"] is None, "the id comes once, first"
                    slot["id"] = d.id
                if d.function and d.function.name:
                    slot["name"] = d.function.name
                if d.function and d.function.arguments:
                    assert slot["name"] is not None, "the name comes before the arguments"
                    slot["arguments"] += d.function.arguments
            finish = c.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"], ids=["named", "required"]
)
def test_forced_calls_validate_and_stream_the_same(client, choice):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert msg.tool_calls and msg.content is None
    assert whole.choices[0].finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls")
    for call in msg.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id.startswith("call_")
    if isinstance(choice, dict):
        assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    streamed, finish = _streamed_calls(client, **kw)
    assert finish == whole.choices[0].finish_reason
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        (c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls
    ]


def test_required_without_parallel_calls_makes_exactly_one(client):
    whole = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris and the time in Tokyo?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    assert len(whole.choices[0].message.tool_calls) == 1


def test_auto_parses_a_call_written_in_the_json_format(client):
    # The output is steered into the call format (structured_outputs), the json parser reads it.
    call_shape = {
        "type": "object",
        "properties": {"name": {"const": "get_time"}, "arguments": SCHEMAS["get_time"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    kw = dict(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60, extra_body={"guided_json": call_shape}
    )
    whole = client.chat.completions.create(**kw)
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "get_time" and whole.choices[0].finish_reason == "tool_calls"
    streamed, finish = _streamed_calls(client, **kw)
    assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in streamed] == [
        (call.function.name, call.function.arguments)
    ]


def test_auto_plain_answer_stays_content(client):
    whole = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=TOOLS,
        temperature=0,
        max_tokens=20,
        extra_body={"guided_regex": "Hello[a-z !]{0,10}"},
    )
    msg = whole.choices[0].message
    assert msg.tool_calls is None and msg.content.startswith("Hello")
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=TOOLS,
        temperature=0,
        max_tokens=20,
        stream=True,
        extra_body={"guided_regex": "Hello[a-z !]{0,10}"},
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content


def test_a_plugin_tool_parser_is_used(smollm2_model):  # noqa: F811
    with live_server(smollm2_model, tool_call_parser="example_call_line") as srv:
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=300)
        whole = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            temperature=0,
            max_tokens=40,
            extra_body={"guided_regex": r'get_weather\(\{"city": "[A-Z][a-z]{2,10}", "unit": "celsius"\}\)'},
        )
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])


def test_multi_turn_with_a_tool_result_renders_and_continues(client, server):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    rendered = httpx.post(server.url("/tokenize"), json={"model": MODEL, "messages": messages}, timeout=60).json()
    text = httpx.post(server.url("/detokenize"), json={"model": MODEL, "tokens": rendered["tokens"]}, timeout=60).json()
    assert "18 degrees and sunny" in text["prompt"] and "get_weather" in text["prompt"]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=30)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
    ids=["unknown-function", "choice-without-tools", "bad-name", "bad-choice", "forced-plus-format"],
)
def test_bad_tool_requests_are_400_naming_the_parameter(server, body, param):
    r = httpx.post(
        server.url("/v1/chat/completions"), json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_forced_call_cut_by_max_tokens_is_the_same_streamed_or_not(client):
    kw = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=3,
    )
    whole = client.chat.completions.create(**kw)
    [call] = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "length" and call.function.name == "get_weather"
    streamed, finish = _streamed_calls(client, **kw)
    assert finish == "length"
    assert [(c["name"], c["arguments"]) for c in streamed] == [(call.function.name, call.function.arguments)]
