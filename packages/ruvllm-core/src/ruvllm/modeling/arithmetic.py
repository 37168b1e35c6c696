"""What a decoder layer computes, operation by operation: RMSNorm, the activations
(:data:`ACTIVATIONS`), rotate-half RoPE, logit soft-capping and grouped-query attention, written over
the array API that NumPy and JAX share, with the primitives a backend registers
(:func:`register_primitives`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ruvllm.modeling.schema import LayerShape

# -- the arithmetic ----------------------------------------------------------------------------------------


def namespace(x: Any) -> Any:
    """The array module of ``x`` (numpy, jax.numpy); NumPy for anything without one."""
    get = getattr(x, "__array_namespace__", None)
    return get() if get is not None else np


@dataclass(frozen=True)
class Primitives:
    """The two elementwise functions the array API leaves out, and the mean of squares over the last
    axis (RMSNorm's), as an array library computes them best. The model's formulas above them are
    written once; a backend registers its library's own forms (:func:`register_primitives`), so its
    compiled step keeps the operations it always had, or one whose row sums keep one order whatever
    the number of rows."""

    sigmoid: Callable[[Any], Any]
    rsqrt: Callable[[Any], Any]
    mean_square: Callable[[Any], Any] | None = None  # mean of x*x over the last axis, kept; None: xp.mean
    #: A tracing compiler (MLX's ``mx.compile``) :func:`decoder_layer` runs its elementwise chains
    #: through (RMSNorm, RoPE, the gated activation: each one fused call); None: run as written.
    compile: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
    #: The error function (exact GELU: BERT's); None: SciPy's for NumPy arrays.
    erf: Callable[[Any], Any] | None = None


def _np_sigmoid(g: Any) -> Any:
    # Through tanh, so a large |g| cannot overflow an exp.
    return 0.5 + 0.5 * namespace(g).tanh(0.5 * g)


def _np_rsqrt(x: Any) -> Any:
    return 1.0 / namespace(x).sqrt(x)


_GENERIC = Primitives(_np_sigmoid, _np_rsqrt)
_PRIMITIVES: dict[str, Primitives] = {}


def register_primitives(
    xp: Any,
    *,
    sigmoid: Callable[[Any], Any],
    rsqrt: Callable[[Any], Any],
    mean_square: Callable[[Any], Any] | None = None,
    compile: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    erf: Callable[[Any], Any] | None = None,
) -> None:
    """Use ``sigmoid``, ``rsqrt`` and ``mean_square`` (the mean of ``x * x`` over the last axis, kept;
    default the library's mean of the squares) for arrays of the array module ``xp`` (e.g.
    ``jax.numpy``), and ``compile`` for :func:`decoder_layer`'s elementwise chains (a library that
    runs operation by operation, as MLX does, gains by fusing them)."""
    _PRIMITIVES[xp.__name__] = Primitives(sigmoid, rsqrt, mean_square, compile, erf)


def primitives(xp: Any) -> Primitives:
    return _PRIMITIVES.get(xp.__name__, _GENERIC)


def _f32(x: Any, xp: Any) -> Any:
    return x if x.dtype == xp.float32 else x.astype(xp.float32)


def inv_rms(x: Any, eps: float) -> Any:
    """``1 / sqrt(mean(x^2) + eps)`` over the last axis (kept), in float32."""
    xp = namespace(x)
    xf = _f32(x, xp)
    prim = primitives(xp)
    mean = prim.mean_square(xf) if prim.mean_square is not None else xp.mean(xf * xf, axis=-1, keepdims=True)
    return prim.rsqrt(mean + eps)


def rms_norm(x: Any, w: Any, eps: float) -> Any:
    """RMSNorm over the last axis, computed in float32 and returned in ``x``'s dtype."""
    xp = namespace(x)
    xf = _f32(x, xp)
    y = xf * inv_rms(xf, eps) * _f32(w, xp)
    return y if y.dtype == x.dtype else y.astype(x.dtype)


def rms_norm_backward(x: np.ndarray, inv: np.ndarray, w: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """Gradient w.r.t. ``x`` of :func:`rms_norm` given the output gradient ``dy`` (``inv``: its
    :func:`inv_rms`)."""
    t = dy * w
    return inv * t - x * (inv**3) * (np.sum(x * t, axis=-1, keepdims=True) / x.shape[-1])


def silu(g: Any) -> Any:
    """``g * sigmoid(g)``."""
    return g * primitives(namespace(g)).sigmoid(g)


def silu_grad(g: np.ndarray) -> np.ndarray:
    s = _np_sigmoid(g)
    return s * (1.0 + g * (1.0 - s))


_GELU_C = float(np.sqrt(2.0 / np.pi))


def gelu_tanh(g: Any) -> Any:
    """GELU's tanh approximation (PyTorch's ``gelu(approximate="tanh")``, Gemma's ``gelu_pytorch_tanh``)."""
    xp = namespace(g)
    return g * (0.5 * (1.0 + xp.tanh(_GELU_C * (g + 0.044715 * (g * g * g)))))


#: The gated MLP's activation, by :attr:`ModelConfig.activation`.
ACTIVATIONS: dict[str, Callable[[Any], Any]] = {"silu": silu, "gelu_tanh": gelu_tanh}
#: Activations of ``gate`` and ``up`` together (not ``act(gate) * up``): see :func:`gated_activation`.
GATED_ACTIVATIONS = ("swiglu_oai",)
#: Every :attr:`ModelConfig.activation` :func:`gated_activation` computes.
ACTIVATION_NAMES = (*ACTIVATIONS, *GATED_ACTIVATIONS)


def gated_activation(gate: Any, up: Any, shape: LayerShape) -> Any:
    """The gated MLP's middle: ``act(gate) * up``, or gpt_oss's ``swiglu_oai`` (OpenAI's reference:
    gate clamped above and up on both sides at ``swiglu_limit``, ``(up + 1) * gate * sigmoid(alpha *
    gate)``)."""
    if shape.activation == "swiglu_oai":
        xp = namespace(gate)
        limit = shape.swiglu_limit
        gate = xp.minimum(gate, limit)
        up = xp.clip(up, -limit, limit)
        glu = gate * primitives(xp).sigmoid(gate * shape.swiglu_alpha)
        return (up + 1) * glu
    return ACTIVATIONS[shape.activation](gate) * up


def apply_rope(x: Any, cos: Any, sin: Any) -> Any:
    """Rotate-half RoPE (the Hugging Face layout) of ``x [T, heads, head_dim]`` with ``cos``/``sin``
    ``[T, head_dim // 2]`` (a scaled RoPE's attention factor already in both); float32 arithmetic,
    returned in ``x``'s dtype."""
    xp = namespace(x)
    half = x.shape[-1] // 2
    x1, x2 = _f32(x[..., :half], xp), _f32(x[..., half:], xp)
    c, s = cos[:, None, :], sin[:, None, :]
    y = xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return y if y.dtype == x.dtype else y.astype(x.dtype)


def apply_rope_transpose(g: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The transpose of :func:`apply_rope` (rotation by minus the angle): maps gradients back."""
    half = g.shape[-1] // 2
    g1, g2 = g[..., :half], g[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([g1 * c + g2 * s, g2 * c - g1 * s], axis=-1)


def softcap(logits: Any, cap: float | None) -> Any:
    """Logit soft-capping ``cap * tanh(logits / cap)`` (Gemma); identity when ``cap`` is None."""
    if not cap:
        return logits
    return cap * namespace(logits).tanh(logits / cap)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def attention_mask(n: int, end: int, start: int, window: int = 0) -> np.ndarray | None:
    """Keys ``0 .. end`` that queries at positions ``start .. start + n`` may not see (``[n, end]``,
    True: masked): later positions, and with a ``window`` those at or before ``q - window``. None
    when every query sees every key."""
    q_pos = (start + np.arange(n))[:, None]
    keys = np.arange(end)[None, :]
    masked = keys > q_pos if end > start + 1 else None  # a lone last query sees every key
    if window and start + n - window > 0:
        out_of_window = keys <= q_pos - window
        masked = out_of_window if masked is None else masked | out_of_window
    return masked


def group_queries(q: np.ndarray, kv_heads: int, scale: float) -> np.ndarray:
    """``q [n, H, hd]`` times ``scale`` with the query heads that share a KV head stacked as rows:
    ``[KV, G * n, hd]``, so each attention product is one matmul per KV head."""
    n, heads, hd = q.shape
    qg = (q * np.float32(scale)).reshape(n, kv_heads, heads // kv_heads, hd)
    return qg.transpose(1, 2, 0, 3).reshape(kv_heads, -1, hd)


def ungroup(out: np.ndarray, n: int) -> np.ndarray:
    """``[KV, G * n, hd]`` back to the tokens' rows ``[n, H * hd]``."""
    kv_heads, rows, hd = out.shape
    return out.reshape(kv_heads, rows // n, n, hd).transpose(2, 0, 1, 3).reshape(n, -1)


def grouped_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, masked: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention with grouped-query heads in NumPy: ``q [n, H, hd]`` over ``k, v [end, KV, hd]``
    -> (output ``[n, H * hd]``, probabilities ``[KV, G, n, end]``)."""
    n, kv_heads = q.shape[0], k.shape[1]
    qg = group_queries(q, kv_heads, scale)
    scores = (qg @ k.transpose(1, 2, 0)).reshape(kv_heads, -1, n, k.shape[0])
    if masked is not None:
        scores[..., masked] = -np.inf
    probs = softmax_(scores)
    return ungroup(probs.reshape(kv_heads, qg.shape[1], -1) @ v.transpose(1, 0, 2), n), probs


def softmax_(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in place."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores
