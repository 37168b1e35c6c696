"""The architecture table: one row per model family, read by every checkpoint format and backend.

A row says what the family computes (norms, activation, QK-norm, embedding scale, attention pattern,
RoPE) and what its tensors are called in GGUF files and in Hugging Face checkpoints. Checkpoints
present every family's tensors under one set of *canonical* names (below), already in the form the
arithmetic wants: fused matrices split (phi3's ``qkv_proj``, ``gate_up_proj``), Gemma's ``1 + w`` norm
weights folded (as llama.cpp folds them into its GGUF files), llama.cpp's Q/K row permutation undone.
So a backend implements the fields of :class:`~ruvllm.model_config.ModelConfig`, never a family.

Canonical per-layer names (prefix ``model.layers.{n}.``):

==============================  ===========================================================
``input_layernorm.weight``      RMSNorm before attention
``self_attn.{q,k,v,o}_proj.*``  projections (``weight``; ``bias`` for q/k/v when ``attention_bias``)
``self_attn.{q,k}_norm.weight`` per-head RMSNorm of queries and keys (``qk_norm``)
``attn_output_norm.weight``     RMSNorm of the attention output (``output_norms``; Gemma's
                                ``post_attention_layernorm``)
``post_attention_layernorm.*``  RMSNorm before the MLP (Gemma's ``pre_feedforward_layernorm``)
``mlp.{gate,up,down}_proj.*``   the gated MLP
``mlp_output_norm.weight``      RMSNorm of the MLP output (``output_norms``)
``mlp.gate.weight``             the router ``[experts, hidden]`` of a mixture of experts, whose
                                layers have no dense MLP but
``mlp.experts.{e}.{gate,up,down}_proj.weight``  each expert's gated MLP (GGUF's ``ffn_*_exps``
                                hold every expert in one 3-D tensor: expert ``e`` is its slice)
==============================  ===========================================================

and ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight``.

Where each field comes from:

=====================  ===========================================  ==========================================
field                  GGUF metadata                                HF config.json
=====================  ===========================================  ==========================================
RoPE base              ``{arch}.rope.freq_base``                    ``rope_theta`` / ``rope_parameters``
RoPE scaling           ``{arch}.rope.scaling.type``/``.factor``/    ``rope_scaling`` (v4) or
                       ``.original_context_length``/``.attn_factor``  ``rope_parameters`` (v5; per layer type
                       tensors ``rope_freqs`` (llama3),              for gemma3): ``rope_type``, ``factor``...
                       ``rope_factors_long``/``_short`` (phi3)
local RoPE base        gemma3: 10000 (llama.cpp's constant)         ``rope_local_base_freq`` or
                                                                    ``rope_parameters.sliding_attention``
sliding window         ``{arch}.attention.sliding_window``          ``sliding_window`` (+ ``layer_types``,
                       (gemma3: every 6th layer global)              ``use_sliding_window``/``max_window_layers``)
QK-norm                tensors ``attn_q_norm``/``attn_k_norm``      family (qwen3, gemma3)
sandwich norms         tensors ``post_attention_norm``/``post_ffw``  family (gemma3)
activation             family                                       ``hidden_act`` / ``hidden_activation``
embedding scale        family (gemma: sqrt(hidden))                 family
query scale            gemma3: head_dim (27B: hidden / heads)       ``query_pre_attn_scalar``
logit soft-capping     ``{arch}.final_logit_softcapping``           ``final_logit_softcapping``
experts, top-k         ``{arch}.expert_count``/``.expert_used_count``  ``num_experts`` (``num_local_experts``),
                                                                    ``num_experts_per_tok``
expert MLP width       ``{arch}.expert_feed_forward_length``         ``moe_intermediate_size`` (qwen3_moe),
                       (else ``feed_forward_length``: mixtral)       ``intermediate_size`` (mixtral)
top-k renormalised     ``{arch}.expert_weights_norm``, else always   ``norm_topk_prob`` (mixtral: always)
                       (llama.cpp's qwen3moe and llama graphs)
=====================  ===========================================  ==========================================

gpt_oss: HF stores its experts fused (``mlp.experts.gate_up_proj`` ``[experts, hidden, 2 * inter]``,
gate/up interleaved; cut per expert by :func:`hf_expert_views`), its router as ``mlp.router``, sinks as
``self_attn.sinks``; its GGUF (``gpt-oss``) has ``attn_sinks``, biases on ``ffn_*_exps`` and
``ffn_gate_inp``, and its pre-MLP norm under ``post_attention_norm``; the SwiGLU limit (7) and alpha
(1.702) are llama.cpp's constants there, ``swiglu_limit``/``swiglu_alpha`` in config.json.

A Mixtral GGUF is a ``llama`` file with ``llama.expert_count`` set (llama.cpp's converter). Mixtures
of dense and MoE layers (``decoder_sparse_step``, ``mlp_only_layers``, a GGUF's
``leading_dense_block_count``), shared experts and routers other than a softmax are refused by name.

Anything that would change the arithmetic and is not implemented (an unknown RoPE type, partial
rotary embeddings, attention-logit soft-capping, MLP biases, bidirectional attention, a quantization
config) is refused at load with the field's name: never a silent approximation.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ruvllm.errors import ModelFormatError, UnsupportedArchitectureError
from ruvllm.model_config import ROPE_TYPES, ModelConfig, Rope

#: GGUF per-layer tensor names shared by every family (``blk.{n}.<key>``) -> canonical suffix.
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "attn_output_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "mlp_output_norm",
    "ffn_gate_inp": "mlp.gate",
    "attn_sinks": "self_attn.sinks",
}
#: GGUF's stacked expert tensors (``blk.{n}.<key>``, ``[experts, out, in]``) -> the projection of
#: each expert's ``mlp.experts.{e}.<projection>``.
GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(\w+)$")
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

#: What a fused tensor splits into, by rows: (canonical part, rows as a function of the config).
Split = tuple[tuple[str, Callable[[ModelConfig], int]], ...]

_QKV_SPLIT: Split = (
    ("self_attn.q_proj", lambda c: c.num_heads * c.head_dim),
    ("self_attn.k_proj", lambda c: c.num_kv_heads * c.head_dim),
    ("self_attn.v_proj", lambda c: c.num_kv_heads * c.head_dim),
)
_GATE_UP_SPLIT: Split = (
    ("mlp.gate_proj", lambda c: c.intermediate_size),
    ("mlp.up_proj", lambda c: c.intermediate_size),
)


@dataclass(frozen=True)
class Family:
    """One row of the table: what a family computes and what its tensors are called."""

    name: str
    #: ``general.architecture`` values in GGUF files, and HF ``model_type`` values.
    gguf_archs: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    #: Activation of the gated MLP, and the HF ``hidden_act`` spellings that mean it.
    activation: str = "silu"
    hf_activations: tuple[str, ...] = ("silu", "swish")
    qk_norm: bool = False
    output_norms: bool = False
    #: q/k/v biases (no o_proj bias): qwen2 always has them.
    qkv_bias: bool = False
    #: HF stores RMSNorm weights as ``w`` and applies ``1 + w`` (Gemma); GGUF files hold ``1 + w``.
    hf_norm_offset: float = 0.0
    #: Token embeddings multiplied by sqrt(hidden_size) (Gemma).
    scale_embeddings: bool = False
    #: llama.cpp permutes Q/K rows for interleaved RoPE in these GGUF files (its Llama converter).
    gguf_permuted_qk: bool = False
    #: Interleaved local/global attention: every ``global_period``-th layer is global (gemma3: 6).
    global_period: int = 0
    #: gemma3: RoPE base of the local layers in GGUF files (llama.cpp's constant).
    gguf_local_rope_theta: float | None = None
    #: A window given by the config applies to every layer (mistral, phi3).
    window_on_every_layer: bool = False
    #: HF per-layer names that differ from the canonical ones.
    hf_renames: Mapping[str, str] = field(default_factory=dict)
    #: Fused tensors (per-layer suffix without ``.weight``) -> their parts, for HF and for GGUF.
    hf_fused: Mapping[str, Split] = field(default_factory=dict)
    gguf_fused: Mapping[str, Split] = field(default_factory=dict)
    #: HF config keys this family accepts that would otherwise be refused, with their neutral value.
    supports_final_softcap: bool = False
    #: Tokens that end a turn besides the file's EOS (gemma's ``<end_of_turn>``, as llama.cpp and the
    #: model's generation_config treat it), looked up by text in the vocabulary.
    end_of_turn_texts: tuple[str, ...] = ()
    #: The family's own chat template (``ruvllm/templates/<name>``), used when a GGUF file carries
    #: none (llama.cpp's converter copies the template only when the source repo has one at hand).
    default_chat_template: str | None = None
    #: The MLP is a mixture of experts (every layer: mixes of dense and MoE layers are refused).
    experts: bool = False
    #: HF config key of each expert's MLP width.
    hf_expert_size: str = "moe_intermediate_size"
    #: The top-k weights are always renormalised (mixtral); else HF's ``norm_topk_prob`` says.
    always_norm_topk: bool = False
    #: The router's rule (:data:`~ruvllm.model_config.ROUTINGS`).
    routing: str = "softmax_topk"
    #: gpt_oss: biases on o_proj, the router and the experts; attention sinks; HF's experts fused
    #: ``[experts, in, out]`` with gate and up interleaved (``mlp.experts.gate_up_proj``, ``down_proj``
    #: and their ``_bias``), read by expert through :func:`hf_expert_views`.
    o_proj_bias: bool = False
    attention_sinks: bool = False
    moe_biases: bool = False
    hf_fused_experts: bool = False
    #: GGUF per-layer names that mean another canonical tensor in this family's files (gpt-oss's
    #: ``post_attention_norm`` is its pre-MLP norm).
    gguf_renames: Mapping[str, str] = field(default_factory=dict)
    #: HF module that holds the router and experts when it is not ``mlp`` (mixtral's
    #: ``block_sparse_moe``), and the experts' projection names when not HF's usual (its w1/w3/w2).
    hf_moe_module: str = "mlp"
    hf_expert_names: Mapping[str, str] = field(default_factory=dict)

    def chat_template_text(self) -> str | None:
        if self.default_chat_template is None:
            return None
        from importlib.resources import files

        return files("ruvllm").joinpath("templates", self.default_chat_template).read_text(encoding="utf-8")

    def hf_layer_name(self, key: str) -> str:
        """Canonical per-layer suffix (without ``.weight``) of HF's ``model.layers.{n}.<key>``."""
        key = self.hf_renames.get(key, key)
        if self.hf_moe_module != "mlp" and key.startswith(f"{self.hf_moe_module}."):
            key = "mlp" + key[len(self.hf_moe_module) :]
        m = _HF_EXPERT.match(key)
        if m and m.group(2) in self.hf_expert_names:
            key = f"mlp.experts.{m.group(1)}.{self.hf_expert_names[m.group(2)]}"
        return key

    def gguf_layer_name(self, key: str) -> str | None:
        """Canonical suffix of GGUF per-layer tensor ``key`` (None: not one ruvllm reads)."""
        if key in self.gguf_fused:
            return None
        if key in self.gguf_renames:
            return self.gguf_renames[key]
        return _GGUF_LAYER.get(key)


_LLAMA = dict(gguf_permuted_qk=True)
FAMILIES: tuple[Family, ...] = (
    Family("llama", gguf_archs=("llama",), hf_model_types=("llama",), **_LLAMA),
    Family("mistral", gguf_archs=("mistral",), hf_model_types=("mistral",), window_on_every_layer=True, **_LLAMA),
    Family("qwen2", gguf_archs=("qwen2",), hf_model_types=("qwen2",), qkv_bias=True),
    Family("qwen3", gguf_archs=("qwen3",), hf_model_types=("qwen3",), qk_norm=True),
    Family("qwen3_moe", gguf_archs=("qwen3moe",), hf_model_types=("qwen3_moe",), qk_norm=True, experts=True),
    # GGUF files of Mixtral are "llama" files with experts (llama.cpp's converter).
    Family(
        "mixtral",
        gguf_archs=(),
        hf_model_types=("mixtral",),
        window_on_every_layer=True,
        experts=True,
        hf_expert_size="intermediate_size",
        always_norm_topk=True,
        hf_moe_module="block_sparse_moe",
        hf_expert_names={"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
    ),
    # gpt-oss from HF directories in float (its MXFP4 HF checkpoints carry a quantization_config,
    # refused) and from GGUF files (llama.cpp's converter: MXFP4 experts, even layers sliding).
    Family(
        "gpt_oss",
        gguf_archs=("gpt-oss",),
        gguf_renames={"post_attention_norm": "post_attention_layernorm"},
        global_period=2,
        hf_model_types=("gpt_oss",),
        activation="swiglu_oai",
        hf_activations=("silu",),
        qkv_bias=True,
        o_proj_bias=True,
        attention_sinks=True,
        experts=True,
        hf_expert_size="intermediate_size",
        routing="topk_softmax",
        moe_biases=True,
        hf_fused_experts=True,
        hf_renames={"mlp.router": "mlp.gate"},
        # Harmony's turn ends (an answer; a tool call), as generation_config lists them and llama.cpp
        # treats them; a GGUF's EOS names only <|return|>. (<|end|> closes a message, not the turn.)
        end_of_turn_texts=("<|return|>", "<|call|>"),
        # Harmony written from its published format, for a GGUF converted without OpenAI's template.
        default_chat_template="gpt_oss.jinja",
    ),
    Family(
        "gemma3",
        gguf_archs=("gemma3",),
        hf_model_types=("gemma3_text",),
        activation="gelu_tanh",
        hf_activations=("gelu_pytorch_tanh",),
        qk_norm=True,
        output_norms=True,
        hf_norm_offset=1.0,
        scale_embeddings=True,
        global_period=6,
        gguf_local_rope_theta=10000.0,
        supports_final_softcap=True,
        end_of_turn_texts=("<end_of_turn>",),
        # Google's Gemma 3 template (the chat_template of the google/gemma-3-* tokenizer configs).
        default_chat_template="gemma3.jinja",
        hf_renames={
            "post_attention_layernorm": "attn_output_norm",
            "pre_feedforward_layernorm": "post_attention_layernorm",
            "post_feedforward_layernorm": "mlp_output_norm",
        },
    ),
    Family(
        "phi3",
        gguf_archs=("phi3",),
        hf_model_types=("phi3",),
        window_on_every_layer=True,
        hf_fused={"self_attn.qkv_proj": _QKV_SPLIT, "mlp.gate_up_proj": _GATE_UP_SPLIT},
        gguf_fused={"attn_qkv": _QKV_SPLIT, "ffn_up": _GATE_UP_SPLIT},
    ),
)
_BY_GGUF = {a: f for f in FAMILIES for a in f.gguf_archs}
_BY_HF = {t: f for f in FAMILIES for t in f.hf_model_types}


_FUSED_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def hf_expert_views(fam: Family, name: str, num_experts: int) -> dict[str, Callable[[Any], Any]]:
    """gpt_oss's fused expert tensors (HF ``mlp.experts.gate_up_proj`` ``[experts, hidden, 2 * inter]``
    with gate and up columns interleaved, ``down_proj`` ``[experts, inter, hidden]``, their biases):
    each expert's canonical tensor -> how to cut it from the stored one (empty for other names)."""
    m = _FUSED_EXPERT.match(name) if fam.hf_fused_experts else None
    if m is None:
        return {}
    layer, which, bias = m.group(1), m.group(2), bool(m.group(3))
    kind = "bias" if bias else "weight"

    def cut(e: int, start: int | None) -> Callable[[Any], Any]:
        """Expert ``e`` of the stored tensor; ``start``: its gate (0) or up (1) columns."""

        def view(t: Any) -> Any:
            part = t[e] if start is None else t[e][..., start::2]
            return part if bias else part.T  # matrices are stored [in, out]

        return view

    views: dict[str, Callable[[Any], Any]] = {}
    for e in range(num_experts):
        prefix = f"model.layers.{layer}.mlp.experts.{e}"
        if which == "down_proj":
            views[f"{prefix}.down_proj.{kind}"] = cut(e, None)
        else:
            views[f"{prefix}.gate_proj.{kind}"] = cut(e, 0)
            views[f"{prefix}.up_proj.{kind}"] = cut(e, 1)
    return views


def supported() -> str:
    return ", ".join(f.name for f in FAMILIES)


def family_of_gguf(arch: str, where: str) -> Family:
    try:
        return _BY_GGUF[arch]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"{where}: architecture {arch!r} is not supported (supported: {supported()})"
        ) from None


def family_of_hf(model_type: str, where: str) -> Family:
    try:
        return _BY_HF[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"{where}: architecture {model_type!r} is not supported (supported: {supported()})"
        ) from None


def family(name: str) -> Family:
    """The row of a :class:`ModelConfig`'s ``architecture``."""
    return next(f for f in FAMILIES if f.name == name)


def gguf_global_name(name: str) -> str | None:
    return _GGUF_GLOBAL.get(name)


def is_norm(canonical: str) -> bool:
    """Whether a canonical tensor name is an RMSNorm weight (Gemma's ``1 + w`` applies to these)."""
    return canonical.endswith(("layernorm.weight", "_norm.weight", "model.norm.weight"))


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


def _experts(
    n: int, k: int, width: int, refuse: Callable[[str, Any, str], None], keys: tuple[str, str, str]
) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a mixture of experts, checked (``keys``: the names of the
    expert count, top-k and width fields in the file, for the errors)."""
    if n < 1:
        refuse(keys[0], n, "must be at least 1 for a mixture of experts")
    if not 0 < k <= n:
        refuse(keys[1], k, f"must be between 1 and the {n} experts")
    if width < 1:
        refuse(keys[2], width, "must be at least 1")
    return {"num_experts": n, "experts_per_token": k, "expert_intermediate_size": width, "routing": "softmax_topk"}


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
    fields = _experts(int(n), int(k), int(width or 0), refuse, (count_key, "num_experts_per_tok", fam.hf_expert_size))
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


def config_from_hf(c: Mapping[str, Any], where: str, has_lm_head: bool) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` (transformers v4 or v5 layout)."""
    fam = family_of_hf(str(c.get("model_type", "")), where)
    if c.get("quantization_config"):
        method = c["quantization_config"].get("quant_method", "?")
        _refuse(where, "quantization_config", method, "(pre-quantized HF checkpoints) is not supported")
    act = c.get("hidden_activation") or c.get("hidden_act") or fam.hf_activations[0]
    if act not in fam.hf_activations:
        _refuse(where, "hidden_act", act, f"is not {fam.name}'s activation ({', '.join(fam.hf_activations)})")
    for key in (
        "attn_logit_softcapping",
        "mlp_bias",
        "use_bidirectional_attention",
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
        layer_windows=_hf_windows(c, fam, layers, where),
        rope=rope,
        rope_local=rope_local,
        final_logit_softcap=float(c["final_logit_softcapping"]) if c.get("final_logit_softcapping") else None,
        o_proj_bias=fam.o_proj_bias,
        attention_sinks=fam.attention_sinks,
        **_swiglu(c, fam, where),
        **_hf_experts(c, fam, where),
    )


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
        experts = _experts(
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
