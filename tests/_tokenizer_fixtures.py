"""Tokenizer fixtures shared by the tokenizer, chat-template and detokenizer tests.

Test modules import the fixtures by name; the objects are cached here so the GGUF tokenizer and the
transformers reference (about 15 s to load) are built once per session, not once per module.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest


@cache
def _ruvllm_tokenizer(checkpoint: Any) -> Any:
    from ruvllm.tokenizer import Tokenizer

    return Tokenizer.from_gguf(checkpoint)


@cache
def _hf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_checkpoint):
    """ruvllm's tokenizer for the bundled SmolLM2 GGUF."""
    return _ruvllm_tokenizer(smollm2_checkpoint)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    """The reference: transformers' own tokenizer built from the same GGUF file."""
    pytest.importorskip("transformers")
    return _hf_tokenizer(smollm2_path)
