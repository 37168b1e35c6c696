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

from ruvllm_sona.ewc import Group, TrajectoryFisher, group_of
from ruvllm_sona.model import LoraFactors, LoraGrads, LoraLlama, Taps, lora_factor_grads

#: Projections the instant loop can update (those whose effect reaches the logits through one row).
INSTANT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class InstantCapture:
    layer: int
    factors: Mapping[tuple[int, str], LoraFactors]  # the snapshot's factors of ``layer``
    rows: np.ndarray  # [T] completion rows (positions predicting the completion tokens)
    x: np.ndarray  # [n, d] input_layernorm output at every position
    q_rows: np.ndarray  # [T, H, hd] roped queries at the completion rows
    k: np.ndarray  # [n, KV, hd] roped keys
    v: np.ndarray  # [n, KV, hd]
    probs_rows: np.ndarray  # [KV, G, T, n]
    a_rows: np.ndarray  # [T, H*hd] attention output (o_proj input)
    dh_rows: np.ndarray  # [T, d] dlogp_t / d(o_proj output at row t)
    da_rows: np.ndarray  # [T, H*hd] dlogp_t / d(attention output at row t)
    cos: np.ndarray  # rope tables of all positions [n, 1, hd/2]
    sin: np.ndarray

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.x, self.q_rows, self.k, self.v, self.probs_rows, self.a_rows,
                                      self.dh_rows, self.da_rows))


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
    assert tape.z is not None
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
        da_rows = dh_rows @ model.layers[li].w["o_proj"].T
        fo = entries.get((li, "o_proj"))
        if fo is not None:
            da_rows += ((dh_rows @ fo.B) * np.float32(fo.scale)) @ fo.A
        cos, sin = model.rope(n)
        instant = InstantCapture(
            layer=li,
            factors={key: f for key, f in entries.items() if key[0] == li},
            rows=rows,
            x=lt.x,
            q_rows=lt.q[rows],
            k=lt.k,
            v=lt.v,
            probs_rows=np.ascontiguousarray(lt.probs[:, :, rows, :]),
            a_rows=lt.a[rows],
            dh_rows=dh_rows,
            da_rows=da_rows,
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
    layer, at the snapshot ``ic`` was captured with."""
    w = np.asarray(weights, dtype=np.float32)[:, None]
    li = ic.layer
    rows = ic.rows
    rows_n, n = len(rows), ic.x.shape[0]
    grads: LoraGrads = {}
    if (li, "o_proj") in keys:
        grads[(li, "o_proj")] = lora_factor_grads(ic.factors[(li, "o_proj")], ic.a_rows, ic.dh_rows * w)
    want_q, want_k, want_v = ((li, p) in keys for p in ("q_proj", "k_proj", "v_proj"))
    if not (want_q or want_k or want_v):
        return grads
    dq, dk, dv = model.attention_backward(ic.probs_rows, ic.q_rows, ic.k, ic.v, ic.da_rows * w, want_q, want_k)
    if want_q and dq is not None:
        dq = model.unrotate(dq, ic.cos[rows], ic.sin[rows]).reshape(rows_n, -1)
        grads[(li, "q_proj")] = lora_factor_grads(ic.factors[(li, "q_proj")], ic.x[rows], dq)
    if want_k and dk is not None:
        dk = model.unrotate(dk, ic.cos, ic.sin).reshape(n, -1)
        grads[(li, "k_proj")] = lora_factor_grads(ic.factors[(li, "k_proj")], ic.x, dk)
    if want_v:
        grads[(li, "v_proj")] = lora_factor_grads(ic.factors[(li, "v_proj")], ic.x, dv.reshape(n, -1))
    return grads
