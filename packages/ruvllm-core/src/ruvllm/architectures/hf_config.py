"""A :class:`~ruvllm.model_config.ModelConfig` from a Hugging Face ``config.json`` (transformers v4
or v5 layout): its RoPE, sliding windows, mixture of experts and gpt_oss's SwiGLU, with every field
that would change the arithmetic and is not implemented refused by name."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NoReturn

from ruvllm.architectures.families import Family, expert_fields, family_of_hf
from ruvllm.errors import ModelFormatError
from ruvllm.model_config import ROPE_TYPES, ModelConfig, Rope

# -- HF config.json -------------------------------------------------------------------------------------


def _refuse(where: str, field_name: str, value: Any, why: str = "is not implemented") -> NoReturn:
    raise ModelFormatError(f"{where}: config field {field_name}={value!r} {why}; ruvllm refuses to approximate it")


def _hf_rope(params: Mapping[str, Any], c: Mapping[str, Any], where: str, key: str) -> Rope:
    """A :class:`Rope` from one HF rope dict (v4 ``rope_scaling`` merged with ``rope_theta``, or v5
    ``rope_parameters``)."""
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        _refuse(where, f"{key}.rope_type", kind, f"is not a RoPE type ruvllm implements ({', '.join(ROPE_TYPES)})")
    prf = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        _refuse(where, "partial_rotary_factor", prf)
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    original = params.get("original_max_position_embeddings", c.get("original_max_position_embeddings"))
    factor = params.get("factor")
    if kind in ("longrope", "yarn") and factor is None and original:
        factor = c.get("max_position_embeddings", original) / original
    if kind in ("linear", "dynamic", "llama3", "yarn") and factor is None:
        _refuse(where, f"{key}.factor", None, f"must be given for rope_type {kind}")
    known = {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "original_max_position_embeddings",
        "partial_rotary_factor",
        "low_freq_factor",
        "high_freq_factor",
        "beta_fast",
        "beta_slow",
        "truncate",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "short_factor",
        "long_factor",
    }
    for extra in sorted(set(params) - known):
        _refuse(where, f"{key}.{extra}", params[extra])
    if kind in ("llama3", "yarn", "longrope") and not original:
        original = c.get("max_position_embeddings") if kind == "yarn" else None
        if not original:
            _refuse(where, f"{key}.original_max_position_embeddings", None, f"must be given for rope_type {kind}")
    return Rope(
        theta=theta,
        kind=kind,
        factor=float(factor) if factor is not None else 1.0,
        original_max_position=int(original) if original else None,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        explicit_attention_factor=(
            float(params["attention_factor"]) if params.get("attention_factor") is not None else None
        ),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        short_factor=tuple(params["short_factor"]) if params.get("short_factor") is not None else None,
        long_factor=tuple(params["long_factor"]) if params.get("long_factor") is not None else None,
    )


def _hf_ropes(c: Mapping[str, Any], fam: Family, where: str) -> tuple[Rope, Rope | None]:
    """Global and (gemma3) local RoPE from a v4 or v5 config."""
    params = c.get("rope_parameters")
    if isinstance(params, Mapping) and {"full_attention", "sliding_attention"} & set(params):
        glob = _hf_rope(params.get("full_attention", {}), c, where, "rope_parameters.full_attention")
        local = params.get("sliding_attention")
        return glob, (_hf_rope(local, c, where, "rope_parameters.sliding_attention") if local else None)
    if isinstance(params, Mapping):
        glob = _hf_rope(params, c, where, "rope_parameters")
    else:
        scaling = c.get("rope_scaling") or {}
        glob = _hf_rope({**scaling, "rope_theta": c.get("rope_theta", 10000.0)}, c, where, "rope_scaling")
    local = None
    if fam.global_period and c.get("rope_local_base_freq") is not None:
        local = Rope(theta=float(c["rope_local_base_freq"]))
    return glob, local


def _hf_windows(c: Mapping[str, Any], fam: Family, layers: int, where: str) -> tuple[int, ...]:
    window = c.get("sliding_window")
    types = c.get("layer_types")
    if types is not None:
        if len(types) != layers:
            _refuse(where, "layer_types", f"{len(types)} entries", f"does not match num_hidden_layers={layers}")
        for t in types:
            if t not in ("full_attention", "sliding_attention"):
                _refuse(where, "layer_types", t)
        if "sliding_attention" in types and not window:
            _refuse(where, "sliding_window", window, "must be set when layer_types has sliding_attention")
        return tuple(int(window) if t == "sliding_attention" else 0 for t in types) if window else ()
    if not window:
        return ()
    window = int(window)
    if fam.global_period:
        period = int(c.get("sliding_window_pattern", c.get("_sliding_window_pattern", fam.global_period)))
        return tuple(0 if (i + 1) % period == 0 else window for i in range(layers))
    if "use_sliding_window" in c:  # qwen2/qwen3: off unless asked, then from max_window_layers on
        if not c["use_sliding_window"]:
            return ()
        first = int(c.get("max_window_layers", 0))
        return tuple(window if i >= first else 0 for i in range(layers))
    if fam.window_on_every_layer:
        return (window,) * layers
    _refuse(where, "sliding_window", window, f"is not part of the {fam.name} architecture")
    return ()


def _hf_experts(c: Mapping[str, Any], fam: Family, where: str) -> dict[str, Any]:
    if not fam.experts:
        return {}
    step = c.get("decoder_sparse_step", 1)
    if step not in (None, 1):
        _refuse(where, "decoder_sparse_step", step, "(dense layers between MoE layers) is not implemented")
    if c.get("mlp_only_layers"):
        _refuse(where, "mlp_only_layers", c["mlp_only_layers"], "(dense layers among MoE layers) is not implemented")
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if c.get(key):
            _refuse(where, key, c[key], "(shared experts) is not implemented")
    count_key = "num_experts" if c.get("num_experts") is not None else "num_local_experts"
    n, k = c.get(count_key), c.get("num_experts_per_tok")
    if n is None or k is None:
        missing = count_key if n is None else "num_experts_per_tok"
        _refuse(where, missing, None, f"must be given for {fam.name}")

    def refuse(key: str, value: Any, why: str) -> NoReturn:
        _refuse(where, key, value, why)

    width = c.get(fam.hf_expert_size)
    fields = expert_fields(
        int(n), int(k), int(width or 0), refuse, (count_key, "num_experts_per_tok", fam.hf_expert_size)
    )
    fields["norm_topk_prob"] = fam.always_norm_topk or bool(c.get("norm_topk_prob", False))
    fields["routing"] = fam.routing
    fields["router_bias"] = fields["expert_bias"] = fam.moe_biases
    return fields


def _swiglu(c: Mapping[str, Any], fam: Family, where: str) -> dict[str, Any]:
    if fam.activation != "swiglu_oai":
        return {}
    alpha, limit = c.get("swiglu_alpha", 1.702), c.get("swiglu_limit", 7.0)
    if not limit or limit <= 0:
        _refuse(where, "swiglu_limit", limit, "(an unclamped gate) is not implemented")
    return {"swiglu_alpha": float(alpha), "swiglu_limit": float(limit)}


def _bidirectional_windows(windows: tuple[int, ...], c: Mapping[str, Any]) -> tuple[int, ...]:
    """transformers stores a bidirectional model's ``sliding_window`` as ``(w - 1) * 2`` and attends where
    ``|q - k| < w`` (Gemma3TextConfig: ``w = sliding_window // 2 + 1``): ruvllm's window is that ``w``."""
    if not c.get("use_bidirectional_attention"):
        return windows
    return tuple(w // 2 + 1 if w else 0 for w in windows)


def config_from_hf(c: Mapping[str, Any], where: str, has_lm_head: bool) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` (transformers v4 or v5 layout)."""
    fam = family_of_hf(str(c.get("model_type", "")), where)
    if fam.layout == "bert":
        from ruvllm.architectures.encoder_config import bert_config

        return bert_config(c, fam, where)
    if c.get("quantization_config"):
        method = c["quantization_config"].get("quant_method", "?")
        _refuse(where, "quantization_config", method, "(pre-quantized HF checkpoints) is not supported")
    act = c.get("hidden_activation") or c.get("hidden_act") or fam.hf_activations[0]
    if act not in fam.hf_activations:
        _refuse(where, "hidden_act", act, f"is not {fam.name}'s activation ({', '.join(fam.hf_activations)})")
    for key in (
        "attn_logit_softcapping",
        "mlp_bias",
        *(() if fam.bidirectional_attention else ("use_bidirectional_attention",)),
        "embedding_multiplier",
        "logits_scaling",
        "residual_multiplier",
        "attention_multiplier",
    ):
        if c.get(key):
            _refuse(where, key, c[key])
    if c.get("final_logit_softcapping") and not fam.supports_final_softcap:
        _refuse(where, "final_logit_softcapping", c["final_logit_softcapping"])
    if fam.o_proj_bias and not c.get("attention_bias", True):
        _refuse(where, "attention_bias", False, f"({fam.name} without biases) is not implemented")
    if c.get("attention_bias") and not fam.qkv_bias:
        _refuse(where, "attention_bias", True, f"(an o_proj bias) is not implemented for {fam.name}")
    n_head, hidden, layers = int(c["num_attention_heads"]), int(c["hidden_size"]), int(c["num_hidden_layers"])
    head_dim = int(c.get("head_dim") or hidden // n_head)
    rope, rope_local = _hf_ropes(c, fam, where)
    max_pos = int(c.get("max_position_embeddings", 2048))
    if rope.kind == "longrope" and rope.original_max_position:
        # Short factors hold within the pre-trained context (what transformers uses there); past it
        # transformers switches every position's frequencies mid-sequence. ruvllm serves the short range.
        max_pos = min(max_pos, rope.original_max_position)
    eos = c.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
    qps = c.get("query_pre_attn_scalar")
    return ModelConfig(
        architecture=fam.name,
        vocab_size=int(c["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(c["intermediate_size"]),
        num_layers=layers,
        num_heads=n_head,
        num_kv_heads=int(c.get("num_key_value_heads") or n_head),
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6 if fam.name == "gemma3" else 1e-5)),
        rope_theta=rope.theta,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", fam.name == "gemma3")) or not has_lm_head,
        attention_bias=fam.qkv_bias,
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=eos_ids,
        activation=fam.activation,
        qk_norm=fam.qk_norm,
        output_norms=fam.output_norms,
        embedding_scale=math.sqrt(hidden) if fam.scale_embeddings else 1.0,
        query_scale=float(qps) ** -0.5 if qps else None,
        layer_windows=_bidirectional_windows(_hf_windows(c, fam, layers, where), c),
        rope=rope,
        rope_local=rope_local,
        final_logit_softcap=float(c["final_logit_softcapping"]) if c.get("final_logit_softcapping") else None,
        o_proj_bias=fam.o_proj_bias,
        attention_sinks=fam.attention_sinks,
        bidirectional=bool(c.get("use_bidirectional_attention", False)),
        **_swiglu(c, fam, where),
        **_hf_experts(c, fam, where),
    )
