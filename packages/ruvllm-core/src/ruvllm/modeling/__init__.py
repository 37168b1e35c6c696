"""The decoder model, defined once: what a layer holds and what it computes, for every backend.

:mod:`ruvllm.architectures` says how each family's files name their tensors and which of a layer's
features it uses (the fields of :class:`~ruvllm.model_config.ModelConfig`); this module says what those
features are:

* the projections (:data:`PROJECTIONS`), which of them share an input (:data:`PROJECTION_GROUPS`),
  their shapes (:func:`projection_shape`) and canonical tensor names (:func:`projection_tensor`);
* the layer-weights schema (:data:`LAYER_TENSORS`, :class:`LayerWeights`): one field per tensor, the
  same names in every backend, present or not by the config;
* the arithmetic: RMSNorm, the activations (:data:`ACTIVATIONS`), rotate-half RoPE, logit soft-capping,
  and :func:`decoder_layer`, which strings them together around two callbacks, ``project`` (how a
  backend multiplies its weights: fused BLAS calls, quantized kernels, a TP shard) and ``attend`` (its
  KV cache and attention kernel). What a backend adds is how to compute, never what the model is.
* a mixture of experts in place of the MLP (:func:`route`, :func:`moe_mlp`): the router's choice,
  the step's (token, expert) pairs sorted into one group per expert, and the weighted sum back per
  token; a third callback, ``project_experts``, multiplies each group by its own expert's matrices
  (a loop over the chosen experts in NumPy, ``jax.lax.ragged_dot`` in JAX), so a step reads each
  chosen expert once whatever the number of its tokens.

The functions are written over the array API that NumPy and JAX share (``x.__array_namespace__()``),
so the NumPy backend, SONA's trainer and the jitted JAX step run the same lines. HF transformers stays
the independent oracle in the tests.

The definition lives in four modules: :mod:`~ruvllm.modeling.schema` (what a layer holds),
:mod:`~ruvllm.modeling.arithmetic` (the operations), :mod:`~ruvllm.modeling.moe` (the mixture of
experts) and :mod:`~ruvllm.modeling.layer` (:func:`decoder_layer`); every name is importable from here.
"""

from ruvllm.modeling.arithmetic import (
    ACTIVATION_NAMES,
    ACTIVATIONS,
    GATED_ACTIVATIONS,
    Primitives,
    apply_rope,
    apply_rope_transpose,
    attention_mask,
    gated_activation,
    gelu_tanh,
    group_queries,
    grouped_attention,
    inv_rms,
    log_softmax,
    namespace,
    primitives,
    register_primitives,
    rms_norm,
    rms_norm_backward,
    silu,
    silu_grad,
    softcap,
    softmax_,
    ungroup,
)
from ruvllm.modeling.layer import (
    Adapt,
    Attend,
    LayerActivations,
    Project,
    _elementwise,  # noqa: F401 (benchmarks/bench_mlx_compile.py times it)
    decoder_layer,
)
from ruvllm.modeling.moe import (
    ExpertGroups,
    ProjectExperts,
    expert_groups,
    moe_mlp,
    route,
)
from ruvllm.modeling.schema import (
    ATTENTION_PROJECTIONS,
    BIAS_FIELDS,
    EXPERT_FIELDS,
    LAYER_FIELDS,
    LAYER_TENSORS,
    MLP_PROJECTIONS,
    PROJECTION_GROUPS,
    PROJECTIONS,
    LayerShape,
    LayerTensor,
    LayerWeights,
    expert_shape,
    global_tensors,
    layer_tensors,
    load_layer,
    projection_module,
    projection_shape,
    projection_tensor,
)

__all__ = [
    "ACTIVATIONS",
    "ACTIVATION_NAMES",
    "ATTENTION_PROJECTIONS",
    "BIAS_FIELDS",
    "EXPERT_FIELDS",
    "GATED_ACTIVATIONS",
    "LAYER_FIELDS",
    "LAYER_TENSORS",
    "MLP_PROJECTIONS",
    "PROJECTIONS",
    "PROJECTION_GROUPS",
    "Adapt",
    "Attend",
    "ExpertGroups",
    "LayerActivations",
    "LayerShape",
    "LayerTensor",
    "LayerWeights",
    "Primitives",
    "Project",
    "ProjectExperts",
    "apply_rope",
    "apply_rope_transpose",
    "attention_mask",
    "decoder_layer",
    "expert_groups",
    "expert_shape",
    "gated_activation",
    "gelu_tanh",
    "global_tensors",
    "group_queries",
    "grouped_attention",
    "inv_rms",
    "layer_tensors",
    "load_layer",
    "log_softmax",
    "moe_mlp",
    "namespace",
    "primitives",
    "projection_module",
    "projection_shape",
    "projection_tensor",
    "register_primitives",
    "rms_norm",
    "rms_norm_backward",
    "route",
    "silu",
    "silu_grad",
    "softcap",
    "softmax_",
    "ungroup",
]
