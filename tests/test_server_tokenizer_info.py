"""``GET /tokenizer_info`` as vLLM serves it (what lm-evaluation-harness reads to use the server's
tokenizer): special tokens as text that ``/tokenize`` maps back to the tokenizer's ids, the chat
template, and the context the server allows; ``/tokenize`` and ``/detokenize`` answer as before."""

from __future__ import annotations

import httpx
import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def server(smollm2_model):  # noqa: F811
    with live_server(smollm2_model) as srv:
        yield srv


def test_tokenizer_info_names_the_special_tokens_and_template(server):
    r = httpx.get(server.url("/tokenizer_info"), timeout=60)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert "<|im_start|>" in info["chat_template"]
    tokenize = httpx.post(server.url("/tokenize"), json={"prompt": "Hello"}, timeout=60).json()
    assert info["model_max_length"] == tokenize["max_model_len"] > 0
    for key in ("eos_token", "bos_token"):
        ids = httpx.post(
            server.url("/tokenize"), json={"prompt": info[key], "add_special_tokens": False}, timeout=60
        ).json()["tokens"]
        assert len(ids) == 1
        back = httpx.post(server.url("/detokenize"), json={"tokens": ids}, timeout=60).json()
        assert back == {"prompt": info[key]}
    assert set(info) >= {"pad_token", "unk_token", "add_bos_token"}
