"""ruvllm's GGUF tokenizer gives the same ids as independent references.

References:
* transformers' tokenizer built from the same GGUF file (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``).
* llama.cpp's pre-tokenizer semantics for SmolLM2 (``tokenizer.ggml.pre = "smollm"``), re-implemented
  below: split off control tokens, isolate every ``\\p{N}`` character (the ``regex`` module), split
  each piece into GPT-2's words in GPT-2's byte alphabet as the ``tokenizers`` library does it (its
  own ``ByteLevel`` pre-tokenizer, not ruvllm's copy of the pattern) and run transformers' BPE model
  on each word.

transformers' GGUF converter does not know the "smollm" pre-tokenizer: it falls back to plain GPT-2
byte-level splitting without SmolLM2's individual-digit step. The vocabulary has no multi-digit
tokens, so most numbers still come out as single digits, but whitespace right before a digit (or
before a non-ASCII numeral) is split differently: for "a  1" llama.cpp and SmolLM2's own
tokenizer.json give ["a", "ĠĠ", "1"] while transformers-from-GGUF gives ["a", "Ġ", "Ġ", "1"].
For those texts (TRANSFORMERS_GGUF_DIVERGES) the transformers comparison is replaced by the
llama.cpp-semantics reference and hand-checked token lists.
"""

from __future__ import annotations

import json

import _tokenizer_fixtures
import pytest
import regex
import structlog
from tokenizers import pre_tokenizers

from ruvllm.errors import ModelFormatError, RequestError
from ruvllm.tokenizer import Tokenizer

smollm2_tokenizer = _tokenizer_fixtures.smollm2_tokenizer
hf_smollm2_tokenizer = _tokenizer_fixtures.hf_smollm2_tokenizer
sentencepiece_gguf = _tokenizer_fixtures.sentencepiece_gguf
sentencepiece_tokenizer = _tokenizer_fixtures.sentencepiece_tokenizer

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé Ångström Ünïcödé",
    "日本語のテキストと中文字符",
    "emoji: 🎉👍🏽 👨‍👩‍👧 ❤️ 😀😀😀",
    "123 4567 8901234567890 3.14159 1,000,000 -42 0x1F",
    "year 2024: +1 555-0100",
    "tabs\tand\t\tmore  spaces   here\n\nnew\r\nlines \n ",
    "   leading and trailing   ",
    "def f(x):\n    return x ** 2  # square\n\nfor i in range(10):\n\tprint(f(i))\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|endoftext|><repo_name>x<|im_end|>",
    "I'm sure they'll say we've done it, isn't it?",
    "e\u0301 n\u0303 \u200b zero width \ufeff",
    "مرحبا שלום नमस्ते 안녕하세요",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "x²+y³=z½ ① Ⅻ ٣٤٥",
    "a  1",
    "line\n\n2. item",
    "x = [1,  2,   3]\n  42",
]
TRANSFORMERS_GGUF_DIVERGES = {"x²+y³=z½ ① Ⅻ ٣٤٥", "a  1", "line\n\n2. item", "x = [1,  2,   3]\n  42"}
# Token spellings worked out by hand from the "smollm" rules ("Ġ" is a space, "Ċ" a newline).
HAND_CHECKED = {
    "a  1": ["a", "ĠĠ", "1"],
    "line\n\n2. item": ["line", "ĊĊ", "2", ".", "Ġitem"],
    "x = [1,  2,   3]\n  42": ["x", "Ġ=", "Ġ[", "1", ",", "ĠĠ", "2", ",", "ĠĠĠ", "3", "]", "ĊĠĠ", "4", "2"],
}

#: GPT-2's word splitting and byte alphabet, as the ``tokenizers`` library implements them.
_GPT2_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


@pytest.fixture(scope="module")
def llama_cpp_reference(smollm2_checkpoint, hf_smollm2_tokenizer):
    tokens = smollm2_checkpoint.meta("tokenizer.ggml.tokens")
    types = smollm2_checkpoint.meta("tokenizer.ggml.token_type")
    control = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == 3}
    control_re = regex.compile("|".join(regex.escape(t) for t in sorted(control, key=len, reverse=True)))
    bpe = hf_smollm2_tokenizer.backend_tokenizer.model

    def plain(text: str) -> list[int]:
        ids = []
        for piece in regex.split(r"(\p{N})", text):
            for word, _ in _GPT2_BYTE_LEVEL.pre_tokenize_str(piece):
                ids += [t.id for t in bpe.tokenize(word)]
        return ids

    def encode(text: str) -> list[int]:
        ids, pos = [], 0
        for m in control_re.finditer(text):
            ids += [*plain(text[pos : m.start()]), control[m.group()]]
            pos = m.end()
        return ids + plain(text[pos:])

    return encode


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_llama_cpp_smollm_semantics(smollm2_tokenizer, llama_cpp_reference, text):
    assert smollm2_tokenizer.encode(text) == llama_cpp_reference(text)


@pytest.mark.parametrize("text", [t for t in TEXTS if t not in TRANSFORMERS_GGUF_DIVERGES])
def test_ids_match_transformers_gguf_tokenizer(smollm2_tokenizer, hf_smollm2_tokenizer, text):
    assert smollm2_tokenizer.encode(text) == hf_smollm2_tokenizer.encode(text)


@pytest.mark.parametrize("text", sorted(HAND_CHECKED))
def test_digit_splitting_where_transformers_gguf_differs(smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text)
    assert [smollm2_tokenizer.id_to_token(i) for i in ids] == HAND_CHECKED[text]


def test_smollm2_pre_tokenizer_isolates_digits(smollm2_tokenizer):
    pieces = [p for p, _ in smollm2_tokenizer.inner.pre_tokenizer.pre_tokenize_str("a  12 b")]
    assert pieces == ["a", "ĠĠ", "1", "2", "Ġb"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(smollm2_tokenizer, hf_smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids) == text
    assert smollm2_tokenizer.decode(ids) == hf_smollm2_tokenizer.decode(ids)
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=True) == hf_smollm2_tokenizer.decode(
        ids, skip_special_tokens=True
    )


def test_special_tokens_and_properties(smollm2_tokenizer, hf_smollm2_tokenizer):
    tok, hf = smollm2_tokenizer, hf_smollm2_tokenizer
    im_start = hf.convert_tokens_to_ids("<|im_start|>")
    assert tok.encode("<|im_start|>") == hf.encode("<|im_start|>") == [im_start]  # SmolLM2 adds no BOS
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [im_start]
    assert tok.vocab_size == len(hf)
    assert tok.bos_token_id == hf.bos_token_id
    assert tok.eos_token_ids == (hf.eos_token_id,)
    assert tok.id_to_token(hf.eos_token_id) == hf.eos_token
    world = hf.convert_tokens_to_ids("Ġworld")
    assert world != hf.unk_token_id and tok.id_to_token(world) == "Ġworld"


def test_bad_input_raises_request_error(smollm2_tokenizer):
    with pytest.raises(RequestError, match="string"):
        smollm2_tokenizer.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="outside the vocabulary"):
        smollm2_tokenizer.decode([5, 49152])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        smollm2_tokenizer.id_to_token(-1)
    with pytest.raises(RequestError, match="integers"):
        smollm2_tokenizer.decode(["x"])  # type: ignore[list-item]


class _Metadata:
    """A stand-in checkpoint that serves GGUF metadata from a dict (with overrides)."""

    path = "test.gguf"
    chat_template = property(lambda self: self.meta("tokenizer.chat_template"))

    def __init__(self, base, **overrides):
        self._base, self._overrides = base, overrides

    def meta(self, key, default=None):
        if key in self._overrides:
            value = self._overrides[key]
            return default if value is None else value
        return self._base.meta(key, default)


def test_unsupported_or_missing_tokenizer_model_is_a_format_error(smollm2_checkpoint):
    with pytest.raises(ModelFormatError, match="'bert' is not supported"):
        Tokenizer.from_gguf(_Metadata(smollm2_checkpoint, **{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ModelFormatError, match="no tokenizer"):
        Tokenizer.from_gguf(_Metadata(smollm2_checkpoint, **{"tokenizer.ggml.model": None}))
    with pytest.raises(ModelFormatError, match="merges"):
        Tokenizer.from_gguf(_Metadata(smollm2_checkpoint, **{"tokenizer.ggml.merges": None}))


def test_unknown_pre_tokenizer_falls_back_to_gpt2_with_a_warning(smollm2_checkpoint):
    # Earlier tests (CLI, server) may have configured structlog with a level filter; start clean.
    saved = structlog.get_config()
    structlog.reset_defaults()
    try:
        with structlog.testing.capture_logs() as logs:
            tok = Tokenizer.from_gguf(_Metadata(smollm2_checkpoint, **{"tokenizer.ggml.pre": "mystery-bpe"}))
    finally:
        structlog.configure(**saved)
    assert any(e["log_level"] == "warning" and e.get("pre") == "mystery-bpe" for e in logs)
    pieces = [p for p, _ in tok.inner.pre_tokenizer.pre_tokenize_str("a  12 b")]
    # Plain GPT-2 as the tokenizers library splits it: digits stay together with their space.
    assert pieces == [p for p, _ in _GPT2_BYTE_LEVEL.pre_tokenize_str("a  12 b")] == ["a", "Ġ", "Ġ12", "Ġb"]


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_other_pre_tokenizers_match_transformers(smollm2_checkpoint, pre):
    """The same vocabulary under other pre-tokenizer names, against transformers' GGUF converter
    (which knows these names)."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    meta = smollm2_checkpoint.meta
    reference, _ = mapping.convert_gguf_tokenizer(
        "llama",
        {
            "tokenizer_type": "gpt2",
            "pre_tokenizer_type": pre,
            "tokens": meta("tokenizer.ggml.tokens"),
            "token_type": meta("tokenizer.ggml.token_type"),
            "merges": meta("tokenizer.ggml.merges"),
        },
    )
    tok = Tokenizer.from_gguf(_Metadata(smollm2_checkpoint, **{"tokenizer.ggml.pre": pre}))
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids, text


def test_from_hf_dir_reads_a_saved_transformers_tokenizer(hf_smollm2_tokenizer, tmp_path):
    hf_smollm2_tokenizer.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:  # tokenizer.json carries transformers' own pre-tokenizer, divergent texts included
        assert tok.encode(text) == hf_smollm2_tokenizer.encode(text), text
    assert tok.bos_token_id == hf_smollm2_tokenizer.bos_token_id
    assert tok.eos_token_ids == (hf_smollm2_tokenizer.eos_token_id,)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == hf_smollm2_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_from_hf_dir_honours_add_bos_token(hf_smollm2_tokenizer, tmp_path):
    hf_smollm2_tokenizer.save_pretrained(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["add_bos_token"] = True
    config_file.write_text(json.dumps(config))
    tok = Tokenizer.from_hf_dir(tmp_path, chat_template="{{ messages[0]['content'] }}")
    assert tok.encode("Hi") == [hf_smollm2_tokenizer.bos_token_id, *hf_smollm2_tokenizer.encode("Hi")]
    assert tok.encode("Hi", add_special_tokens=False) == hf_smollm2_tokenizer.encode("Hi")
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == "Hi"


def test_from_hf_dir_without_tokenizer_json_is_a_format_error(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelFormatError, match=r"no tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match=r"not a readable tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)


# -- SentencePiece ("llama" tokenizer model) --------------------------------------------------------
# The reference ids come from the sentencepiece library itself (stored with the vocabulary in
# tests/data/sentencepiece_tiny.json); transformers' GGUF loader is a second reference.
SPM_CASES = json.loads(_tokenizer_fixtures.SENTENCEPIECE_DATA.read_text(encoding="utf-8"))["cases"]


@pytest.mark.parametrize("case", SPM_CASES, ids=[repr(c["text"]) for c in SPM_CASES])
def test_sentencepiece_gguf_matches_sentencepiece(sentencepiece_tokenizer, case):
    tok = sentencepiece_tokenizer
    assert tok.encode(case["text"], add_special_tokens=False) == case["ids"]
    assert tok.encode(case["text"]) == [1, *case["ids"]]  # a SentencePiece GGUF adds BOS unless it says not to
    assert tok.decode(case["ids"]) == case["text"]


def test_sentencepiece_gguf_matches_transformers(sentencepiece_gguf, sentencepiece_tokenizer):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(sentencepiece_gguf.parent), gguf_file=sentencepiece_gguf.name)
    tok = sentencepiece_tokenizer
    compared = 0
    for case in SPM_CASES:
        # transformers' Metaspace leaves out the "▁" prefix when the text already starts with a space;
        # sentencepiece and llama.cpp add it (ids checked against sentencepiece above).
        if not case["text"].startswith(" "):
            assert tok.encode(case["text"]) == hf.encode(case["text"]), case["text"]
            assert tok.decode(case["ids"]) == hf.decode(case["ids"])
            compared += 1
    assert compared >= len(SPM_CASES) - 3
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (len(hf), hf.bos_token_id, (hf.eos_token_id,))


def test_sentencepiece_special_tokens_follow_llama_cpp(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    ids = tok.encode("<|im_start|>user Hello<|im_end|>")
    # llama.cpp prefixes a space to each run of text that follows a special token.
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "<|im_start|>", "▁", "u", "s", "er", "▁Hello", "<|im_end|>"]


def test_sentencepiece_flags_turn_off_bos_and_space_prefix(tmp_path):
    from ruvllm.checkpoint import GGUFCheckpoint

    path = _tokenizer_fixtures.write_sentencepiece_gguf(
        tmp_path / "t.gguf", add_bos_token=False, add_space_prefix=False
    )
    tok = Tokenizer.from_gguf(GGUFCheckpoint(path))
    ids = tok.encode("Hello world")
    assert [tok.id_to_token(i) for i in ids] == ["H", "ello", "▁world"]
    assert tok.decode(ids) == "Hello world"


def test_sentencepiece_without_scores_is_a_format_error(sentencepiece_gguf):
    from ruvllm.checkpoint import GGUFCheckpoint

    broken = _Metadata(GGUFCheckpoint(sentencepiece_gguf), **{"tokenizer.ggml.scores": None})
    with pytest.raises(ModelFormatError, match="score"):
        Tokenizer.from_gguf(broken)
