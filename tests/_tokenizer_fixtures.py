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


SENTENCEPIECE_DATA = Path(__file__).parent / "data" / "sentencepiece_tiny.json"


def write_sentencepiece_gguf(path: Path, **metadata: Any) -> Path:
    """A GGUF holding the tiny SentencePiece vocabulary of ``data/sentencepiece_tiny.json`` the way
    llama.cpp's converter writes one (tokenizer model "llama", scores, token types), a Llama config
    and a token embedding; ``metadata`` adds or overrides ``tokenizer.ggml.*`` booleans."""
    import json

    import gguf
    import numpy as np

    data = json.loads(SENTENCEPIECE_DATA.read_text(encoding="utf-8"))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(data["tokens"])
    w.add_token_scores(data["scores"])
    w.add_token_types(data["token_types"])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in metadata.items():
        w.add_bool(f"tokenizer.ggml.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((len(data["tokens"]), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def sentencepiece_gguf(tmp_path_factory) -> Path:
    return write_sentencepiece_gguf(tmp_path_factory.mktemp("spm") / "tiny-spm.gguf")


@pytest.fixture(scope="session")
def sentencepiece_tokenizer(sentencepiece_gguf):
    """ruvllm's tokenizer for a tiny SentencePiece ("llama" tokenizer model) GGUF."""
    from ruvllm.checkpoint import GGUFCheckpoint
    from ruvllm.tokenizer import Tokenizer

    return Tokenizer.from_gguf(GGUFCheckpoint(sentencepiece_gguf))
