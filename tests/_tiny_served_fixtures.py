"""A tiny random-weight Llama with a word-level tokenizer ("w0" .. "w96"), loaded on candle-compat with
a plugin host of its own: enough for the engine and the server to run it in milliseconds per request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _candle_compat_fixtures import write_tiny_hf_checkpoint

TINY_VOCAB = 97


def write_word_tokenizer(path: Path, vocab: int = TINY_VOCAB) -> None:
    import tokenizers

    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    inner.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    inner.save(str(path / "tokenizer.json"))


def tiny_served_model(path: Path) -> Any:
    """The tiny checkpoint at ``path`` (written there), loaded as a ``LoadedModel``."""
    from ruvllm.runtime import load_model

    write_tiny_hf_checkpoint(path, layers=2, hidden=48, vocab=TINY_VOCAB, max_positions=128)
    write_word_tokenizer(path)
    return load_model(str(path), backend="candle-compat")
