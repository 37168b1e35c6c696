"""The table's rows (:class:`Family`, :data:`FAMILIES`), the tensor names every family shares in GGUF
files, and the lookups the checkpoint readers make: a family by its GGUF or HF name, a tensor's
canonical name, gpt_oss's fused expert views. (The table's description is in
:mod:`ruvllm.architectures`.)"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ruvllm.errors import UnsupportedArchitectureError
from ruvllm.model_config import ModelConfig

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
    #: The layer's form (:attr:`ModelConfig.layout`): ``decoder`` or ``bert`` (read by
    #: :mod:`~ruvllm.architectures.encoder_config`).
    layout: str = "decoder"
    #: HF ``use_bidirectional_attention`` is honoured (EmbeddingGemma's Gemma-3 layers); else refused.
    bidirectional_attention: bool = False
    #: A prefix HF task heads put before the backbone's names (``bert.`` in BertForSequenceClassification).
    hf_backbone_prefix: str = ""

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
        bidirectional_attention=True,
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
    # BERT encoders (all-MiniLM, ms-marco cross-encoders): embed and score, never generate.
    Family(
        "bert",
        gguf_archs=(),
        hf_model_types=("bert",),
        activation="gelu",
        hf_activations=("gelu",),
        layout="bert",
        hf_backbone_prefix="bert.",
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


def expert_fields(
    n: int, k: int, width: int, refuse: Callable[[str, Any, str], None], keys: tuple[str, str, str]
) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a mixture of experts, checked, for both readers (``keys``: the
    names of the expert count, top-k and width fields in the file, for the errors)."""
    if n < 1:
        refuse(keys[0], n, "must be at least 1 for a mixture of experts")
    if not 0 < k <= n:
        refuse(keys[1], k, f"must be between 1 and the {n} experts")
    if width < 1:
        refuse(keys[2], width, "must be at least 1")
    return {"num_experts": n, "experts_per_token": k, "expert_intermediate_size": width, "routing": "softmax_topk"}
