"""Trajectory capture and the instant loop's closed-form gradient.

Capturing a finished response (prompt + completion) at the adapter snapshot that produced it does the
expensive part once, off the feedback path: the residual entering the adapted layers (for the deep
loop), a taped forward and backward of those layers (log-likelihood gradient for the Fisher estimate),
the ReasoningBank embedding, and for the last layer everything the instant loop needs to differentiate
the completion's log-likelihood w.r.t. that layer's attention LoRA factors:

* the layer's normed input ``x`` at every position, roped queries at the completion rows, roped keys
  and values at every position, the attention probabilities of the completion rows and the
  attention output there;
* per completion token ``t``, ``dlogp_t / dh_t`` and ``dlogp_t / da_t`` (the gradient of that token's
  log-probability w.r.t. the layer's post-attention residual and attention output), i.e. the path
  logits -> final norm -> MLP -> post-attention norm -> o_proj, which holds the vocabulary-sized
  softmax and is far too expensive for a millisecond.

``instant_gradient`` then combines per-token weights with those vectors and runs the attention and
LoRA backward in a few small matmuls. Token ``t``'s log-probability depends on the last layer's LoRA
only through that layer's attention output at row ``t``, so the result is the exact gradient of
``sum_t w_t log p(y_t | y_<t, prompt)`` w.r.t. the last layer's q/k/v/o factors, evaluated at the
snapshot the trajectory was captured with.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ruvllm.modeling import ATTENTION_PROJECTIONS
from ruvllm_sona.ewc import Group, TrajectoryFisher, group_of
from ruvllm_sona.model import LoraFactors, LoraGrads, LoraLlama, Taps, lora_factor_grads

#: Projections the instant loop can update (those whose effect reaches the logits through one row).
INSTANT_PROJECTIONS = ATTENTION_PROJECTIONS


@dataclass(frozen=True)
class InstantCapture:
    """The last layer at the completion rows ``t`` (``T`` of them) of one trajectory. Gradients here
    are of ``log p(y_t)`` alone (unit weight per row), so a weighted sum is a row scaling."""

    layer: int
    factors: Mapping[tuple[int, str], LoraFactors]  # the snapshot's factors of ``layer``
    rows: np.ndarray  # [T] completion rows (positions predicting the completion tokens)
    x: np.ndarray  # [n, d] input_layernorm output at every position
    x_rows: np.ndarray  # [T, d]
    a_rows: np.ndarray  # [T, H*hd] attention output (o_proj input)
    dh_rows: np.ndarray  # [T, d] dlogp_t / d(o_proj output at row t)
    #: [KV, G*T, n] attention probabilities of the completion rows, query heads sharing a KV head
    #: stacked as rows (group-major).
    probs: np.ndarray
    dout: np.ndarray  # [KV, G*T, hd] dlogp_t / d(attention output), same layout
    dq_rows: np.ndarray  # [T, H*hd] dlogp_t / d(q_proj output at row t), RoPE undone
    q_rows: np.ndarray  # [T, H, hd] roped queries (k_proj's gradient needs them)
    k: np.ndarray  # [n, KV, hd] roped keys
    v: np.ndarray  # [n, KV, hd]
    cos: np.ndarray  # rope tables of all positions [n, 1, hd/2]
    sin: np.ndarray

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.x, self.x_rows, self.a_rows, self.dh_rows, self.probs, self.dout,
                                      self.dq_rows, self.q_rows, self.k, self.v))


@dataclass(frozen=True)
class Capture:
    """What SONA keeps of one trajectory once it has been recomputed."""

    version: int  # adapter version it was captured at
    first_layer: int  # the residual below enters this layer
    residual: np.ndarray  # [n, d], float32
    embedding: np.ndarray  # [d] mean final-norm hidden state over the prompt positions
    rows: np.ndarray  # [T] positions whose logits predict ``targets``
    targets: np.ndarray  # [T] completion token ids
    logprobs: np.ndarray  # [T] log p(target) at capture
    #: Gradient of the mean completion log-likelihood w.r.t. every adapted factor.
    loglik_grad: LoraGrads
    instant: InstantCapture | None

    @property
    def nbytes(self) -> int:
        return self.residual.nbytes + (self.instant.nbytes if self.instant is not None else 0)


def capture_trajectory(
    model: LoraLlama,
    token_ids: Sequence[int],
    num_prompt: int,
    entries: Mapping[tuple[int, str], LoraFactors],
    version: int,
    first_layer: int,
    instant_keys: Collection[tuple[int, str]],
) -> tuple[TrajectoryFisher, Capture]:
    """Recompute a trajectory at the adapter ``entries`` (snapshot ``version``): its EWC++ Fisher
    factors (consumed at once, not kept) and the capture.

    ``first_layer`` is the lowest adapted layer; ``instant_keys`` are the last layer's entries the
    instant loop updates (empty: no instant capture). Every adapted entry must be in ``entries``.
    """
    n = len(token_ids)
    if not 0 < num_prompt < n:
        raise ValueError(f"a trajectory needs a prompt and a completion (prompt {num_prompt}, total {n})")
    r = model.prefix(token_ids, first_layer, entries)
    tape = model.tail_forward(r, first_layer, entries)
    rows = np.arange(num_prompt - 1, n - 1)
    targets = np.asarray(token_ids[num_prompt:], dtype=np.int64)
    t_count = len(rows)
    dr_out, logprobs = model.head_backward(tape, rows, targets, np.ones(t_count, np.float32))

    instant = None
    if instant_keys:
        lt = tape.layers[-1]
        dh = model.mlp_backward(lt, dr_out, entries)
        dh_rows = dh[rows]
        li = lt.layer
        da_rows = dh_rows @ model.weight(li, "o_proj")
        fo = entries.get((li, "o_proj"))
        if fo is not None:
            da_rows += ((dh_rows @ fo.B) * np.float32(fo.scale)) @ fo.A
        cos, sin = model.rope(n)
        cfg = model.config
        kv, g, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        probs = lt.probs[:, :, rows, :]  # [KV, G, T, n]
        q_rows = lt.q[rows]
        dq, _, _ = model.attention_backward(probs, q_rows, lt.k, lt.v, da_rows, need_q=True, need_k=False)
        assert dq is not None
        instant = InstantCapture(
            layer=li,
            factors={key: f for key, f in entries.items() if key[0] == li},
            rows=rows,
            x=lt.x,
            x_rows=np.ascontiguousarray(lt.x[rows]),
            a_rows=lt.a[rows],
            dh_rows=dh_rows,
            probs=np.ascontiguousarray(probs.reshape(kv, g * t_count, n)),
            dout=np.ascontiguousarray(da_rows.reshape(t_count, kv, g, hd).transpose(1, 2, 0, 3).reshape(kv, -1, hd)),
            dq_rows=model.unrotate(dq, cos[rows], sin[rows]).reshape(t_count, -1),
            q_rows=q_rows,
            k=lt.k,
            v=lt.v,
            cos=cos,
            sin=sin,
        )
    # Mean log-likelihood gradient of every adapted factor: the head gradient was taken with unit
    # weights, so scale the backward's input by 1/T.
    taps: Taps = {}
    grads, _ = model.tail_backward(tape, dr_out / np.float32(t_count), entries, taps=taps)
    sigma: dict[Group, np.ndarray] = {}
    for key, (x, _) in taps.items():
        g = group_of(key)
        if g not in sigma:
            sigma[g] = (x.T @ x) / np.float32(len(x))
    fisher = TrajectoryFisher({key: np.sum(dy * dy, axis=0) for key, (_, dy) in taps.items()}, sigma)
    return fisher, Capture(
        version=version,
        first_layer=first_layer,
        residual=r,
        embedding=tape.z[:num_prompt].mean(axis=0),
        rows=rows,
        targets=targets,
        logprobs=logprobs,
        loglik_grad=grads,
        instant=instant,
    )


def instant_gradient(
    model: LoraLlama, ic: InstantCapture, weights: np.ndarray, keys: Collection[tuple[int, str]]
) -> LoraGrads:
    """Exact gradient of ``sum_t weights[t] * log p(y_t)`` w.r.t. the factors ``keys`` of the last
    layer, at the snapshot ``ic`` was captured with.

    Every per-row gradient in ``ic`` scales with its row's weight, and the factors enter through
    ``x @ A.T`` and ``@ B``, so q and v need only rank-``r`` products here (for v the attention
    probabilities are applied to ``x @ A.T`` instead of to ``dv``)."""
    w = np.asarray(weights, dtype=np.float32)[:, None]  # [T, 1]
    li = ic.layer
    grads: LoraGrads = {}
    if (li, "o_proj") in keys:
        grads[(li, "o_proj")] = lora_factor_grads(ic.factors[(li, "o_proj")], ic.a_rows, ic.dh_rows * w)
    if (li, "q_proj") in keys:
        f = ic.factors[(li, "q_proj")]
        s = np.float32(f.scale)
        grads[(li, "q_proj")] = (((ic.dq_rows @ f.B) * (w * s)).T @ ic.x_rows,
                                 ic.dq_rows.T @ ((ic.x_rows @ f.A.T) * (w * s)))
    if (li, "v_proj") in keys:
        f = ic.factors[(li, "v_proj")]
        s = np.float32(f.scale)
        kv, hd = ic.dout.shape[0], ic.dout.shape[2]
        w_rows = np.tile(w[:, 0] * s, ic.dout.shape[1] // len(w))[None, :, None]  # rows are (group, t)
        z = ic.probs @ (ic.x @ f.A.T)  # [KV, G*T, r]
        grad_b = (ic.dout.transpose(0, 2, 1) @ (z * w_rows)).reshape(kv * hd, -1)
        e = ic.dout @ f.B.reshape(kv, hd, -1)  # [KV, G*T, r]
        grad_a = (ic.probs.transpose(0, 2, 1) @ (e * w_rows)).sum(axis=0).T @ ic.x
        grads[(li, "v_proj")] = (grad_a, grad_b)
    if (li, "k_proj") in keys:
        n, t_count = ic.x.shape[0], len(ic.rows)
        kv, rows_g = ic.probs.shape[0], ic.probs.shape[1]
        probs = ic.probs.reshape(kv, rows_g // t_count, t_count, n)
        da = ic.dout.reshape(kv, rows_g // t_count, t_count, -1).transpose(2, 0, 1, 3).reshape(t_count, -1) * w
        _, dk, _ = model.attention_backward(probs, ic.q_rows, ic.k, ic.v, da, need_q=False, need_k=True)
        assert dk is not None
        dk = model.unrotate(dk, ic.cos, ic.sin).reshape(n, -1)
        grads[(li, "k_proj")] = lora_factor_grads(ic.factors[(li, "k_proj")], ic.x, dk)
    return grads
