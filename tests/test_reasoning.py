"""Reasoning parsers: thinking split into ``reasoning_content``, whole and streamed alike (every way of
cutting the text into pieces gives the same split), and through the server on SmolLM2 (its output
steered into the think format with a regex constraint)."""

from __future__ import annotations

import openai
import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)

from ruvllm.plugins import load_plugins
from ruvllm_server.reasoning import BUILTIN_REASONING_PARSERS, reasoning_parsers

CASES = [
    ("think", "<think>step one, step two</think>The answer is 4.", "step one, step two", "The answer is 4."),
    ("think", "  <think>unfinished thought", "unfinished thought", ""),
    ("think", "No thinking here.", None, "No thinking here."),
    ("think", "<thin", None, "<thin"),
    ("deepseek_r1", "opened by the template</think>Answer.", "opened by the template", "Answer."),
    ("deepseek_r1", "<think>explicit</think>A", "explicit", "A"),
    ("deepseek_r1", "all thinking, no end", "all thinking, no end", ""),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_split_and_every_streamed_cut_agree(name, text, reasoning, content):
    cls = BUILTIN_REASONING_PARSERS[name]
    split = cls().split(text)
    assert (split.reasoning, split.content) == (reasoning, content)
    for step in (1, 2, 3, 7):
        p = cls()
        r, c = "", ""
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        for k, piece in enumerate(pieces):
            dr, dc = p.feed(piece, final=k == len(pieces) - 1)
            r, c = r + dr, c + dc
        assert (r, c) == ((reasoning or ""), content), step


def test_registry_includes_builtins():
    assert {"think", "deepseek_r1"} <= set(reasoning_parsers(load_plugins()))


def test_server_splits_reasoning_streamed_or_not(smollm2_model):  # noqa: F811
    with live_server(smollm2_model, reasoning_parser="think") as srv:
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=300)
        kw = dict(
            model="smollm2",
            messages=[{"role": "user", "content": "What is 2+2? Think first."}],
            temperature=0,
            max_tokens=40,
            extra_body={"guided_regex": "<think>[a-z ]{5,30}</think>The answer is [0-9]"},
        )
        whole = client.chat.completions.create(**kw).choices[0].message
        reasoning = getattr(whole, "reasoning_content", None) or whole.model_extra.get("reasoning_content")
        assert reasoning and 5 <= len(reasoning) <= 30 and whole.content.startswith("The answer is ")
        r, c = "", ""
        for chunk in client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                r += (ch.delta.model_extra or {}).get("reasoning_content") or ""
                c += ch.delta.content or ""
        assert (r, c) == (reasoning, whole.content)
