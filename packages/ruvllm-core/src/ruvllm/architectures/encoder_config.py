"""A :class:`~ruvllm.model_config.ModelConfig` from a BERT ``config.json`` (``layout="bert"``): learned
absolute positions, token types, post-norm LayerNorm, GELU (erf). Fields that would change the arithmetic
and are not implemented are refused by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from ruvllm.architectures.families import Family
from ruvllm.errors import ModelFormatError
from ruvllm.model_config import ModelConfig


def _refuse(where: str, field_name: str, value: Any, why: str = "is not implemented") -> NoReturn:
    raise ModelFormatError(f"{where}: config field {field_name}={value!r} {why}; ruvllm refuses to approximate it")


def bert_config(c: Mapping[str, Any], fam: Family, where: str) -> ModelConfig:
    """BERT's fields; ``rms_norm_eps`` holds its LayerNorm's eps."""
    if c.get("quantization_config"):
        _refuse(where, "quantization_config", c["quantization_config"].get("quant_method", "?"))
    act = c.get("hidden_act", "gelu")
    if act not in fam.hf_activations:
        _refuse(where, "hidden_act", act, f"is not one ruvllm implements for bert ({', '.join(fam.hf_activations)})")
    pos = c.get("position_embedding_type", "absolute")
    if pos != "absolute":
        _refuse(where, "position_embedding_type", pos)
    for key in ("is_decoder", "add_cross_attention"):
        if c.get(key):
            _refuse(where, key, c[key], "(a BERT decoder) is not implemented")
    n_head, hidden = int(c["num_attention_heads"]), int(c["hidden_size"])
    if hidden % n_head:
        _refuse(where, "num_attention_heads", n_head, f"does not divide hidden_size={hidden}")
    return ModelConfig(
        architecture=fam.name,
        vocab_size=int(c["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(c["intermediate_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=n_head,
        num_kv_heads=n_head,
        head_dim=hidden // n_head,
        max_position_embeddings=int(c.get("max_position_embeddings", 512)),
        rms_norm_eps=float(c.get("layer_norm_eps", 1e-12)),
        tie_word_embeddings=True,
        attention_bias=True,
        o_proj_bias=True,
        activation="gelu",
        bidirectional=True,
        layout="bert",
        type_vocab_size=int(c.get("type_vocab_size", 2)),
        bos_token_id=c.get("bos_token_id"),
    )
