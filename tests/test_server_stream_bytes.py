"""The server's streamed bytes are fixed: for greedy requests on SmolLM2 (candle-compat) every SSE
event of chat and text completions (content, multi-byte characters, logprobs, stop strings, n, usage,
echo) is byte for byte what ``tests/data/server_stream_golden.json`` recorded before the stream path
was made faster (issue 44), but for the digits of floats (logprobs), compared within 1e-4. The id
and the ``created`` second vary per request and are masked.

Streamed and non-streamed answers to the same request agree (text, finish reason, usage).

``RUVLLM_WRITE_STREAM_GOLDEN=1`` rewrites the golden file from the code as it is (only on purpose:
after a deliberate change to the wire format).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)

GOLDEN = Path(__file__).parent / "data" / "server_stream_golden.json"

#: Accents, CJK and an emoji: tokens that end inside a character are held back by the detokenizer.
UNICODE = "Réponds en une phrase, avec un emoji 🌊 et le mot 海: qu'est-ce que la mer?"

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat_plain": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
            "max_tokens": 40,
            "stream_options": {"include_usage": True},
        },
    ),
    "chat_unicode": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": UNICODE}], "max_tokens": 40},
    ),
    "chat_logprobs": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": UNICODE}],
            "max_tokens": 12,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    "chat_stop_n2": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "List three colours, one per line."}],
            "max_tokens": 30,
            "n": 2,
            "stop": ["\n\n", "e,"],
            "stream_options": {"include_usage": True},
        },
    ),
    "chat_eos": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 64},
    ),
    "completion_plain": (
        "/v1/completions",
        {"prompt": "The lighthouse keeper said", "max_tokens": 24, "stream_options": {"include_usage": True}},
    ),
    "completion_logprobs_two_prompts": (
        "/v1/completions",
        {"prompt": ["Le café était", "海の色は"], "max_tokens": 10, "logprobs": 2},
    ),
    "completion_echo_stop": (
        "/v1/completions",
        {"prompt": "One, two, three,", "max_tokens": 16, "echo": True, "stop": [" six"]},
    ),
}

_ID = re.compile(rb'"id":"(chatcmpl|cmpl)-[0-9a-f]{32}(-\d+)?"')
_CREATED = re.compile(rb'"created":\d+')


def _masked(event: bytes) -> str:
    event = _ID.sub(lambda m: b'"id":"' + m.group(1) + b"-ID" + (m.group(2) or b"") + b'"', event)
    return _CREATED.sub(b'"created":0', event).decode("utf-8")


def _events(client: httpx.Client, path: str, body: dict[str, Any]) -> list[str]:
    """The response's SSE events, each as its exact text (``data: ...\\n\\n``) with id and time masked."""
    with client.stream("POST", path, json={"model": "smollm2", "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        raw = r.read()
    assert raw.endswith(b"\n\n")
    return [_masked(e + b"\n\n") for e in raw[:-2].split(b"\n\n")]


@pytest.fixture(scope="module")
def client(smollm2_model):  # noqa: F811
    with live_server(smollm2_model) as srv, httpx.Client(base_url=srv.url(""), timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def streamed(client) -> dict[str, list[str]]:
    got = {name: _events(client, path, body) for name, (path, body) in CASES.items()}
    if os.environ.get("RUVLLM_WRITE_STREAM_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return got


#: A float literal of the wire (logprobs): its digits come from this machine's BLAS.
_FLOAT = re.compile(r"-?\d+\.\d+(?:[eE][-+]?\d+)?|-?\d+[eE][-+]?\d+")


def _split_floats(event: str) -> tuple[str, list[float]]:
    return _FLOAT.sub("<float>", event), [float(f) for f in _FLOAT.findall(event)]


@pytest.mark.parametrize("name", list(CASES))
def test_stream_bytes_match_golden(streamed, name) -> None:
    """Every byte but a float's digits; floats (logprobs) within 1e-4: another CPU's BLAS (the golden
    was recorded on an AMD EPYC Zen 5) sums in another order and moves their last digits."""
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert len(streamed[name]) == len(golden[name])
    for got, want in zip(streamed[name], golden[name], strict=True):
        (got_text, got_floats), (want_text, want_floats) = _split_floats(got), _split_floats(want)
        assert got_text == want_text
        assert got_floats == pytest.approx(want_floats, abs=1e-4)


def _stream_text(events: list[str], completions: bool) -> tuple[dict[int, str], dict[int, str], Any]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for e in events:
        payload = e[len("data: ") : -2]
        if payload == "[DONE]":
            continue
        d = json.loads(payload)
        usage = d.get("usage") or usage
        for c in d["choices"]:
            piece = c["text"] if completions else c["delta"].get("content")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
            if c["finish_reason"]:
                reasons[c["index"]] = c["finish_reason"]
    return texts, reasons, usage


@pytest.mark.parametrize(
    "name", ["chat_plain", "chat_unicode", "chat_stop_n2", "completion_plain", "completion_echo_stop"]
)
def test_stream_and_response_agree(client, streamed, name) -> None:
    path, body = CASES[name]
    completions = path == "/v1/completions"
    r = client.post(path, json={"model": "smollm2", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    full = r.json()
    texts, reasons, usage = _stream_text(streamed[name], completions)
    for c in full["choices"]:
        text = c["text"] if completions else c["message"]["content"]
        assert texts[c["index"]] == text
        assert reasons[c["index"]] == c["finish_reason"]
    if usage is not None:  # cached prompt tokens differ: the stream went first and filled the cache
        usage.pop("prompt_tokens_details")
        full["usage"].pop("prompt_tokens_details")
        assert usage == full["usage"]
