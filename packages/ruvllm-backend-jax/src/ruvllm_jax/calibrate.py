"""Activation statistics for w8a8 smoothing (SmoothQuant): one float32 forward pass over a fixed text
records, per layer and input channel, the largest magnitude each projection's input reaches.

The pass runs :func:`ruvllm.modeling.decoder_layer`, the serving step's layer arithmetic, with plain
causal attention over one sequence (no KV cache); :func:`calibration_logits` exposes its logits so a
test can hold it to the serving forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ruvllm_jax.model import (
    ModelSpec,
    Weights,
    apply_softcap,
    decoder_layer,
    embed_tokens,
    rms_norm,
    rope_tables,
)
from ruvllm_jax.quant import linear

#: Calibration text: prose, dialogue, code, numbers and a list, so that the channels a chat model
#: uses are exercised. Fixed, so a model quantizes the same way every time it loads.
CALIBRATION_TEXT = """\
The river had been rising for three days when the engineers finally agreed that the old bridge would
not survive another storm. "We can close the road tonight," Maria said, "but the school buses need a
detour by Monday." Nobody answered at first; the map on the wall already showed four alternatives.

def moving_average(values, window=3):
    if window <= 0:
        raise ValueError("window must be positive")
    return [sum(values[i:i + window]) / window for i in range(len(values) - window + 1)]

Q: What is 17 multiplied by 23? A: 17 x 23 = 391. Prices rose 4.5% in 2023, to $1,299.99.
Shopping list: eggs, flour, 2 lemons, olive oil; remember the receipt!
<|im_start|>user
Summarize the causes of the French Revolution in two sentences.<|im_end|>
<|im_start|>assistant
Economic hardship, a fiscal crisis and Enlightenment ideas eroded trust in the monarchy.
"""


@dataclass
class ActivationRanges:
    """Largest ``|x|`` per input channel, ``[layers, channels]``, at each projection input."""

    attention_in: np.ndarray  # input of q/k/v_proj
    output_in: np.ndarray  # input of o_proj (attention output)
    mlp_in: np.ndarray  # input of gate/up_proj
    down_in: np.ndarray  # input of down_proj
    head_in: np.ndarray  # input of the output projection, ``[hidden]``


def _forward(weights: Weights, tokens: jax.Array, spec: ModelSpec):
    t = tokens.shape[0]
    group = spec.num_heads // spec.num_kv_heads
    x = embed_tokens(weights.embed, tokens, spec, jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)
    cos, sin = rope_tables(pos, spec)

    def layer(x, xs):
        lw, (window, rope) = xs
        # Key j counts for query i when j <= i and, under a sliding window, j > i - window.
        seen = (pos[None, :] <= pos[:, None]) & ((window == 0) | (pos[None, :] > pos[:, None] - window))

        def attend(q, k, v):
            k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
            scores = jnp.einsum("qhd,khd->hqk", q, k) * spec.attention_scale
            p = jax.nn.softmax(jnp.where(seen[None], scores, -jnp.inf), axis=-1)
            return jnp.einsum("hqk,khd->qhd", p, v)

        def project(h, names):
            return [linear(h, getattr(lw, n)) for n in names]

        x, a = decoder_layer(x, lw, spec, cos[rope], sin[rope], project=project, attend=attend)
        # The inputs of the four projection groups (q/k/v, o, gate/up, down).
        return x, tuple(jnp.max(jnp.abs(z), axis=0) for z in (a.h, a.a, a.h2, a.act))

    x, stats = lax.scan(layer, x, (weights.layers, spec.layer_constants()))
    head_in = rms_norm(x, weights.final_norm, spec.rms_norm_eps)
    head = weights.embed if weights.lm_head is None else weights.lm_head
    logits = apply_softcap(linear(head_in, head).astype(jnp.float32), spec.final_logit_softcap)
    return stats, jnp.max(jnp.abs(head_in), axis=0), logits


def activation_ranges(weights: Weights, spec: ModelSpec, token_ids: list[int]) -> ActivationRanges:
    """Run the calibration pass over ``token_ids`` with float ``weights`` (host or device)."""
    (att, out, mlp, down), head, _ = jax.jit(_forward, static_argnames="spec")(
        weights, jnp.asarray(token_ids, jnp.int32), spec=spec
    )
    return ActivationRanges(*(np.asarray(a, np.float32) for a in (att, out, mlp, down, head)))


def calibration_logits(weights: Weights, spec: ModelSpec, token_ids: list[int]) -> np.ndarray:
    """Logits of every position from the calibration pass (for tests)."""
    return np.asarray(
        jax.jit(_forward, static_argnames="spec")(weights, jnp.asarray(token_ids, jnp.int32), spec=spec)[2]
    )


def smoothing_factors(act_max: np.ndarray, weights: list[np.ndarray], alpha: float = 0.5) -> np.ndarray:
    """SmoothQuant's per-channel factor ``s = max|X|^alpha / max|W|^(1 - alpha)`` for the matrices
    (``[out, in]``) that read one input; channels that never fire keep ``s = 1``."""
    w_max = np.max(np.stack([np.abs(w).max(axis=0) for w in weights]), axis=0)
    x_max = np.asarray(act_max, np.float64)
    s = np.power(np.maximum(x_max, 1e-8), alpha) / np.power(np.maximum(w_max, 1e-8), 1.0 - alpha)
    s = np.where((x_max > 0) & (w_max > 0), s, 1.0)
    return np.clip(s, 1e-4, 1e4).astype(np.float32)
