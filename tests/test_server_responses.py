"""``/v1/responses`` (the OpenAI Responses API) through the openai SDK against SmolLM2: create with a
string and with items, the typed event stream, ``parse`` with a Pydantic model, a conversation over
``previous_response_id``, a function-tool round trip, stored responses, and refusals in OpenAI's
error shape that store nothing."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)

from ruvllm_server.responses.store import ResponseStore

MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def server(smollm2_model):  # noqa: F811
    with live_server(smollm2_model) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)


def stored_count(server) -> int:
    store = server.app.state.get("ruvllm_responses")
    return 0 if store is None else len(store)


# --- the store on its own --------------------------------------------------------------------------


def test_store_drops_the_least_recently_used_and_the_expired():
    from ruvllm_server.responses.wire import ResponseObject

    now = [0.0]
    store = ResponseStore(max_count=2, ttl=10.0, clock=lambda: now[0])

    def put(rid: str) -> None:
        store.put(ResponseObject(id=rid, created_at=0, model="m", status="completed", output=[]), [])

    put("a")
    put("b")
    assert store.get("a") is not None  # a is now the most recently used
    put("c")
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    now[0] = 11.0
    assert store.get("a") is None and len(store) == 0
    put("d")
    assert store.delete("d") and not store.delete("d")


# --- create --------------------------------------------------------------------------------------


def test_create_with_a_string_input(client):
    r = client.responses.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=12)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert isinstance(r.output_text, str) and r.output_text
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens > 0


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input="Count to one hundred.", temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    # Streamed, it ends as OpenAI's does: response.incomplete, with the same reason.
    with client.responses.stream(model=MODEL, input="Count to one hundred.", temperature=0, max_output_tokens=3) as s:
        last = list(s)[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output[0].status == "incomplete"


def test_create_with_items_and_instructions(client):
    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "The capital of France?"}]},
    ]
    r = client.responses.create(
        model=MODEL, input=items, instructions="You are terse.", temperature=0, max_output_tokens=8
    )
    assert r.instructions == "You are terse." and r.output_text


def test_input_items_become_the_chat_turns():
    from ruvllm_server.responses.translate import chat_request
    from ruvllm_server.responses.wire import ResponseRequest

    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    earlier = chat_request(ResponseRequest(input="Hi."), "m", []).history
    t = chat_request(ResponseRequest(input=items, instructions="Terse."), "m", earlier)
    chat = t.chat.messages
    assert [m.role for m in chat] == ["system", "user", "developer", "user", "assistant", "tool", "tool"]
    assert chat[0].content == "Terse." and chat[3].content == "Weather?"
    assert [c.id for c in chat[4].tool_calls] == ["c1", "c2"]
    assert (chat[5].tool_call_id, chat[6].content) == ("c1", "rain")
    assert t.history == chat[1:]  # a follow-up does not inherit the instructions
    # OpenAI takes tool_choice auto or none without tools.
    assert chat_request(ResponseRequest(input="Hi.", tool_choice="auto"), "m", []).chat.tool_choice is None


# --- stream --------------------------------------------------------------------------------------


def test_stream_gives_typed_events_and_the_non_streamed_response(client):
    kw = dict(model=MODEL, input="Say hi.", temperature=0, max_output_tokens=48)
    plain = client.responses.create(**kw)
    assert plain.status == "completed"  # the SDK's final response needs response.completed
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "response.output_text.delta" in kinds
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == deltas == plain.output_text
    assert final.status == plain.status and final.usage.output_tokens == plain.usage.output_tokens
    assert [i.type for i in final.output] == [i.type for i in plain.output]


def test_streamed_forced_call_equals_the_non_streamed_one(client):
    kw = dict(
        model=MODEL,
        input="Weather in Rome please.",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=40,
    )
    plain = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    calls = [i for i in final.output if i.type == "function_call"]
    plain_calls = [i for i in plain.output if i.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in plain_calls]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == calls[0].arguments


# --- parse, conversations, tools -------------------------------------------------------------------


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)


def test_parse_with_a_pydantic_model(client):
    r = client.responses.parse(
        model=MODEL, input="Tell me about Paris as JSON.", text_format=City, temperature=0, max_output_tokens=60
    )
    assert isinstance(r.output_parsed, City) and r.output_parsed.name


def test_two_turns_through_previous_response_id(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0, max_output_tokens=10)
    second = client.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=10,
    )
    assert second.previous_response_id == first.id
    # The first turn (its input and its answer) went into the second's prompt.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_function_tool_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Rome?"}]
    r = client.responses.create(
        model=MODEL,
        input=ask,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=40,
    )
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert "city" in json.loads(calls[0].arguments)
    follow = [
        *ask,
        *[c.model_dump(exclude_none=True) for c in calls],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 C and sunny"},
    ]
    answer = client.responses.create(model=MODEL, input=follow, tools=[WEATHER], temperature=0, max_output_tokens=20)
    assert answer.output_text and answer.usage.input_tokens > r.usage.input_tokens


# --- stored responses ------------------------------------------------------------------------------


def test_get_and_delete_a_stored_response(client, server):
    r = client.responses.create(model=MODEL, input="Hi.", temperature=0, max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    gone = httpx.delete(server.url(f"/v1/responses/{r.id}"), timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["message"]


def test_store_false_keeps_nothing(client):
    r = client.responses.create(model=MODEL, input="Hi.", store=False, temperature=0, max_output_tokens=4)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        (
            {
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}},
                    }
                }
            },
            "text.format.schema",
        ),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ],
    ids=[
        "background",
        "built-in-tool",
        "built-in-tool-choice",
        "unknown-item",
        "image-part",
        "unknown-previous",
        "schema-missing",
        "schema-broken",
        "format-type",
    ],
)
def test_refusals_are_400_naming_the_field_and_store_nothing(server, body, param):
    before = stored_count(server)
    r = httpx.post(
        server.url("/v1/responses"),
        json={"model": MODEL, "input": "hi", "max_output_tokens": 4, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert stored_count(server) == before


def test_unknown_id_is_404_in_openai_shape(server):
    r = httpx.get(server.url("/v1/responses/resp_nope"), timeout=30)
    assert r.status_code == 404
    assert set(r.json()["error"]) >= {"message", "type", "param", "code"}


# --- the event stream on its own (reasoning, text, then a call) -------------------------------------


def test_events_of_reasoning_text_and_a_call_make_the_final_response():
    import msgspec

    from ruvllm_server.responses.events import ResponseEvents
    from ruvllm_server.responses.translate import Answer, ResponseShell, output_items
    from ruvllm_server.responses.wire import ResponseRequest
    from ruvllm_server.schemas import (
        ChatChunkChoice,
        ChatCompletionChunk,
        ChatDelta,
        FunctionDelta,
        ToolCallDelta,
        Usage,
    )

    def chunk(delta: ChatDelta, finish: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk("c", 0, "m", [ChatChunkChoice(0, delta, None, finish)])

    events = ResponseEvents(ResponseShell(ResponseRequest(input="x"), "m"))
    out = events.start()
    for c in [
        chunk(ChatDelta(role="assistant", content="")),
        chunk(ChatDelta(reasoning_content="Think")),
        chunk(ChatDelta(reasoning_content="ing.")),
        chunk(ChatDelta(content="Calling.")),
        chunk(ChatDelta(tool_calls=[ToolCallDelta(0, FunctionDelta("f", ""), "call_1", "function")])),
        chunk(ChatDelta(tool_calls=[ToolCallDelta(0, FunctionDelta(arguments='{"a": 1}'))]), "tool_calls"),
        ChatCompletionChunk("c", 0, "m", [], usage=Usage(5, 4, 9)),
    ]:
        out += events.chunk(c)
    closing, response = events.finish()
    out += closing
    decoded = [msgspec.json.decode(b.split(b"data: ", 1)[1]) for b in out]
    assert [e["sequence_number"] for e in decoded] == list(range(len(decoded)))
    kinds = [e["type"] for e in decoded]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.delta")
    assert kinds[-1] == "response.completed"
    assert [type(i).__name__ for i in response.output] == ["ReasoningItem", "MessageItem", "FunctionCallItem"]
    ids = {"reasoning": response.output[0].id, "message": response.output[1].id, "call0": response.output[2].id}
    same = output_items(Answer("Calling.", [("call_1", "f", '{"a": 1}')], "Thinking.", "tool_calls", None, ids))
    assert msgspec.to_builtins(response.output) == msgspec.to_builtins(same)
    assert response.usage.total_tokens == 9


def test_store_bounds_are_settings():
    from ruvllm_server.settings import ServerSettings, load_settings

    assert (ServerSettings().responses_store_max, ServerSettings().responses_store_ttl) == (1000, 3600.0)
    s = load_settings(environ={"RUVLLM_RESPONSES_STORE_MAX": "5", "RUVLLM_RESPONSES_STORE_TTL": "60"})
    assert (s.responses_store_max, s.responses_store_ttl) == (5, 60.0)


def test_store_bounds_are_serve_flags(monkeypatch, capsys):
    """``ruvllm serve --responses-store-max N --responses-store-ttl S`` reach the settings; a bad value
    is refused by name before the model loads."""
    import ruvllm.log_setup
    import ruvllm_server.state
    from ruvllm.cli import build_parser
    from ruvllm.plugins import load_plugins
    from ruvllm_server.settings import ServerConfigError

    seen = []

    class Loaded(Exception):
        pass

    def load_model(settings):
        seen.append(settings)
        raise Loaded

    monkeypatch.setattr(ruvllm_server.state, "load_model", load_model)
    monkeypatch.setattr(ruvllm.log_setup, "configure_logging", lambda **kw: None)
    monkeypatch.setenv("RUVLLM_LOG", "WARNING")
    host = load_plugins()

    def serve(*flags: str) -> None:
        args = build_parser(host).parse_args(["serve", "smollm2", *flags])
        args.func(args, host)

    with pytest.raises(ServerConfigError, match="failed to load: Loaded"):
        serve("--responses-store-max", "5", "--responses-store-ttl", "60")
    assert (seen[0].responses_store_max, seen[0].responses_store_ttl) == (5, 60.0)
    with pytest.raises(ServerConfigError, match="responses_store_ttl"):
        serve("--responses-store-ttl", "0")
    with pytest.raises(ServerConfigError, match="responses_store_max"):
        serve("--responses-store-max", "-1")
    assert len(seen) == 1


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$ref": "#/missing"}}},
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}},
    ],
    ids=["dangling-ref", "bad-pattern"],
)
def test_a_streamed_request_with_a_broken_schema_is_400_before_the_stream(server, schema):
    before = stored_count(server)
    body = {
        "model": MODEL,
        "input": "hi",
        "max_output_tokens": 4,
        "stream": True,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
    }
    with httpx.stream("POST", server.url("/v1/responses"), json=body, timeout=60) as r:
        r.read()
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "text.format.schema", err
    assert stored_count(server) == before


def test_responses_take_an_admission_slot():
    from ruvllm_server.middleware import GENERATION_PATHS

    assert "/v1/responses" in GENERATION_PATHS


def test_the_routes_are_in_the_openapi_schema(server):
    paths = httpx.get(server.url("/schema/openapi.json"), timeout=60).json()["paths"]
    assert {"/v1/responses", "/v1/responses/{response_id}"} <= set(paths)


def test_reasoning_parser_output_is_a_reasoning_item_streamed_or_not(smollm2_model):  # noqa: F811
    # deepseek_r1 reads the output as begun inside <think>: SmolLM2 never closes it, so all of it
    # is thinking, and the message is empty.
    with live_server(smollm2_model, reasoning_parser="deepseek_r1") as srv:
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=300)
        kw = dict(model=MODEL, input="What is 2+2?", temperature=0, max_output_tokens=8)
        plain = client.responses.create(**kw)
        assert [i.type for i in plain.output] == ["reasoning", "message"]
        thinking = plain.output[0].content[0].text
        assert thinking and plain.output_text == ""
        with client.responses.stream(**kw) as stream:
            events = list(stream)
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        final = events[-1].response
        assert deltas == thinking == final.output[0].content[0].text
        assert [i.type for i in final.output] == ["reasoning", "message"] and final.status == plain.status
