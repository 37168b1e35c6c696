"""Tool-call parsers, the parser registry (built-ins plus plugins), and chat templates that receive
``tools`` and assistant ``tool_calls`` exactly as transformers passes them."""

from __future__ import annotations

import json

import _tokenizer_fixtures
import pytest

from ruvllm.plugins import load_plugins
from ruvllm_server.tools import (
    BUILTIN_PARSERS,
    calls_from_required,
    parser_for_template,
    required_schema,
    tool_parsers,
)

smollm2_tokenizer = _tokenizer_fixtures.smollm2_tokenizer
hf_smollm2_tokenizer = _tokenizer_fixtures.hf_smollm2_tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
         "Let me check.", [("get_weather", {"city": "Oslo"})]),
        ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "get_weather", '
         '"arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>', None,
         [("add", {"a": 1}), ("get_weather", {"city": "Rome"})]),
        ("hermes", '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>', "same", []),
        ("json", ' {"name": "add", "arguments": {"a": 2, "b": 3}}', None, [("add", {"a": 2, "b": 3})]),
        ("json", '```json\n[{"name": "add", "arguments": {}}, '
         '{"name": "get_weather", "parameters": {"city": "X"}}]\n```',
         None, [("add", {}), ("get_weather", {"city": "X"})]),
        ("json", '{"name": "add", "arguments": {}} and then some prose', "same", []),
        ("json", "The answer is 4.", "same", []),
        ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
         '{"name": "add", "parameters": {"a": 2}}',
         None, [("add", {"a": 1}), ("add", {"a": 2})]),
        ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}]', "Sure.",
         [("get_weather", {"city": "Nice"})]),
    ],
)  # fmt: skip
def test_parsers(parser, text, content, calls):
    out = BUILTIN_PARSERS[parser]().parse(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == calls
    assert out.content == (text if content == "same" else content)
    assert len({c.id for c in out.tool_calls}) == len(calls)


def test_stream_hold_back_finds_markers_across_pieces():
    hermes = BUILTIN_PARSERS["hermes"]()
    assert hermes.may_start("Sure <tool_") == len("<tool_") and hermes.may_start("Sure") == 0
    assert hermes.call_start("Sure <tool_call>{") == 5
    js = BUILTIN_PARSERS["json"]()
    assert js.may_start("  ") == 2 and js.call_start("  {") == 2 and js.call_start("Hi {") is None


def test_registry_has_builtins_and_the_plugin_parser():
    found = tool_parsers(load_plugins())
    assert set(BUILTIN_PARSERS) <= set(found) and "example_call_line" in found
    parsed = found["example_call_line"]().parse('add({"a": 1})', TOOLS)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("add", '{"a": 1}')]


def test_parser_follows_the_template_format():
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template("[TOOL_CALLS]") == "mistral"
    assert parser_for_template("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert parser_for_template("{{ messages }}") == "json"


def test_required_schema_round_trip():
    schema = required_schema(TOOLS, parallel=False)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert [(c.name, c.arguments) for c in calls_from_required('[{"name": "add", "arguments": {"a": 1}}]')] == [
        ("add", '{"a": 1}')
    ]


HERMES_LIKE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{{ t.function.parameters | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_gets_tools_and_tool_calls_as_transformers_passes_them(smollm2_tokenizer, hf_smollm2_tokenizer):
    from ruvllm.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_tokenizer.inner, bos_token_id=None, eos_token_ids=(2,), chat_template=HERMES_LIKE)
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    ours = tok.apply_chat_template(messages, True, tools=TOOLS)
    theirs = hf_smollm2_tokenizer.apply_chat_template(
        messages, tools=TOOLS, chat_template=HERMES_LIKE, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs and '<tool_call>get_weather {"city": "Oslo"}</tool_call>' in ours


@pytest.mark.parametrize("parser", ["json", "hermes"])
@pytest.mark.parametrize(
    "text",
    [
        '{"name": "add", "arguments": {"a": 1}}',
        'Hello {"name": "add", "arguments": {"a": 1}}',
        '  {"name": "add", "arguments": {}} and prose',
        'Sure.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        "<tool_ca but not a call",
        "plain answer",
    ],
)
def test_streamed_auto_output_adds_up_to_the_whole(parser, text):
    """Whatever the cut into pieces, a stream's content and tool calls equal the non-streamed answer
    (content next to a call up to surrounding whitespace)."""
    from ruvllm_server.generation.chat_tools import ChoiceTools, ToolSetup, split_calls, tool_deltas

    setup, tool_parser = ToolSetup(TOOLS, "auto"), BUILTIN_PARSERS[parser]()
    content, calls, reason = split_calls(setup, tool_parser, "call_0", text, "stop")
    want = (content or "", [(c.name, c.arguments) for c in calls], reason)
    for step in (1, 3, 8):
        st = ChoiceTools()
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        chunks = []
        for k, piece in enumerate(pieces):
            chunks += tool_deltas(setup, tool_parser, "call_0", 0, st, piece, "stop" if k == len(pieces) - 1 else None)
        got_content = "".join(c.delta.content or "" for c in chunks)
        got_calls: dict[int, list[str]] = {}
        for c in chunks:
            for d in c.delta.tool_calls or []:
                slot = got_calls.setdefault(d.index, ["", ""])
                slot[0] += d.function.name or ""
                slot[1] += d.function.arguments or ""
        finish = [c.finish_reason for c in chunks if c.finish_reason]
        assert finish == [reason]
        assert [tuple(v) for _, v in sorted(got_calls.items())] == want[1]
        # Content beside a call may differ in surrounding whitespace only; without a call it is exact.
        assert got_content.strip() == want[0].strip() if want[1] else got_content == text
