"""gpt-oss's chat format (OpenAI's harmony): the ``gpt_oss`` reasoning parser takes the ``analysis``
channel as reasoning and unwraps the ``final`` channel; the ``gpt_oss`` tool parser reads messages to
``functions.NAME`` as calls. Whole and streamed alike, however the text is cut, and through both as
the chat endpoint chains them. Also: harmony's turn ends stop generation from a GGUF file."""

from __future__ import annotations

import json

import pytest
from _server_fixtures import smollm2_model  # noqa: F401  (fixture)

from ruvllm.plugins import load_plugins
from ruvllm_server.generation.chat_tools import ChoiceTools, ToolSetup, split_calls, tool_deltas
from ruvllm_server.reasoning import BUILTIN_REASONING_PARSERS, GptOssReasoningParser, reasoning_parsers
from ruvllm_server.tools import BUILTIN_PARSERS, GptOssParser, parser_for_template, tool_parsers

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]

THINK = "<|channel|>analysis<|message|>The user asks for 2+2. Simple.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4."
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "unit": "C"}'
)

#: (output text, reasoning, content after the reasoning parser)
REASONING_CASES = [
    (THINK + FINAL, "The user asks for 2+2. Simple.", "2 + 2 = 4."),
    (THINK + FINAL + "<|return|>", "The user asks for 2+2. Simple.", "2 + 2 = 4."),
    ("<|channel|>final<|message|>Just the answer.", None, "Just the answer."),
    # A preamble on the commentary channel is for the user; a call stays whole for the tool parser.
    (THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL,
     "The user asks for 2+2. Simple.", "Checking." + CALL),
    # The recipient in the role part: the prompt's <|start|>assistant is written back in front of it.
    (' to=functions.add<|channel|>commentary json<|message|>{"a": 1}<|call|>', None,
     '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 1}<|call|>'),
    ("<|channel|>analysis<|message|>cut short by max_tokens", "cut short by max_tokens", ""),
    ("<|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>fin", "thinking", ""),
    ("Plain text from a model not speaking harmony.", None, "Plain text from a model not speaking harmony."),
    ("<|chan", None, "<|chan"),
    ("", None, ""),
]  # fmt: skip


def _cuts(text: str) -> list[list[str]]:
    """``text`` in two pieces at every character boundary, and in pieces of a few fixed lengths."""
    out = [[text[:i], text[i:]] for i in range(1, len(text))]
    out += [[text[i : i + step] for i in range(0, len(text), step)] for step in (1, 2, 3, 7)]
    return [pieces for pieces in out if pieces]


@pytest.mark.parametrize(("text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_split_and_every_streamed_cut_agree(text, reasoning, content) -> None:
    split = GptOssReasoningParser().split(text)
    assert (split.reasoning, split.content) == (reasoning, content)
    for pieces in _cuts(text):
        p = GptOssReasoningParser()
        r, c = "", ""
        for k, piece in enumerate(pieces):
            dr, dc = p.feed(piece, final=k == len(pieces) - 1)
            r, c = r + dr, c + dc
        assert (r, c) == (reasoning or "", content), pieces


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (CALL, None, [("get_weather", {"city": "Paris", "unit": "C"})]),
        # Raw harmony (no reasoning parser in front): the text before the call is the content.
        (THINK + CALL + "<|call|>", THINK, [("get_weather", {"city": "Paris", "unit": "C"})]),
        ("Checking.\n" + CALL, "Checking.", [("get_weather", {"city": "Paris", "unit": "C"})]),
        ('<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}<|call|>'
         '<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2}',
         None, [("add", {"a": 1}), ("add", {"a": 2})]),
        (' to=functions.add<|channel|>commentary json<|message|>{"a": 3}', None, [("add", {"a": 3})]),
        # Not a well-formed call of one of the tools: the text is the answer.
        ('<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1', "same", []),
        ('<|channel|>commentary to=functions.unknown_fn <|constrain|>json<|message|>{}', "same", []),
        ('<|channel|>analysis to=browser.search<|message|>{"query": "x"}', "same", []),
        ("<|channel|>commentary to=functions.add", "same", []),
        ("2 + 2 = 4.", "same", []),
        ("auto=functions.add<|message|>{}", "same", []),
    ],
)  # fmt: skip
def test_tool_parser(text, content, calls) -> None:
    out = GptOssParser().parse(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == calls
    assert out.content == (text if content == "same" else content)


def test_stream_hold_back_waits_for_a_header_to_name_its_recipient() -> None:
    p = GptOssParser()
    assert p.may_start("Checking.<|sta") == len("<|sta")
    assert p.may_start("Checking.<|start|>assistant<|channel|>commen") == len("<|start|>assistant<|channel|>commen")
    assert p.may_start("<|channel|>final<|message|>4") == 0
    assert p.call_start("Checking." + CALL) == len("Checking.")
    assert p.call_start(THINK + FINAL) is None


def _chat(text: str, cut: list[str] | None) -> tuple[str, str, list[tuple[str, str]], str | None]:
    """(reasoning, content, calls, finish reason) of ``text`` as the chat endpoint makes them with both
    parsers: whole (``cut`` None) or streamed in ``cut``'s pieces."""
    setup, tools = ToolSetup(TOOLS, "auto"), GptOssParser()
    if cut is None:
        split = GptOssReasoningParser().split(text)
        content, calls, reason = split_calls(setup, tools, "call_0", split.content, "stop")
        return split.reasoning or "", content or "", [(c.name, c.arguments) for c in calls], reason
    rp, st = GptOssReasoningParser(), ChoiceTools()
    reasoning, chunks = "", []
    for k, piece in enumerate(cut):
        finish = "stop" if k == len(cut) - 1 else None
        r, c = rp.feed(piece, final=finish is not None)
        reasoning += r
        chunks += tool_deltas(setup, tools, "call_0", 0, st, c, finish)
    got: dict[int, list[str]] = {}
    for ch in chunks:
        for d in ch.delta.tool_calls or []:
            slot = got.setdefault(d.index, ["", ""])
            slot[0] += d.function.name or ""
            slot[1] += d.function.arguments or ""
    content = "".join(ch.delta.content or "" for ch in chunks)
    [reason] = [ch.finish_reason for ch in chunks if ch.finish_reason]
    return reasoning, content, [(n, a) for _, (n, a) in sorted(got.items())], reason


@pytest.mark.parametrize(
    "text",
    [
        THINK + FINAL,
        THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL,
        THINK + CALL + "<|call|>",
        ' to=functions.add<|channel|>commentary json<|message|>{"a": 1}',
        '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": ',
        "plain answer",
    ],
)
def test_streamed_chat_adds_up_to_the_whole(text) -> None:
    reasoning, content, calls, reason = _chat(text, None)
    for cut in _cuts(text):
        r, c, k, why = _chat(text, cut)
        # Content beside a call may differ in surrounding whitespace only, as for the other parsers.
        same = (c.strip(), content.strip()) if calls else (c, content)
        assert (r, same[0], k, why) == (reasoning, same[1], calls, reason)


def test_the_chain_gives_reasoning_content_and_the_call() -> None:
    text = THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL
    reasoning, content, calls, reason = _chat(text, None)
    assert reasoning == "The user asks for 2+2. Simple." and content == "Checking."
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris", "unit": "C"})]
    assert reason == "tool_calls"


def test_registered_by_name_and_chosen_by_a_harmony_template() -> None:
    host = load_plugins()
    assert reasoning_parsers(host)["gpt_oss"] is BUILTIN_REASONING_PARSERS["gpt_oss"] is GptOssReasoningParser
    assert tool_parsers(host)["gpt_oss"] is BUILTIN_PARSERS["gpt_oss"] is GptOssParser
    assert parser_for_template("{{- '<|start|>assistant<|channel|>final<|message|>' }}") == "gpt_oss"
    # Harmony's markup is special tokens: the server must decode with skip_special_tokens=False.
    assert GptOssReasoningParser.keeps_special_tokens and GptOssParser.keeps_special_tokens
    assert not BUILTIN_REASONING_PARSERS["think"].keeps_special_tokens
    assert not BUILTIN_PARSERS["hermes"].keeps_special_tokens


def test_a_gguf_turn_ends_at_return_or_call_not_at_end(tmp_path, monkeypatch) -> None:
    """llama.cpp's converter names <|return|> as EOS; <|call|> ends a turn too, <|end|> only a message."""
    pytest.importorskip("transformers")
    import gguf
    from _moe_checkpoints import write_gpt_oss_gguf, write_moe_checkpoint

    from ruvllm.checkpoint import open_checkpoint

    specials = {5: "<|return|>", 6: "<|call|>", 7: "<|end|>"}
    add_tokens = gguf.GGUFWriter.add_token_list

    def with_harmony_tokens(self, tokens):
        add_tokens(self, [specials.get(i, t) for i, t in enumerate(tokens)])
        self.add_eos_token_id(5)

    monkeypatch.setattr(gguf.GGUFWriter, "add_token_list", with_harmony_tokens)
    hf_dir = write_moe_checkpoint(tmp_path / "hf", "gpt_oss")
    path = write_gpt_oss_gguf(hf_dir, tmp_path / "model.gguf")
    ckpt = open_checkpoint(path)
    assert ckpt.config.eos_token_ids == (5, 6)
    # The file carries no template: the family's harmony one, whose format picks the gpt_oss parser.
    assert ckpt.chat_template == _family_template()
    assert parser_for_template(ckpt.chat_template) == "gpt_oss"


def _family_template() -> str:
    from ruvllm.architectures import FAMILIES

    text = next(f for f in FAMILIES if f.name == "gpt_oss").chat_template_text()
    assert text is not None
    return text


def _render(messages: list[dict], **kw) -> str:
    import re

    import tokenizers

    from ruvllm.tokenizer import Tokenizer

    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel({"x": 0}, unk_token="x"))
    tok = Tokenizer(inner, bos_token_id=None, eos_token_ids=[], chat_template=_family_template())
    return re.sub(r"Current date: \d{4}-\d\d-\d\d", "Current date: DATE", tok.apply_chat_template(messages, True, **kw))


SYSTEM = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: DATE\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)


def test_the_family_template_writes_harmony() -> None:
    hi = [{"role": "user", "content": "hi"}]
    assert _render(hi) == SYSTEM + "<|end|><|start|>user<|message|>hi<|end|><|start|>assistant"
    assert _render(hi, reasoning_effort="high").count("Reasoning: high\n") == 1


def test_the_family_template_writes_tools_calls_and_results() -> None:
    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "Gets the weather.", "parameters": {
            "type": "object", "required": ["city"], "properties": {
                "city": {"type": "string", "description": "The city."},
                "unit": {"type": "string", "enum": ["C", "F"], "default": "C"},
                "days": {"type": "array", "items": {"type": "integer"}}}}}},
        {"type": "function", "function": {"name": "now"}},
    ]  # fmt: skip
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"t": 20}'},
        {"role": "assistant", "content": "20 C."},
        {"role": "user", "content": "Thanks"},
    ]
    want = (
        SYSTEM + "\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// Gets the weather.\ntype get_weather = (_: {\n// The city.\ncity: string,\n"
        'unit?: "C" | "F", // default: "C"\ndays?: number[],\n}) => any;\n\ntype now = () => any;\n\n'
        "} // namespace functions<|end|>"
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"t": 20}<|end|>'
        "<|start|>assistant<|channel|>final<|message|>20 C.<|end|>"
        "<|start|>user<|message|>Thanks<|end|><|start|>assistant"
    )
    assert _render(messages, tools=tools) == want
    # The call as the template writes it back is one the tool parser reads.
    written = want[want.index("<|start|>assistant to=") : want.index("<|start|>functions.")]
    parsed = GptOssParser().parse(written, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]


def _harmony_tokenizer():
    """A byte-level tokenizer (no merges) with harmony's markup as special tokens, as gpt-oss's has."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from ruvllm.tokenizer import Tokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    inner = tokenizers.Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    markup = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
    inner.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in markup])
    return Tokenizer(inner, bos_token_id=None, eos_token_ids=[])


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_token_by_token_decoding_keeps_the_markup_only_without_skipping_special_tokens(skip_special_tokens) -> None:
    """What the engine's detokenizer hands the parsers, one token at a time: the chain reads the call
    when special tokens are kept; skipped, the markup is gone and no call or reasoning is found."""
    from ruvllm.tokenizer import IncrementalDetokenizer

    tok = _harmony_tokenizer()
    text = THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) < len(text)  # the markup is one token each
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    got = _chat(text, [p for p in pieces if p] or [""])
    if skip_special_tokens:
        assert got[0] == "" and got[2] == []
    else:
        assert got == _chat(text, None)
        assert got[2] and got[1] == "Checking."


def test_the_chat_endpoint_keeps_special_tokens_for_the_gpt_oss_parsers(smollm2_model):  # noqa: F811
    """Harmony's markers are special tokens: a chat request served with the gpt_oss reasoning parser
    decodes with them kept (else the parsers would see none of them); without it they are skipped."""
    import msgspec
    from _server_fixtures import live_server

    from ruvllm_server.generation.chat import ChatJob
    from ruvllm_server.schemas import ChatCompletionRequest

    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    req = msgspec.convert(body, ChatCompletionRequest)
    for parser, kept in (("gpt_oss", True), (None, False)):
        with live_server(smollm2_model, reasoning_parser=parser) as srv:
            run = ChatJob(srv.app.state["ruvllm"], req, None).prepare()
            assert run.requests[0].sampling.skip_special_tokens is not kept
