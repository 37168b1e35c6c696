"""Streaming detokenization: pieces are complete UTF-8 text and add up to ``decode(all_ids)``."""

from __future__ import annotations

import _tokenizer_fixtures
import numpy as np
import pytest

from ruvllm.errors import RequestError
from ruvllm.tokenizer import IncrementalDetokenizer

smollm2_tokenizer = _tokenizer_fixtures.smollm2_tokenizer
sentencepiece_gguf = _tokenizer_fixtures.sentencepiece_gguf
sentencepiece_tokenizer = _tokenizer_fixtures.sentencepiece_tokenizer

STREAM_TEXT = "日本語のテキスト 🎉👍🏽 👨‍👩‍👧 café naïve — 中文字符 ❤️ done."


def _stream(tokenizer, ids, **kw):
    """Pieces from pushing ``ids`` one by one, checking after each push that the text so far is
    final: a prefix of the decode of everything pushed so far."""
    detok = IncrementalDetokenizer(tokenizer, **kw)
    pieces = []
    for n, token_id in enumerate(ids, 1):
        pieces.append(detok.push(token_id))
        so_far = "".join(pieces)
        assert tokenizer.decode(ids[:n], kw.get("skip_special_tokens", False)).startswith(so_far)
    pieces.append(detok.flush())
    return pieces


@pytest.fixture(scope="module")
def fragment_ids(smollm2_tokenizer):
    """Ids of byte-level tokens that are not valid UTF-8 on their own (pieces of multi-byte characters)."""
    ids = [i for i in range(smollm2_tokenizer.vocab_size) if "\ufffd" in smollm2_tokenizer.decode([i])]
    assert len(ids) > 50  # the vocabulary has many such tokens; the test below needs them
    return np.array(ids)


@pytest.mark.parametrize("seed", range(8))
def test_random_ids_concatenate_to_decode(smollm2_tokenizer, fragment_ids, seed):
    rng = np.random.default_rng(seed)
    length = int(rng.integers(1, 80))
    # Half the ids are character fragments, so incomplete and invalid UTF-8 runs are frequent.
    ids = [
        int(rng.choice(fragment_ids)) if rng.random() < 0.5 else int(rng.integers(0, smollm2_tokenizer.vocab_size))
        for _ in range(length)
    ]
    full = smollm2_tokenizer.decode(ids)
    pieces = _stream(smollm2_tokenizer, ids)
    assert "".join(pieces) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in p for p in pieces)


def test_multibyte_text_streams_without_replacement_characters(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(STREAM_TEXT)
    pieces = _stream(smollm2_tokenizer, ids)
    assert "".join(pieces) == STREAM_TEXT
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") > 1  # characters split over several tokens were held back, then emitted whole
    for piece in pieces:
        piece.encode("utf-8")  # complete characters only


def test_truncated_character_is_flushed_as_decode_shows_it(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("ok 🎉")
    cut = ids[:-1]  # drop the emoji's last byte token
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    streamed = "".join(detok.push(i) for i in cut)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == smollm2_tokenizer.decode(cut)
    assert smollm2_tokenizer.decode(cut).endswith("\ufffd")


def test_skip_special_tokens(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("<|im_start|>assistant\nBonjour 👋<|im_end|>")
    pieces = _stream(smollm2_tokenizer, ids, skip_special_tokens=True)
    assert "".join(pieces) == "assistant\nBonjour 👋"
    assert "".join(_stream(smollm2_tokenizer, ids)) == smollm2_tokenizer.decode(ids)


def test_invalid_id_is_rejected_and_the_stream_continues(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("Hello 世界")
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    out = detok.push(ids[0])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        detok.push(smollm2_tokenizer.vocab_size)
    out += "".join(detok.push(i) for i in ids[1:]) + detok.flush()
    assert out == "Hello 世界"


def test_sentencepiece_stream_keeps_spaces_and_bytes(sentencepiece_tokenizer):
    """SentencePiece decoding drops the first token's leading space only at the very start; byte
    tokens (<0xE4>...) form characters only together."""
    tok = sentencepiece_tokenizer
    text = "  two leading spaces, then 中文 and 🎉 bytes"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("seed", range(4))
def test_sentencepiece_random_ids_concatenate_to_decode(sentencepiece_tokenizer, seed):
    rng = np.random.default_rng(seed)
    ids = [int(i) for i in rng.integers(0, sentencepiece_tokenizer.vocab_size, size=int(rng.integers(1, 60)))]
    pieces = _stream(sentencepiece_tokenizer, ids)
    full = sentencepiece_tokenizer.decode(ids)
    assert "".join(pieces) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in p for p in pieces)
