"""What a model's arithmetic is, read once from GGUF metadata or config.json: the hyper-parameters
(:class:`ModelConfig`) and the rotary embedding (:class:`Rope`) every backend and SONA compute from.

The per-family rules (which norms, activation, tensor names, where each field comes from) live in
:mod:`ruvllm.architectures`; this module holds the resulting description and the RoPE arithmetic, so
the frequencies are computed in one place for every backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

#: RoPE variants ruvllm computes (Hugging Face's ``rope_type`` names).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
#: How a mixture-of-experts router turns its logits into the chosen experts' weights:
#: ``softmax_topk``, a softmax over every expert, then the top k (qwen3_moe, mixtral; renormalised
#: to sum 1 when ``norm_topk_prob``); ``topk_softmax``, the k largest logits, then a softmax over
#: those k (gpt_oss).
ROUTINGS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: base ``theta``, the scaling ``kind`` and its parameters.

    ``inv_freq()`` gives the per-pair inverse frequencies (float64) and ``attention_factor`` the
    factor cos and sin are multiplied by (YaRN, LongRoPE), both as Hugging Face computes them.
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    #: llama3, yarn, longrope: the context the model was pre-trained on.
    original_max_position: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    #: yarn / longrope: given explicitly, else derived from ``factor``.
    explicit_attention_factor: float | None = None
    mscale: float | None = None  # yarn (DeepSeek style)
    mscale_all_dim: float | None = None  # yarn
    #: longrope: per-pair divisors used within ``original_max_position`` (short) and beyond it (long).
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    #: longrope: which set of factors runs (chosen for the context served, see :mod:`ruvllm.architectures`).
    use_long_factor: bool = False
    #: GGUF ``rope_freqs`` (llama3 as llama.cpp stores it): per-pair divisors of the base frequencies.
    freq_divisors: tuple[float, ...] | None = None

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies ``[head_dim // 2]`` in float64."""
        exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
        base = 1.0 / (self.theta**exponents)
        if self.freq_divisors is not None:
            base = base / self._pairs(self.freq_divisors, head_dim, "rope_freqs")
        if self.kind in ("default", "dynamic"):
            # dynamic NTK changes nothing within max_position_embeddings, which ruvllm never exceeds.
            return base
        if self.kind == "linear":
            return base / self.factor
        if self.kind == "llama3":
            return self._llama3(base)
        if self.kind == "yarn":
            return self._yarn(head_dim)
        if self.kind == "longrope":
            factors = self.long_factor if self.use_long_factor else self.short_factor
            which = "long_factor" if self.use_long_factor else "short_factor"
            return 1.0 / (self._pairs(factors, head_dim, which) * self.theta**exponents)
        raise ValueError(f"unknown RoPE kind {self.kind!r}")

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (1 for every kind but yarn and longrope)."""
        if self.explicit_attention_factor is not None:
            return self.explicit_attention_factor
        if self.kind == "yarn":
            if self.mscale and self.mscale_all_dim:
                return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
            return _yarn_mscale(self.factor)
        if self.kind == "longrope" and self.factor > 1.0:
            assert self.original_max_position
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position))
        return 1.0

    def cos_sin(self, positions: np.ndarray, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin ``[T, head_dim // 2]`` (float32) at ``positions``, angles in float64."""
        angles = np.asarray(positions, dtype=np.float64)[:, None] * self.inv_freq(head_dim)[None, :]
        f = self.attention_factor
        return (np.cos(angles) * f).astype(np.float32), (np.sin(angles) * f).astype(np.float32)

    @staticmethod
    def _pairs(values: tuple[float, ...] | None, head_dim: int, name: str) -> np.ndarray:
        arr = np.asarray(values, dtype=np.float64)
        if values is None or arr.shape != (head_dim // 2,):
            raise ValueError(
                f"RoPE {name} has {0 if values is None else arr.size} values, head_dim {head_dim} needs {head_dim // 2}"
            )
        return arr

    def _llama3(self, base: np.ndarray) -> np.ndarray:
        assert self.original_max_position
        old = float(self.original_max_position)
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / base
        scaled = np.where(wavelen > low_wavelen, base / self.factor, base)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled)

    def _yarn(self, head_dim: int) -> np.ndarray:
        assert self.original_max_position
        dim, base = head_dim, self.theta

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
        return interpolation * (1 - keep) + extrapolation * keep


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer as ruvllm runs it. Families differ only in these fields; the
    defaults describe a plain Llama (pre-norm RMSNorm, SwiGLU, global attention, default RoPE)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (qwen2)
    o_proj_bias: bool = False  # an o_proj bias (gpt_oss)
    #: One learned logit per query head that joins every softmax of attention as a key with no value
    #: (gpt_oss's sinks: ``self_attn.sinks``).
    attention_sinks: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""
    #: The gated MLP's activation: ``silu`` (SwiGLU), ``gelu_tanh`` (GeGLU, Gemma) or ``swiglu_oai``
    #: (gpt_oss: gate and up clamped to ``swiglu_limit``, ``gate * sigmoid(swiglu_alpha * gate) * (up + 1)``).
    activation: str = "silu"
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0
    #: RMSNorm of each head's query and key before RoPE (``self_attn.q_norm`` / ``k_norm``: qwen3, gemma3).
    qk_norm: bool = False
    #: Norms on the attention and MLP outputs before the residual add (``attn_output_norm`` /
    #: ``mlp_output_norm``: gemma3's pre+post "sandwich").
    output_norms: bool = False
    #: What token embeddings are multiplied by (gemma: sqrt(hidden_size)).
    embedding_scale: float = 1.0
    #: Query scaling before the softmax; None means ``head_dim ** -0.5``.
    query_scale: float | None = None
    #: Per layer, how many past positions a query sees (its own included); 0 means every position.
    layer_windows: tuple[int, ...] = ()
    #: RoPE of global layers; None means default RoPE with ``rope_theta``.
    rope: Rope | None = None
    #: RoPE of sliding-window layers when it differs (gemma3's local base); None means ``rope``.
    rope_local: Rope | None = None
    #: ``cap * tanh(logits / cap)`` on the final logits when set.
    final_logit_softcap: float | None = None
    #: Mixture of experts (0: the dense gated MLP): experts per layer, how many each token uses,
    #: and the width of each expert's gated MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    #: The router's rule (:data:`ROUTINGS`) and whether the chosen weights are renormalised.
    routing: str = "softmax_topk"
    norm_topk_prob: bool = False
    #: A bias on the router's logits, and on each expert's projections (gpt_oss).
    router_bias: bool = False
    expert_bias: bool = False
    #: Every query sees every key of its sequence (within ``layer_windows`` on both sides: EmbeddingGemma's
    #: ``use_bidirectional_attention``): an encoder, which embeds but cannot generate.
    bidirectional: bool = False
    #: ``decoder`` (the pre-norm layer of :func:`ruvllm.modeling.decoder_layer`) or ``bert`` (post-norm
    #: LayerNorm with biases, learned absolute positions and token types, an ungated MLP:
    #: :mod:`ruvllm.modeling.encoder`). For ``bert``, ``rms_norm_eps`` is its LayerNorm's eps.
    layout: str = "decoder"
    #: ``bert``: the token-type (segment) vocabulary; its learned positions are ``max_position_embeddings``.
    type_vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} is outside 1..{self.num_experts}")

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    @property
    def global_rope(self) -> Rope:
        return self.rope if self.rope is not None else Rope(theta=self.rope_theta)

    def layer_window(self, layer: int) -> int:
        """Sliding window of ``layer`` (0: global attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def layer_rope(self, layer: int) -> Rope:
        if self.rope_local is not None and self.layer_window(layer):
            return self.rope_local
        return self.global_rope

    @property
    def uniform_window(self) -> int:
        """The window when every layer has the same one (positions before it are never read again,
        so their blocks can be freed), else 0."""
        ws = set(self.layer_windows)
        return ws.pop() if len(ws) == 1 else 0

    @property
    def hybrid_window(self) -> int:
        """The window of a model that interleaves layers of one sliding window with global ones
        (Gemma 3's 5 local : 1 global), whose windowed layers can keep their own, window-bounded
        blocks; else 0."""
        ws = set(self.layer_windows)
        return max(ws) if len(ws) == 2 and 0 in ws else 0

    @property
    def local_layers(self) -> tuple[int, ...]:
        """Indices of the windowed layers of a :attr:`hybrid_window` model."""
        return tuple(i for i, w in enumerate(self.layer_windows) if w) if self.hybrid_window else ()

    @property
    def encoder_only(self) -> bool:
        """Whether this model only encodes (embeds, scores) and cannot generate text."""
        return self.bidirectional or self.layout != "decoder"

    @property
    def num_parameters(self) -> int:
        """Parameter count implied by the shapes (embeddings counted once when tied)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        if self.layout == "bert":  # q/k/v/o, up, down with biases; two LayerNorms a layer
            per_bert_layer = 4 * (h * h + h) + 2 * h * i + i + h + 4 * h
            emb = (self.vocab_size + self.max_position_embeddings + self.type_vocab_size) * h + 2 * h
            return emb + L * per_bert_layer
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        e, ie = self.num_experts, self.expert_intermediate_size
        mlp = e * (3 * h * ie + h) if e else 3 * h * i
        mlp += e * (2 * ie + h) if self.expert_bias else 0
        mlp += e if self.router_bias else 0
        per_layer = h * q + 2 * h * kv + q * h + mlp + 2 * h
        per_layer += (h if self.o_proj_bias else 0) + (self.num_heads if self.attention_sinks else 0)
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.output_norms:
            per_layer += 2 * h
        emb = self.vocab_size * h
        return emb * (1 if self.tie_word_embeddings else 2) + L * per_layer + h
