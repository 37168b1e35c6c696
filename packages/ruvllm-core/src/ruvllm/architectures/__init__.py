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

The table's rows and lookups are in :mod:`~ruvllm.architectures.families`; the readers of a Hugging
Face ``config.json`` and of GGUF metadata in :mod:`~ruvllm.architectures.hf_config` and
:mod:`~ruvllm.architectures.gguf_config`. Every name is importable from here.
"""

from ruvllm.architectures.families import (
    FAMILIES,
    GGUF_EXPERTS,
    Family,
    Split,
    family,
    family_of_gguf,
    family_of_hf,
    gguf_global_name,
    hf_expert_views,
    is_norm,
    supported,
)
from ruvllm.architectures.gguf_config import config_from_gguf
from ruvllm.architectures.hf_config import config_from_hf

__all__ = [
    "FAMILIES",
    "GGUF_EXPERTS",
    "Family",
    "Split",
    "config_from_gguf",
    "config_from_hf",
    "family",
    "family_of_gguf",
    "family_of_hf",
    "gguf_global_name",
    "hf_expert_views",
    "is_norm",
    "supported",
]
