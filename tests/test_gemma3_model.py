"""The second real model, Gemma-3-270M (GGUF Q4_K_M, from the ``gemma3`` alias): the alias joins its
chunk packages into ruvllm's cache (sha256 checked, one-line errors), its tokenizer gives
transformers' ids, its chat template renders as transformers renders it, and greedy continuations on
both backends equal transformers' on the same GGUF, with one prompt longer than the 512-token window
of its local layers.

Greedy agreement is checked teacher-forced (see test_jax_smollm2_parity): transformers runs once over
prompt + our continuation and its argmax at every position must be our next token. Logits are also
compared (Gemma's are O(10-30) after the final norm; 2e-3 absolute after 18 float32 layers of
independent implementations, far below what a wrong window, RoPE base or norm does)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from _hf_reference import hf_encode, hf_logits
from _jax_fixtures import GreedyDecoder, jax_model_at, load_jax, mean_kl, prompt_logits
from test_tokenizer_parity import TEXTS

from ruvllm.checkpoint import open_checkpoint
from ruvllm.errors import ModelNotFoundError
from ruvllm.resolve import ALIASES, Alias, alias_path, assembled_path

LOGIT_ATOL = 2e-3
NEW_TOKENS = 24

GEMMA_TEXTS = [
    *TEXTS,
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>two <eos> specials<pad>",
    "Ünïcödé   ⁂ 𝔘𝔫𝔦 \u3000 full-width　space",
    "\n\n\n  \t",
]


def _long_prompt() -> str:
    """About 560 tokens: past the 512-token window of Gemma-3's local layers."""
    facts = [
        f"Fact {i}: the {c} box holds {i * 7 % 23} marbles and sits on shelf {i % 5}."
        for i, c in enumerate(["red", "blue", "green", "yellow", "white", "black"] * 5)
    ]
    return " ".join(facts) + " Question: how many marbles does the first red box hold? Answer:"


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", _long_prompt()]


# -- the alias ---------------------------------------------------------------------------------------


def _fake_distribution(root: Path, name: str, rel: str, data: bytes) -> None:
    """An installed distribution (dist-info metadata + one data file) on ``root``."""
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(data)


@pytest.fixture
def split_alias(tmp_path, monkeypatch):
    """A three-part alias over distributions installed into a directory on sys.path."""
    site = tmp_path / "site"
    rng = np.random.default_rng(0)
    chunks = [rng.bytes(n) for n in (5000, 70_000, 123)]
    for i, data in enumerate(chunks):
        _fake_distribution(site, f"ruvllm-test-chunk{i}", f"chunk{i}/data/model.gguf.part{i:02d}", data)
    monkeypatch.syspath_prepend(str(site))
    files = tuple((f"ruvllm-test-chunk{i}", f"chunk{i}/data/model.gguf.part{i:02d}") for i in range(3))
    alias = Alias(
        "splitty", "test", files, "pip install splitty", "model.gguf", hashlib.sha256(b"".join(chunks)).hexdigest()
    )
    return alias, site, b"".join(chunks)


def test_split_alias_is_joined_once_and_checked(split_alias, tmp_path):
    alias, _site, whole = split_alias
    cache = tmp_path / "cache"
    path = alias_path(alias, cache)
    assert path == assembled_path(alias, cache) and path.read_bytes() == whole
    mtime = path.stat().st_mtime_ns
    assert alias_path(alias, cache) == path and path.stat().st_mtime_ns == mtime  # not joined again
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # no temporary left behind


def test_corrupt_or_missing_chunk_is_a_one_line_error(split_alias, tmp_path):
    alias, site, _whole = split_alias
    part = site / alias.files[1][1]
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(ModelNotFoundError, match="sha256") as info:
        alias_path(alias, tmp_path / "c1")
    assert "\n" not in str(info.value) and "reinstall" in str(info.value)
    assert not assembled_path(alias, tmp_path / "c1").exists()  # nothing half-made is left to be used

    part.unlink()
    with pytest.raises(ModelNotFoundError, match=r"ruvllm-test-chunk1 is installed but .* is missing") as info:
        alias_path(alias, tmp_path / "c2")
    assert "\n" not in str(info.value)

    missing = Alias("splitty", "t", (alias.files[0], ("ruvllm-test-chunk-absent", "x/y")), "pip install splitty")
    with pytest.raises(
        ModelNotFoundError, match="ruvllm-test-chunk-absent is not installed: run `pip install splitty`"
    ):
        alias_path(missing, tmp_path / "c3")


def test_gemma3_alias_joins_the_published_file(gemma3_path, tmp_path):
    path = alias_path(ALIASES["gemma3"], tmp_path)  # a fresh cache: joined and sha256-checked here
    assert path.stat().st_size == gemma3_path.stat().st_size == 253_113_024
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.head_dim) == ("gemma3", 18, 640, 256)
    assert cfg.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert cfg.embedding_scale == pytest.approx(640**0.5)
    assert ckpt.quantization in ("Q4_K", "Q4_K_M", "mixed") or "Q4_K" in str(ckpt.matrix_types())


# -- tokenizer and chat template ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_tokenizer(gemma3_path):
    return open_checkpoint(gemma3_path).tokenizer()


@pytest.mark.parametrize("text", GEMMA_TEXTS)
def test_tokenizer_matches_transformers(gemma3_path, gemma3_tokenizer, text):
    want = hf_encode(gemma3_path, text)
    assert gemma3_tokenizer.encode(text, add_special_tokens=False) == want
    assert gemma3_tokenizer.encode(text) == [2, *want]  # the file asks for <bos>
    assert gemma3_tokenizer.decode(want) == _hf_tokenizer(gemma3_path).decode(want)


def _hf_tokenizer(path):
    from _hf_reference import _tokenizer

    return _tokenizer(str(path))


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  Name a colour.  "},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": " Part two. "}]}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one", "system-multi", "parts"])
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_renders_as_transformers(gemma3_path, gemma3_tokenizer, messages, gen):
    hf = _hf_tokenizer(gemma3_path)
    template = gemma3_tokenizer.chat_template
    assert template and "<start_of_turn>" in template
    want = hf.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=gen)
    assert gemma3_tokenizer.apply_chat_template(messages, gen) == want
    if messages is CONVERSATIONS[1] and gen:
        assert want == (
            "<bos><start_of_turn>user\nYou are terse.\n\nName a colour.<end_of_turn>\n"
            "<start_of_turn>model\nBlue.<end_of_turn>\n<start_of_turn>user\nAnother?<end_of_turn>\n"
            "<start_of_turn>model\n"
        )


def test_end_of_turn_stops_generation(gemma3_path):
    cfg = open_checkpoint(gemma3_path).config
    assert 106 in cfg.eos_token_ids and 1 in cfg.eos_token_ids  # <end_of_turn> and <eos>


# -- greedy parity on both backends ------------------------------------------------------------------


def _candle(path):
    pytest.importorskip("ruvllm_candle_compat")
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model

    return load_model(str(path), backend="candle-compat", host=load_plugins("candle-compat"))


def _jax(path):
    return jax_model_at(str(path))  # float32 (the file's blocks dequantized): the exact path


@pytest.fixture(scope="module")
def prompts(gemma3_tokenizer):
    ids = [gemma3_tokenizer.encode(p) for p in PROMPTS]
    assert len(ids[-1]) > 512 + 16, "the long prompt must run past the window"
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["candle-compat", "jax"])
def test_greedy_continuations_match_transformers(gemma3_path, prompts, backend):
    model = (_candle if backend == "candle-compat" else _jax)(gemma3_path)
    # Chunked prefill (the long prompt spans several steps) and interleaved block tables.
    continuations = GreedyDecoder(model, num_blocks=160).run(prompts, NEW_TOKENS, prefill_chunk=200)
    for ids, ours in zip(prompts, continuations, strict=True):
        want = hf_logits(gemma3_path, ids + ours)
        assert want[len(ids) - 1 : len(ids) - 1 + NEW_TOKENS].argmax(-1).tolist() == ours
        got = prompt_logits(model, ids + ours)
        np.testing.assert_allclose(got, want, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.slow
def test_auto_runs_the_files_k_quant_blocks_in_the_native_kernels(gemma3_path, prompts):
    """``quantization="auto"`` keeps the file's Q4_K / Q6_K / Q5_0 / Q8_0 blocks (the w4a8 form, no
    float32 copy of the matrices) and multiplies them in the native kernels; its logits stay close to
    float32's (mean KL 0.0005-0.0023 nats on these prompts on an Intel Xeon, avx512vnni; a broken
    block format gives whole nats)."""
    from ruvllm_jax import native

    ckpt = open_checkpoint(gemma3_path)
    model = load_jax(ckpt, quantization="auto")
    if not native.has_vector_path():
        pytest.skip("no vector kernel variant on this CPU: auto keeps float32")
    assert model.options.quantization == "w4a8" and model.native
    reference = jax_model_at(str(gemma3_path))
    assert model.weight_bytes < reference.weight_bytes / 3
    for ids in prompts:
        kl = mean_kl(prompt_logits(reference, ids), prompt_logits(model, ids))
        assert kl < 0.05, kl
