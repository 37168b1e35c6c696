"""A :class:`~ruvllm.model_config.ModelConfig` from GGUF metadata (llama.cpp's keys) and the tensors
that carry RoPE factors, with every key that would change the arithmetic and is not implemented
refused by name."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from ruvllm.architectures.families import expert_fields, family_of_gguf
from ruvllm.errors import ModelFormatError
from ruvllm.model_config import ModelConfig, Rope

# -- GGUF metadata --------------------------------------------------------------------------------------


def config_from_gguf(
    meta: Callable[[str], Any],
    tensor: Callable[[str], Any],
    has_tensor: Callable[[str], bool],
    vocab_rows: int,
    where: str,
    token_id: Callable[[str], int | None] = lambda text: None,
) -> ModelConfig:
    """A :class:`ModelConfig` from GGUF metadata (``meta(key)`` -> value or None) and the tensors
    that carry RoPE factors (``tensor(name)`` -> float32 array)."""
    arch = meta("general.architecture")
    if arch is None:
        raise ModelFormatError(f"{where}: GGUF has no general.architecture")
    fam = family_of_gguf(str(arch), where)

    def get(key: str, default: Any = None) -> Any:
        v = meta(f"{arch}.{key}")
        return default if v is None else v

    def need(key: str) -> Any:
        v = meta(f"{arch}.{key}")
        if v is None:
            raise ModelFormatError(f"{where}: GGUF metadata lacks {arch}.{key}")
        return v

    def refuse(key: str, value: Any, why: str = "is not implemented") -> None:
        raise ModelFormatError(f"{where}: GGUF metadata {arch}.{key}={value!r} {why}; ruvllm refuses to approximate it")

    hidden, layers = int(need("embedding_length")), int(need("block_count"))
    n_head = int(need("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_head)
    if isinstance(n_kv, list):
        if len(set(n_kv)) != 1:
            refuse("attention.head_count_kv", n_kv, "(a different KV head count per layer) is not supported")
        n_kv = n_kv[0]
    head_dim = int(get("attention.key_length", hidden // n_head))
    if int(get("attention.value_length", head_dim)) != head_dim:
        refuse("attention.value_length", get("attention.value_length"), f"differs from key_length {head_dim}")
    rot = get("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        refuse("rope.dimension_count", rot, f"(partial rotary embedding of a {head_dim}-wide head) is not implemented")
    for key in ("attn_logit_softcapping",):
        if get(key):
            refuse(key, get(key))
    softcap = get("final_logit_softcapping")
    if softcap and not fam.supports_final_softcap:
        refuse("final_logit_softcapping", softcap)

    theta = float(get("rope.freq_base", 10000.0))
    kind = str(get("rope.scaling.type", "none"))
    factor = float(get("rope.scaling.factor", 1.0) or 1.0)
    original = get("rope.scaling.original_context_length")
    attn_factor = get("rope.scaling.attn_factor")
    context = int(get("context_length", 2048))
    divisors = None
    if has_tensor("rope_freqs.weight"):  # llama3's scaling as llama.cpp stores it
        divisors = tuple(float(v) for v in tensor("rope_freqs.weight"))
    rope: Rope
    if has_tensor("rope_factors_short.weight") or has_tensor("rope_factors_long.weight"):
        if not original:
            refuse("rope.scaling.original_context_length", original, "must be given with LongRoPE factors")
        short = tuple(float(v) for v in tensor("rope_factors_short.weight"))
        long_ = tuple(float(v) for v in tensor("rope_factors_long.weight"))
        rope = Rope(
            theta=theta,
            kind="longrope",
            factor=context / int(original),
            original_max_position=int(original),
            short_factor=short,
            long_factor=long_,
            explicit_attention_factor=float(attn_factor) if attn_factor else None,
        )
        context = min(context, int(original))  # see config_from_hf: the short factors' range
    elif kind in ("none", "linear"):
        rope = Rope(
            theta=theta,
            kind="linear" if kind == "linear" and factor != 1.0 else "default",
            factor=factor,
            freq_divisors=divisors,
        )
    elif kind == "yarn":
        if not original:
            refuse("rope.scaling.original_context_length", original, "must be given for YaRN")
        rope = Rope(
            theta=theta,
            kind="yarn",
            factor=factor,
            original_max_position=int(original),
            beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
            explicit_attention_factor=float(attn_factor) if attn_factor else None,
            freq_divisors=divisors,
        )
    else:
        refuse("rope.scaling.type", kind, "is not a RoPE scaling ruvllm implements (none, linear, yarn)")

    window = get("attention.sliding_window")
    windows: tuple[int, ...] = ()
    rope_local = None
    if window:
        window = int(window)
        pattern = get("attention.sliding_window_pattern")
        if isinstance(pattern, list):  # per layer: true = sliding
            windows = tuple(window if p else 0 for p in pattern)
        elif fam.global_period:
            period = int(pattern or fam.global_period)
            windows = tuple(0 if (i + 1) % period == 0 else window for i in range(layers))
        elif fam.window_on_every_layer or fam.name == "llama":
            windows = (window,) * layers
        else:
            refuse("attention.sliding_window", window, f"is not part of the {fam.name} architecture")
        if fam.gguf_local_rope_theta is not None:
            rope_local = Rope(theta=float(get("rope.freq_base_swa", fam.gguf_local_rope_theta)))
    query_scale = None
    if fam.name == "gemma3":
        # llama.cpp: 1/sqrt(head_dim), except Gemma-3-27B (62 layers) which scales by hidden/heads.
        query_scale = (hidden / n_head) ** -0.5 if layers == 62 else head_dim**-0.5

    experts: dict[str, Any] = {}
    if get("expert_count"):
        # llama.cpp's qwen3moe and llama (Mixtral) graphs: softmax over the experts, top-k, renormalised
        # (whatever the HF config's norm_topk_prob was: its converter does not write it).
        for key, neutral in (
            ("expert_shared_count", 0),
            ("leading_dense_block_count", 0),
            ("expert_weights_scale", 1.0),
            ("expert_gating_func", 1),  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        ):
            if get(key, neutral) != neutral:
                refuse(key, get(key))
        experts = expert_fields(
            int(get("expert_count")),
            int(get("expert_used_count", 0)),
            int(get("expert_feed_forward_length", get("feed_forward_length", 0))),
            refuse,
            ("expert_count", "expert_used_count", "expert_feed_forward_length"),
        )
        experts["norm_topk_prob"] = bool(get("expert_weights_norm", True))
        experts["routing"] = fam.routing
        experts["router_bias"] = has_tensor("blk.0.ffn_gate_inp.bias")
        experts["expert_bias"] = has_tensor("blk.0.ffn_gate_exps.bias")
    elif fam.experts:
        refuse("expert_count", get("expert_count"), f"must be given for {fam.name}")

    gpt_oss: dict[str, Any] = {}
    if fam.name == "gpt_oss":
        # llama.cpp's constants for gpt-oss's SwiGLU; YaRN unrounded, as OpenAI's and HF's models compute it.
        gpt_oss = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
        if rope.kind == "yarn":
            rope = dataclasses.replace(rope, truncate=False)

    eos = meta("tokenizer.ggml.eos_token_id")
    eot = meta("tokenizer.ggml.eot_token_id")
    bos = meta("tokenizer.ggml.bos_token_id")
    extra_eos = tuple(i for i in (token_id(t) for t in fam.end_of_turn_texts) if i is not None)
    return ModelConfig(
        architecture=fam.name,
        vocab_size=int(get("vocab_size", vocab_rows)),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", 0) if get("expert_count") else need("feed_forward_length")),
        num_layers=layers,
        num_heads=n_head,
        num_kv_heads=int(n_kv),
        head_dim=head_dim,
        max_position_embeddings=context,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        tie_word_embeddings=not has_tensor("output.weight"),
        attention_bias=has_tensor("blk.0.attn_q.bias") or has_tensor("blk.0.attn_qkv.bias"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(dict.fromkeys(int(x) for x in (eos, eot, *extra_eos) if x is not None)),
        name=str(meta("general.name") or ""),
        activation=fam.activation,
        qk_norm=fam.qk_norm or has_tensor("blk.0.attn_q_norm.weight"),
        output_norms=fam.output_norms,
        embedding_scale=math.sqrt(hidden) if fam.scale_embeddings else 1.0,
        query_scale=query_scale,
        layer_windows=windows,
        rope=rope,
        rope_local=rope_local,
        final_logit_softcap=float(softcap) if softcap else None,
        o_proj_bias=has_tensor("blk.0.attn_output.bias"),
        attention_sinks=has_tensor("blk.0.attn_sinks.weight"),
        **gpt_oss,
        **experts,
    )
