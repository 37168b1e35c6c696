"""The encoder pass, defined once: a padded batch of whole sequences in, every position's final hidden
state out, with no KV cache (an embedding or a cross-encoder's score reads the whole input at once).

Two layer forms, by :attr:`ModelConfig.layout`:

* ``bert``: learned absolute positions and token types added to the token embeddings, LayerNorm, then
  post-norm layers (attention with biases, ``LayerNorm(x + attn)``, an ungated GELU (erf) MLP,
  ``LayerNorm(h + mlp)``);
* ``decoder``: the family's own :func:`~ruvllm.modeling.decoder_layer` over every position at once with
  dense attention: bidirectional where :attr:`ModelConfig.bidirectional` (EmbeddingGemma; a window then
  reaches both sides, ``|q - k| < window``), causal otherwise (a decoder used as an embedder, pooled at
  its last token), then the final RMSNorm.

Written over the array API NumPy and JAX share, so candle-compat runs it as it is and the jax backend
jits it per padded shape. Sequences are packed end to end into rows (several short ones share a row):
``segments [B, T]`` says which sequence of its row a position holds (0: padding) and a query reads the
keys of its own sequence only, so a sequence's states are those it has alone; a padding position is
never a key, and its own row is garbage that pooling never reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ruvllm.errors import ModelFormatError
from ruvllm.model_config import ModelConfig
from ruvllm.modeling.arithmetic import namespace, primitives, rms_norm
from ruvllm.modeling.layer import decoder_layer
from ruvllm.modeling.schema import LAYER_FIELDS, LayerWeights, load_layer

#: BERT's per-layer tensors: field -> name after ``encoder.layer.{n}.`` (weights ``[out, in]``).
BERT_LAYER_TENSORS: dict[str, str] = {
    "q_w": "attention.self.query.weight",
    "q_b": "attention.self.query.bias",
    "k_w": "attention.self.key.weight",
    "k_b": "attention.self.key.bias",
    "v_w": "attention.self.value.weight",
    "v_b": "attention.self.value.bias",
    "o_w": "attention.output.dense.weight",
    "o_b": "attention.output.dense.bias",
    "attn_norm_w": "attention.output.LayerNorm.weight",
    "attn_norm_b": "attention.output.LayerNorm.bias",
    "up_w": "intermediate.dense.weight",
    "up_b": "intermediate.dense.bias",
    "down_w": "output.dense.weight",
    "down_b": "output.dense.bias",
    "out_norm_w": "output.LayerNorm.weight",
    "out_norm_b": "output.LayerNorm.bias",
}
#: BERT's tensors outside its layers: field -> name.
BERT_GLOBAL_TENSORS: dict[str, str] = {
    "word": "embeddings.word_embeddings.weight",
    "position": "embeddings.position_embeddings.weight",
    "token_type": "embeddings.token_type_embeddings.weight",
    "emb_norm_w": "embeddings.LayerNorm.weight",
    "emb_norm_b": "embeddings.LayerNorm.bias",
}
#: A decoder used as an encoder: its tensors outside the layers.
DECODER_GLOBAL_TENSORS: dict[str, str] = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight"}

#: What a masked score becomes before the softmax (finite, so a row with no key left stays a number).
_MASKED = -1e30


@dataclass
class EncoderWeights:
    """An encoder's tensors by field (:data:`BERT_GLOBAL_TENSORS` or :data:`DECODER_GLOBAL_TENSORS`, and
    per layer :data:`BERT_LAYER_TENSORS` or the :class:`LayerWeights` fields), as a backend's arrays.
    ``globals`` and ``layers`` are plain dicts and lists, so JAX takes them as a pytree."""

    globals: dict[str, Any]
    layers: list[dict[str, Any]] = field(default_factory=list)


def check_encoder(cfg: ModelConfig, where: str) -> None:
    """Refuse, by name, what the encoder pass does not compute."""
    if cfg.layout not in ("bert", "decoder"):
        raise ModelFormatError(f"{where}: layout {cfg.layout!r} is not one the encoder pass computes")
    for name in ("num_experts", "attention_sinks"):
        if getattr(cfg, name):
            raise ModelFormatError(f"{where}: {name}={getattr(cfg, name)!r} is not implemented in the encoder pass")


def load_encoder_weights(cfg: ModelConfig, read: Callable[[str, tuple[int, ...]], Any]) -> EncoderWeights:
    """Every tensor of the encoder: ``read(name, shape)`` gives one (the caller checks and converts)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    if cfg.layout == "bert":
        gshapes = {
            "word": (cfg.vocab_size, h),
            "position": (cfg.max_position_embeddings, h),
            "token_type": (cfg.type_vocab_size, h),
            "emb_norm_w": (h,),
            "emb_norm_b": (h,),
        }
        lshapes = {f: (h, h) if f.endswith("_w") and "norm" not in f else (h,) for f in BERT_LAYER_TENSORS}
        lshapes.update({"up_w": (i, h), "up_b": (i,), "down_w": (h, i)})
        return EncoderWeights(
            {f: read(n, gshapes[f]) for f, n in BERT_GLOBAL_TENSORS.items()},
            [
                {f: read(f"encoder.layer.{layer}.{n}", lshapes[f]) for f, n in BERT_LAYER_TENSORS.items()}
                for layer in range(cfg.num_layers)
            ],
        )
    glob = {
        "embed": read(DECODER_GLOBAL_TENSORS["embed"], (cfg.vocab_size, h)),
        "norm": read("model.norm.weight", (h,)),
    }
    layers = [
        {k: v for k, v in load_layer(cfg, layer, read).items() if v is not None} for layer in range(cfg.num_layers)
    ]
    return EncoderWeights(glob, layers)


# -- the arithmetic ------------------------------------------------------------------------------------


def layer_norm(x: Any, w: Any, b: Any, eps: float) -> Any:
    """LayerNorm over the last axis (biased variance, as PyTorch's)."""
    xp = namespace(x)
    mu = xp.mean(x, axis=-1, keepdims=True)
    d = x - mu
    var = xp.mean(d * d, axis=-1, keepdims=True)
    return d / xp.sqrt(var + eps) * w + b


def _np_erf(x: Any) -> Any:
    try:
        from scipy.special import erf
    except ImportError as exc:  # pragma: no cover - scipy is candle-compat's dependency
        raise ModelFormatError("exact GELU (erf) on NumPy arrays needs SciPy: pip install scipy") from exc
    return erf(x)


def gelu_erf(x: Any) -> Any:
    """Exact GELU ``x * (1 + erf(x / sqrt(2))) / 2`` (PyTorch's default ``gelu``, BERT's ``hidden_act``)."""
    erf = primitives(namespace(x)).erf or _np_erf
    return x * 0.5 * (1.0 + erf(x * np.float32(1.0 / np.sqrt(2.0))))


#: ``products(x [rows, in], [w_i]) -> [x @ w_i.T]``: the products of one input with weights the backend
#: holds (float ``[out, in]`` arrays, or its own quantized form), so a backend may quantize the input once.
Products = Callable[[Any, list[Any]], list[Any]]


def float_products(x: Any, ws: list[Any]) -> list[Any]:
    """:data:`Products` of float ``[out, in]`` weights."""
    return [x @ w.T for w in ws]


def allowed_keys(segments: Any, positions: Any, *, causal: bool, window: int) -> Any:
    """Which keys each query may read: ``[B, 1, T, T]`` (True: read). Only keys of the query's own
    sequence (``segments``, 0 for padding, which no query reads); earlier ones only when ``causal``;
    fewer than ``window`` positions away (either side) when ``window``."""
    xp = namespace(segments)
    allowed = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] > 0)
    if causal:
        allowed = allowed & (positions[:, None, :] <= positions[:, :, None])
    if window:
        allowed = allowed & (xp.abs(positions[:, None, :] - positions[:, :, None]) < window)
    return allowed[:, None, :, :]


def dense_attention(q: Any, k: Any, v: Any, allowed: Any, scale: float) -> Any:
    """Softmax attention of ``q [B, T, H, hd]`` over ``k, v [B, T, KV, hd]`` (query heads grouped on
    the KV heads) where ``allowed [B, 1, T, T]``; returns ``[B, T, H * hd]``."""
    xp = namespace(q)
    b, t, nh, hd = q.shape
    group = nh // k.shape[2]
    qh = q.transpose(0, 2, 1, 3)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if group > 1:
        kh, vh = xp.repeat(kh, group, axis=1), xp.repeat(vh, group, axis=1)
    scores = (qh * np.float32(scale)) @ kh.transpose(0, 1, 3, 2)
    scores = xp.where(allowed, scores, np.float32(_MASKED))
    scores = scores - xp.max(scores, axis=-1, keepdims=True)
    e = xp.exp(scores)
    p = e / xp.sum(e, axis=-1, keepdims=True)
    return (p @ vh).transpose(0, 2, 1, 3).reshape(b, t, nh * hd)


def bert_layer(x: Any, lw: dict[str, Any], cfg: ModelConfig, allowed: Any, products: Products = float_products) -> Any:
    """One post-norm BERT layer over ``x [B, T, hidden]``."""
    b, t, hsz = x.shape
    nh, hd, eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps

    def linear(h: Any, names: tuple[str, ...]) -> list[Any]:
        ys = products(h.reshape(b * t, -1), [lw[f"{n}_w"] for n in names])
        return [y + lw[f"{n}_b"] for y, n in zip(ys, names, strict=True)]

    q, k, v = (y.reshape(b, t, nh, hd) for y in linear(x, ("q", "k", "v")))
    a = dense_attention(q, k, v, allowed, cfg.attention_scale)
    h = layer_norm(x + linear(a, ("o",))[0].reshape(b, t, hsz), lw["attn_norm_w"], lw["attn_norm_b"], eps)
    f = linear(gelu_erf(linear(h, ("up",))[0]), ("down",))[0].reshape(b, t, hsz)
    return layer_norm(h + f, lw["out_norm_w"], lw["out_norm_b"], eps)


def _bert_hidden(
    w: EncoderWeights, cfg: ModelConfig, ids: Any, types: Any, segments: Any, positions: Any, products: Products
) -> Any:
    xp = namespace(segments)
    g = w.globals

    def rows(table: Any, index: Any) -> Any:
        return xp.take(table, index.reshape(-1), axis=0).reshape(*ids.shape, cfg.hidden_size)

    x = rows(g["word"], ids) + rows(g["position"], positions) + rows(g["token_type"], types)
    x = layer_norm(x, g["emb_norm_w"], g["emb_norm_b"], cfg.rms_norm_eps)
    allowed = allowed_keys(segments, positions, causal=False, window=0)
    for lw in w.layers:
        x = bert_layer(x, lw, cfg, allowed, products)
    return x


def _decoder_hidden(
    w: EncoderWeights, cfg: ModelConfig, ids: Any, segments: Any, positions: Any, products: Products
) -> Any:
    xp = namespace(segments)
    b, t = ids.shape
    hsz = cfg.hidden_size
    x = xp.take(w.globals["embed"], ids.reshape(-1), axis=0)
    if cfg.embedding_scale != 1.0:
        x = x * np.float32(cfg.embedding_scale)
    flat = positions.reshape(-1)
    masks: dict[int, Any] = {}
    ropes: dict[Any, tuple[Any, Any]] = {}
    for layer, fields in enumerate(w.layers):
        window = cfg.layer_window(layer)
        if window not in masks:
            masks[window] = allowed_keys(segments, positions, causal=not cfg.bidirectional, window=window)
        rope = cfg.layer_rope(layer)
        if rope not in ropes:
            # a position is below the row's length: the table's rows at the positions
            ropes[rope] = tuple(xp.take(xp.asarray(a), flat, axis=0) for a in rope.cos_sin(np.arange(t), cfg.head_dim))
        cos, sin = ropes[rope]
        lw = LayerWeights(**{f: fields.get(f) for f in LAYER_FIELDS})
        allowed = masks[window]

        def project(h: Any, group: tuple[str, ...], lw: LayerWeights = lw) -> list[Any]:
            return products(h, [getattr(lw, p) for p in group])

        def attend(q: Any, k: Any, v: Any, allowed: Any = allowed) -> Any:
            return dense_attention(
                q.reshape(b, t, *q.shape[1:]), k.reshape(b, t, *k.shape[1:]), v.reshape(b, t, *v.shape[1:]),
                allowed, cfg.attention_scale,
            ).reshape(b * t, -1)  # fmt: skip

        x, _ = decoder_layer(x, lw, cfg, cos, sin, project=project, attend=attend)
    return rms_norm(x, w.globals["norm"], cfg.rms_norm_eps).reshape(b, t, hsz)


def encode_hidden(
    w: EncoderWeights,
    cfg: ModelConfig,
    ids: Any,
    types: Any,
    segments: Any,
    positions: Any,
    products: Products = float_products,
) -> Any:
    """Final hidden states ``[B, T, hidden]`` of rows of packed sequences (:class:`ruvllm.encoder.
    PackedPass`): token ids ``ids [B, T]``, token types ``types`` (read by ``bert`` only), which
    sequence of its row each position holds ``segments`` (0: padding) and its position in that
    sequence ``positions``. A query reads keys of its own sequence only. ``products`` multiplies the
    layers' weights (default: float arrays)."""
    if cfg.layout == "bert":
        return _bert_hidden(w, cfg, ids, types, segments, positions, products)
    return _decoder_hidden(w, cfg, ids, segments, positions, products)
