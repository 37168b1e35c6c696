"""Every streamed chunk carries one choice (issue 55): a choice's several entries for one engine
output (a tool call's name, its arguments and the finish reason; reasoning and a finish reason) and
the n choices of a request are chunks of their own, as OpenAI sends them, so a client that reads
only ``choices[0]`` (the openai SDK's users, LangChain, litellm) gets all of the answer.

Each stream is read as clients read it, ``choices[0]`` of every chunk, and by the openai SDK's own
accumulator; both must rebuild the non-streamed answer to the same greedy request: content,
reasoning, tool calls (names, arguments that parse as JSON) and finish reasons. On SmolLM2: tool
calls (required, auto, two parallel), n = 2, speculation (several tokens a step), a reasoning
parser, text completions and the Responses stream."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from _server_fixtures import TIME, WEATHER, live_server, smollm2_model  # noqa: F401  (fixture)
from openai.lib.streaming.chat import ChatCompletionStreamState

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2"
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
#: SmolLM2 answers this, under tool_choice required with both tools, with two calls.
ASK_TWO = [{"role": "user", "content": "Weather in Paris and the time in Tokyo?"}]
#: The issue's request: one function tool, a required call, greedy.
REQUIRED = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=80)


@pytest.fixture(scope="module")
def server(smollm2_model):  # noqa: F811
    # Speculation on: a request opts out with "speculative": false (one token a step).
    with live_server(smollm2_model, speculative="ngram", num_speculative_tokens=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)


def _message(
    content: str | None, reasoning: str | None, calls: list[tuple[str, str]], tokens: list[str], finish: str | None
) -> dict:
    """A choice in one shape for comparing: arguments parsed (they must be JSON), the logprobs' tokens,
    "" as None."""
    return {
        "content": content or None,
        "reasoning": reasoning or None,
        "calls": [(name, json.loads(args)) for name, args in calls],
        "logprob_tokens": tokens,
        "finish_reason": finish,
    }


def _choices(completion: Any) -> dict[int, dict]:
    """A chat completion's choices (the server's or the SDK's accumulated one) in that shape."""
    out = {}
    for c in completion.choices:
        m = c.message
        calls = [(t.function.name, t.function.arguments) for t in m.tool_calls or ()]
        tokens = [e.token for e in c.logprobs.content or ()] if c.logprobs else []
        out[c.index] = _message(m.content, getattr(m, "reasoning_content", None), calls, tokens, c.finish_reason)
    return out


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[dict[int, dict], dict[int, dict]]:
    """The stream's choices rebuilt from ``choices[0]`` of each chunk, and by the SDK's accumulator."""
    state = ChatCompletionStreamState()
    got: dict[int, dict[str, Any]] = {}
    usage = 0
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        state.handle_chunk(chunk)
        indexes = [c.index for c in chunk.choices]
        assert len(set(indexes)) == len(indexes), f"two entries of one choice in a chunk: {chunk}"
        assert len(indexes) <= 1, f"one choice a chunk, as OpenAI sends: {chunk}"
        if not chunk.choices:
            assert chunk.usage is not None  # include_usage's last chunk
            usage += 1
            continue
        c = chunk.choices[0]
        slot = got.setdefault(c.index, {"content": "", "reasoning": "", "calls": {}, "tokens": [], "finish": None})
        assert slot["finish"] is None, "nothing follows a choice's finish reason"
        slot["content"] += c.delta.content or ""
        slot["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
        for d in c.delta.tool_calls or ():
            if d.id is not None:
                assert d.index not in slot["calls"] and d.id.startswith("call_"), "an id opens its call, once"
                assert d.function.name, "the name comes with the id"
                slot["calls"][d.index] = [d.function.name, ""]
            slot["calls"][d.index][1] += d.function.arguments or ""
        slot["tokens"] += [e.token for e in c.logprobs.content or ()] if c.logprobs else []
        slot["finish"] = c.finish_reason
    assert usage == 1
    rebuilt = {}
    for i, s in got.items():
        calls = [(name, args) for _, (name, args) in sorted(s["calls"].items())]
        rebuilt[i] = _message(s["content"], s["reasoning"], calls, s["tokens"], s["finish"])
    # The accumulated completion (get_final_completion() is this, but raises on a "length" finish).
    return rebuilt, _choices(state.current_completion_snapshot)


def _same_streamed_or_not(client: openai.OpenAI, **kw: Any) -> dict[int, dict]:
    """The answer, after checking that its stream, read either way, rebuilds it."""
    whole = _choices(client.chat.completions.create(**kw))
    rebuilt, accumulated = _streamed(client, **kw)
    assert rebuilt == whole
    assert accumulated == whole
    return whole


def _accepted(server) -> float:
    text = httpx.get(server.url("/metrics"), timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:spec_decode_num_accepted_tokens_total "))
    return float(line.split()[1])


# --- chat -----------------------------------------------------------------------------------------


def test_the_issues_required_call_keeps_its_arguments_and_finish_reason(client):
    whole = _same_streamed_or_not(client, **REQUIRED, extra_body={"speculative": False})
    [(name, args)] = whole[0]["calls"]
    assert name == "get_weather" and set(args) == {"city", "unit"}
    assert whole[0]["finish_reason"] == "tool_calls" and whole[0]["content"] is None


def test_an_auto_call(client):
    # The output is steered into the json parser's call format (structured_outputs).
    shape = {
        "type": "object",
        "properties": {"name": {"const": "get_time"}, "arguments": TIME["function"]["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    whole = _same_streamed_or_not(
        client,
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        temperature=0,
        max_tokens=60,
        extra_body={"guided_json": shape, "speculative": False},
    )
    assert [n for n, _ in whole[0]["calls"]] == ["get_time"] and whole[0]["finish_reason"] == "tool_calls"


def test_two_parallel_calls(client):
    kw = dict(REQUIRED, messages=ASK_TWO, tools=[WEATHER, TIME])
    whole = _same_streamed_or_not(client, **kw, extra_body={"speculative": False})
    assert [n for n, _ in whole[0]["calls"]] == ["get_weather", "get_time"]


def test_n_choices_each_in_chunks_of_their_own(client):
    # Both choices' entries of a step come in one output: each is a chunk of its own, the role
    # chunk's included.
    whole = _same_streamed_or_not(client, **REQUIRED, n=2)
    assert sorted(whole) == [0, 1] and all(m["calls"] and m["finish_reason"] == "tool_calls" for m in whole.values())
    colours = [{"role": "user", "content": "List three colours."}]
    text = dict(model=MODEL, messages=colours, n=2, temperature=0, max_tokens=12, logprobs=True, top_logprobs=1)
    whole = _same_streamed_or_not(client, **text)
    assert sorted(whole) == [0, 1] and all(m["content"] and m["logprob_tokens"] for m in whole.values())


def test_a_speculative_stream(client, server):
    # The call the prompt spells out: the n-gram drafts are taken, several tokens a step.
    said = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'
    kw = dict(REQUIRED, messages=[{"role": "user", "content": f"Answer exactly {said} and nothing else: {said}"}])
    before = _accepted(server)
    whole = _same_streamed_or_not(client, **kw)
    assert _accepted(server) > before
    assert [n for n, _ in whole[0]["calls"]] == ["get_weather"]
    text = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Repeat: one two three four five six seven eight nine ten."}],
        temperature=0,
        max_tokens=24,
    )
    _same_streamed_or_not(client, **text)


#: Thinking, its end and the answer, also said in the prompt: the n-gram drafts take several tokens a
#: step.
SAID_THINKING = "Two plus two is four.</think>Four."


@pytest.fixture(scope="module")
def reasoning_client(smollm2_model):  # noqa: F811
    with live_server(smollm2_model, reasoning_parser="deepseek_r1", speculative="ngram") as srv:
        yield openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize(
    ("max_tokens", "extra"),
    [(8, {}), (24, {"guided_regex": SAID_THINKING.replace(".", "[.]")})],
    ids=["thinking-cut-short", "thinking-then-answer"],
)
def test_a_reasoning_stream(reasoning_client, max_tokens, extra):
    # deepseek_r1 reads the output as begun inside <think>: cut short, the last output is thinking
    # and the finish reason together (two entries of one choice); steered, thinking then an answer.
    ask = [{"role": "user", "content": f"What is 2+2? Say {SAID_THINKING}"}]
    kw = dict(model=MODEL, messages=ask, temperature=0, max_tokens=max_tokens, extra_body=extra)
    whole = _same_streamed_or_not(reasoning_client, **kw)
    assert whole[0]["reasoning"]
    if extra:
        assert whole[0]["content"] == "Four." and whole[0]["finish_reason"] == "stop"
    else:
        assert whole[0]["content"] is None and whole[0]["finish_reason"] == "length"


# --- text completions -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [{"echo": True}, {"logprobs": 1}, {"speculative": False, "stop": [" five"]}],
    ids=["echo", "logprobs", "stop"],
)
def test_completions_choices_each_in_chunks_of_their_own(client, extra):
    kw = dict(model=MODEL, prompt=["One, two, three,", "Red, green,"], n=2, temperature=0, max_tokens=8)
    whole = client.completions.create(**kw, extra_body=extra)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    for chunk in client.completions.create(stream=True, **kw, extra_body=extra):
        assert len(chunk.choices) == 1, chunk
        c = chunk.choices[0]
        texts[c.index] = texts.get(c.index, "") + c.text
        tokens.setdefault(c.index, []).extend(c.logprobs.tokens if c.logprobs else ())
        finish[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2, 3]
    for c in whole.choices:
        assert (texts[c.index], finish[c.index]) == (c.text, c.finish_reason)
        if "logprobs" in extra:
            assert tokens[c.index] == c.logprobs.tokens


# --- the Responses stream (built on the chat chunks) ----------------------------------------------


def test_the_responses_stream_keeps_both_calls(client):
    tools = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
    kw = dict(
        model=MODEL,
        input=ASK_TWO[0]["content"],
        tools=tools,
        tool_choice="required",
        temperature=0,
        max_output_tokens=80,
    )
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    final = events[-1].response
    assert [e.sequence_number for e in events] == list(range(len(events)))

    def calls(response):
        return [(i.name, json.loads(i.arguments)) for i in response.output if i.type == "function_call"]

    assert calls(final) == calls(whole) and [n for n, _ in calls(whole)] == ["get_weather", "get_time"]
    assert final.status == whole.status == "completed"
    deltas: dict[int, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            deltas[e.output_index] = deltas.get(e.output_index, "") + e.delta
    assert [json.loads(deltas[i]) for i in sorted(deltas)] == [args for _, args in calls(whole)]
