"""SONA's own differentiable NumPy Llama: forward and hand-written backward with LoRA factors.

The forward is :func:`ruvllm.modeling.decoder_layer`, the layer every backend runs, given NumPy ways to
project (with the LoRA factors) and attend (keeping the probabilities); the backward reuses the
activations that layer records. (Differentiating the JAX backend's jitted layer instead would tie SONA
to one backend and recompile per trajectory length.)

Backends run the serving forward pass and apply adapters through ``adapter.delta``; they expose no
intermediate activations (and skip prefix-cached positions entirely). To get exact gradients SONA
recomputes what it needs from the checkpoint's weights: the residual stream entering the adapted
layers (``prefix``), and a taped forward of the adapted ("tail") layers that ``backward`` turns into
gradients of a weighted token log-likelihood w.r.t. the LoRA factors. Tests check it against the
backend's logits and against float64 autograd.

A LoRA entry on projection ``p`` of layer ``l`` adds ``scale * (x @ A.T) @ B.T`` to ``x @ W_p``
(``A [r, in]``, ``B [out, r]``), the same convention as the adapter's ``delta``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ruvllm.checkpoint import Checkpoint
from ruvllm.model_config import ModelConfig
from ruvllm.modeling import (
    PROJECTIONS,
    LayerWeights,
    apply_rope_transpose,
    attention_mask,
    decoder_layer,
    grouped_attention,
    inv_rms,
    load_layer,
    log_softmax,
    projection_shape,
    rms_norm,
    rms_norm_backward,
    silu,
    silu_grad,
)
from ruvllm_sona.errors import SonaError

__all__ = ["PROJECTIONS", "LayerTape", "LoraFactors", "LoraLlama", "TailTape", "log_softmax"]


@dataclass(frozen=True)
class LoraFactors:
    """One low-rank update: ``delta(x) = scale * (x @ A.T) @ B.T``."""

    A: np.ndarray  # [r, in]
    B: np.ndarray  # [out, r]
    scale: float

    def delta(self, x: np.ndarray) -> np.ndarray:
        return (x @ self.A.T) @ (self.B.T * np.float32(self.scale))


#: (layer, projection) -> factors. Missing keys mean "no update".
LoraParams = Mapping[tuple[int, str], LoraFactors]
#: (layer, projection) -> (dA, dB), float32.
LoraGrads = dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
#: (layer, projection) -> (input rows x, output gradient dy) seen by a backward pass.
Taps = dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


@dataclass
class LayerTape:
    """What ``layer_forward`` keeps for ``layer_backward``."""

    layer: int
    r: np.ndarray  # input residual [n, d]
    inv1: np.ndarray  # 1/rms of r [n, 1]
    x: np.ndarray  # input_layernorm(r)
    q: np.ndarray  # roped queries [n, H, hd]
    k: np.ndarray  # roped keys [n, KV, hd]
    v: np.ndarray  # values [n, KV, hd]
    probs: np.ndarray  # attention probabilities [KV, G, n, n]
    a: np.ndarray  # attention output [n, H*hd] (o_proj input)
    h: np.ndarray  # residual after attention
    inv2: np.ndarray
    y: np.ndarray  # post_attention_layernorm(h)
    gate: np.ndarray
    up: np.ndarray
    m: np.ndarray  # silu(gate) * up (down_proj input)


@dataclass(frozen=True)
class TailTape:
    layers: list[LayerTape]
    r_out: np.ndarray  # residual after the last layer [n, d]
    inv_f: np.ndarray  # 1/rms of r_out [n, 1]
    z: np.ndarray  # final-norm hidden states [n, d]


def lora_factor_grads(f: LoraFactors, x: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dA, dB) of ``sum(dy * f.delta(x))``: the factors' gradient given the output gradient ``dy``."""
    s = np.float32(f.scale)
    return ((dy @ f.B) * s).T @ x, (dy.T @ (x @ f.A.T)) * s


class LoraLlama:
    """Float32 weights of a Llama-family checkpoint with a LoRA-aware forward and backward."""

    def __init__(
        self,
        config: ModelConfig,
        embed: np.ndarray,
        layers: Sequence[LayerWeights[np.ndarray, np.ndarray]],
        final_norm: np.ndarray,
        lm_head: np.ndarray,
    ) -> None:
        self.config = config
        self.embed = embed  # [vocab, d]
        self.layers = list(layers)
        self.final_norm = final_norm
        self.lm_head = lm_head  # [d, vocab]
        self.eps = np.float32(config.rms_norm_eps)

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint) -> LoraLlama:
        cfg = checkpoint.config
        # The hand-written backward covers pre-norm SwiGLU decoders (llama, mistral, qwen2, phi3: any
        # RoPE, windows, query scale); the rest of the table is refused by field, never approximated.
        unsupported = {
            "qk_norm": cfg.qk_norm,
            "output_norms": cfg.output_norms,
            "activation": cfg.activation != "silu" and cfg.activation,
            "final_logit_softcap": cfg.final_logit_softcap,
            "rope_local": cfg.rope_local is not None,
            "num_experts": cfg.num_experts,
        }
        for field_name, value in unsupported.items():
            if value:
                raise SonaError(
                    f"SONA's gradient model does not implement {field_name}={value!r} "
                    f"(architecture {cfg.architecture}); it trains llama, mistral, qwen2 and phi3 models"
                )
        if cfg.num_heads % cfg.num_kv_heads:
            raise SonaError(f"{cfg.num_heads} query heads do not group over {cfg.num_kv_heads} KV heads")
        # Hugging Face layout [out, in], as the checkpoint holds them: a projection is x @ W.T.
        layers = [LayerWeights(**load_layer(cfg, n, lambda name, _shape: checkpoint.tensor(name)))
                  for n in range(cfg.num_layers)]
        embed = checkpoint.tensor("model.embed_tokens.weight")
        lm_head = embed.T if cfg.tie_word_embeddings else checkpoint.tensor("lm_head.weight").T
        return cls(cfg, embed, layers, checkpoint.tensor("model.norm.weight"), lm_head)

    # -- building blocks ------------------------------------------------------------------------
    def weight(self, li: int, proj: str) -> np.ndarray:
        """Projection ``proj``'s weight in layer ``li``, ``[out, in]``."""
        return getattr(self.layers[li], proj)

    def out_features(self, proj: str) -> int:
        return projection_shape(self.config, proj)[0]

    def in_features(self, proj: str) -> int:
        return projection_shape(self.config, proj)[1]

    def rope(self, n: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin tables ``[n, hd/2]`` for positions ``start .. start+n`` (angles in float64; a
        scaled RoPE's attention factor is in both, so ``unrotate`` stays its transpose)."""
        return self.config.global_rope.cos_sin(np.arange(start, start + n), self.config.head_dim)

    @staticmethod
    def unrotate(g: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """The transpose of the rotation (by minus the angle): maps gradients back."""
        return apply_rope_transpose(g, cos, sin)

    def _project(self, li: int, x: np.ndarray, group: tuple[str, ...]) -> list[np.ndarray]:
        layer = self.layers[li]
        return [x @ getattr(layer, p).T for p in group]

    @staticmethod
    def _adapt(li: int, lora: LoraParams, y: np.ndarray, x: np.ndarray, proj: str) -> np.ndarray:
        f = lora.get((li, proj))
        return y if f is None else y + f.delta(x)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Causal GQA attention of a whole sequence: ``q [n, H, hd]``, ``k, v [n, KV, hd]`` ->
        (output ``[n, H*hd]``, probabilities ``[KV, G, n, n]``)."""
        n = q.shape[0]
        return grouped_attention(q, k, v, self.config.attention_scale, attention_mask(n, n, 0, window))

    # -- forward ----------------------------------------------------------------------------------
    def layer_forward(
        self, li: int, r: np.ndarray, lora: LoraParams, rope: tuple[np.ndarray, np.ndarray]
    ) -> tuple[np.ndarray, LayerTape]:
        cfg = self.config
        window = cfg.layer_window(li)
        probs: list[np.ndarray] = []

        def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
            out, p = self.attention(q, k, v, window)
            probs.append(p)
            return out

        out, a = decoder_layer(
            r, self.layers[li], cfg, *rope,
            project=lambda x, group: self._project(li, x, group),
            attend=attend,
            adapt=lambda y, x, proj: self._adapt(li, lora, y, x, proj),
        )
        eps = cfg.rms_norm_eps
        inv1, inv2 = inv_rms(r, eps), inv_rms(a.mid, eps)
        return out, LayerTape(li, r, inv1, a.h, a.q, a.k, a.v, probs[0], a.a, a.mid, inv2, a.h2, a.gate, a.up, a.act)

    def prefix(self, token_ids: Sequence[int], upto: int, lora: LoraParams | None = None) -> np.ndarray:
        """Residual stream entering layer ``upto`` for every position, float32 ``[n, d]``."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise SonaError("a trajectory needs at least one token")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise SonaError(f"token ids must be in 0..{self.config.vocab_size - 1}")
        lora = lora or {}
        rope = self.rope(len(ids))
        r = self.embed[ids].astype(np.float32, copy=True)
        if self.config.embedding_scale != 1.0:
            r *= np.float32(self.config.embedding_scale)
        for li in range(upto):
            r, _ = self.layer_forward(li, r, lora, rope)
        return r

    def tail_forward(self, r: np.ndarray, first_layer: int, lora: LoraParams) -> TailTape:
        """Layers ``first_layer ..`` and the final norm over the residual ``r`` entering them."""
        rope = self.rope(r.shape[0])
        layers = []
        for li in range(first_layer, self.config.num_layers):
            r, lt = self.layer_forward(li, r, lora, rope)
            layers.append(lt)
        z = rms_norm(r, self.final_norm, self.config.rms_norm_eps)
        return TailTape(layers, r, inv_rms(r, self.config.rms_norm_eps), z)

    def logits(self, z: np.ndarray) -> np.ndarray:
        return z @ self.lm_head

    def token_logprobs(self, tape: TailTape, rows: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """log p(targets[i] | row rows[i]) from a tail tape."""
        lp = log_softmax(self.logits(tape.z[rows]))
        return lp[np.arange(len(rows)), targets]

    # -- backward ---------------------------------------------------------------------------------
    def head_backward(
        self, tape: TailTape, rows: np.ndarray, targets: np.ndarray, weights: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Gradient of ``sum_i weights[i] * log p(targets[i] | rows[i])`` w.r.t. the residual after
        the last layer (``[n, d]``), and the log-probabilities themselves."""
        logits = self.logits(tape.z[rows])
        lp = log_softmax(logits)
        p = np.exp(lp)
        dlogits = -p * weights[:, None]
        dlogits[np.arange(len(rows)), targets] += weights
        dz = np.zeros_like(tape.z)
        np.add.at(dz, rows, dlogits @ self.lm_head.T)
        dr = rms_norm_backward(tape.r_out, tape.inv_f, self.final_norm, dz)
        return dr.astype(np.float32), lp[np.arange(len(rows)), targets]

    def _proj_backward(
        self, li: int, proj: str, x: np.ndarray, dy: np.ndarray, lora: LoraParams, grads: LoraGrads | None,
        trainable: set[tuple[int, str]] | None, taps: Taps | None = None,
    ) -> np.ndarray:
        """dx of ``y = x @ W (+ LoRA)`` given ``dy``; accumulates LoRA factor gradients and records
        ``(x, dy)`` of adapted projections in ``taps``."""
        dx = dy @ self.weight(li, proj)
        f = lora.get((li, proj))
        if f is not None:
            if taps is not None:
                taps[(li, proj)] = (x, dy)
            s = np.float32(f.scale)
            t = x @ f.A.T  # [n, r]
            dt = (dy @ f.B) * s  # [n, r]
            dx += dt @ f.A
            if grads is not None and (trainable is None or (li, proj) in trainable):
                dA, dB = dt.T @ x, (dy.T @ t) * s  # lora_factor_grads, sharing t and dt
                if (li, proj) in grads:
                    grads[(li, proj)][0][...] += dA
                    grads[(li, proj)][1][...] += dB
                else:
                    grads[(li, proj)] = (dA, dB)
        return dx

    def attention_backward(
        self, probs: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, da: np.ndarray,
        need_q: bool = True, need_k: bool = True,
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray]:
        """Gradients w.r.t. roped ``q [nq, H, hd]``, roped ``k`` and ``v [n, KV, hd]`` from the output
        gradient ``da [nq, H*hd]``; ``probs [KV, G, nq, n]`` (``nq`` query rows, any subset).
        ``need_q`` / ``need_k`` false skip those (None) where no gradient has to flow."""
        cfg = self.config
        kv, hd = cfg.num_kv_heads, cfg.head_dim
        g = cfg.num_heads // kv
        nq, n = da.shape[0], v.shape[0]
        # Query heads sharing a KV head are stacked as rows, so each product is one matmul per KV
        # head and the sums over the group fall out of the matmul.
        dout = da.reshape(nq, kv, g, hd).transpose(1, 2, 0, 3).reshape(kv, g * nq, hd)
        p = probs.reshape(kv, g * nq, n)
        dv = (p.transpose(0, 2, 1) @ dout).transpose(1, 0, 2)  # [n, KV, hd]
        if not (need_q or need_k):
            return None, None, dv
        dp = dout @ v.transpose(1, 2, 0)  # [KV, G*nq, n]
        ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True)) * np.float32(cfg.attention_scale)
        dq = dk = None
        if need_q:
            dq = (ds @ k.transpose(1, 0, 2)).reshape(kv, g, nq, hd).transpose(2, 0, 1, 3).reshape(nq, cfg.num_heads, hd)
        if need_k:
            qg = q.reshape(nq, kv, g, hd).transpose(1, 2, 0, 3).reshape(kv, g * nq, hd)
            dk = (ds.transpose(0, 2, 1) @ qg).transpose(1, 0, 2)  # [n, KV, hd]
        return dq, dk, dv

    def mlp_backward(
        self, lt: LayerTape, dout: np.ndarray, lora: LoraParams, grads: LoraGrads | None = None,
        trainable: set[tuple[int, str]] | None = None, taps: Taps | None = None,
    ) -> np.ndarray:
        """Gradient w.r.t. ``h`` (the residual after attention) from the layer output's gradient."""
        li = lt.layer
        dm = self._proj_backward(li, "down_proj", lt.m, dout, lora, grads, trainable, taps)
        dgate = dm * lt.up * silu_grad(lt.gate)
        dup = dm * silu(lt.gate)
        dy = self._proj_backward(li, "gate_proj", lt.y, dgate, lora, grads, trainable, taps)
        dy += self._proj_backward(li, "up_proj", lt.y, dup, lora, grads, trainable, taps)
        return dout + rms_norm_backward(lt.h, lt.inv2, self.layers[li].post_attention_norm, dy)

    def layer_backward(
        self, lt: LayerTape, dout: np.ndarray, lora: LoraParams, rope: tuple[np.ndarray, np.ndarray],
        grads: LoraGrads, trainable: set[tuple[int, str]] | None = None, taps: Taps | None = None,
    ) -> np.ndarray:
        """Gradient w.r.t. the layer's input residual; LoRA gradients accumulate into ``grads``."""
        li, n = lt.layer, lt.r.shape[0]
        cos, sin = rope
        dh = self.mlp_backward(lt, dout, lora, grads, trainable, taps)
        da = self._proj_backward(li, "o_proj", lt.a, dh, lora, grads, trainable, taps)
        dq, dk, dv = self.attention_backward(lt.probs, lt.q, lt.k, lt.v, da)
        assert dq is not None and dk is not None
        dq = self.unrotate(dq, cos, sin).reshape(n, -1)
        dk = self.unrotate(dk, cos, sin).reshape(n, -1)
        dx = self._proj_backward(li, "q_proj", lt.x, dq, lora, grads, trainable, taps)
        dx += self._proj_backward(li, "k_proj", lt.x, dk, lora, grads, trainable, taps)
        dx += self._proj_backward(li, "v_proj", lt.x, dv.reshape(n, -1), lora, grads, trainable, taps)
        return dh + rms_norm_backward(lt.r, lt.inv1, self.layers[li].input_norm, dx)

    def tail_backward(
        self, tape: TailTape, dr_out: np.ndarray, lora: LoraParams, trainable: set[tuple[int, str]] | None = None,
        taps: Taps | None = None,
    ) -> tuple[LoraGrads, np.ndarray]:
        """LoRA gradients of the tail layers and the gradient w.r.t. the residual entering them."""
        rope = self.rope(dr_out.shape[0])
        grads: LoraGrads = {}
        d = dr_out
        for lt in reversed(tape.layers):
            d = self.layer_backward(lt, d, lora, rope, grads, trainable, taps)
        return grads, d
