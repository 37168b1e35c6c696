"""The deep loop's training: Adam over every adapted factor on a scope's stored samples, maximising
their weighted log-likelihood, with the EWC++ pull toward what earlier tasks needed."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ruvllm_sona.config import SonaConfig
from ruvllm_sona.ewc import EwcPlusPlus
from ruvllm_sona.model import LoraFactors, LoraLlama
from ruvllm_sona.params import Key, Params, copy_params
from ruvllm_sona.records import Sample


def fit_deep(
    net: LoraLlama,
    keys: Sequence[Key],
    first_layer: int,
    samples: Sequence[Sample],
    start: Params,
    scale: float,
    ewc: EwcPlusPlus | None,
    config: SonaConfig,
    *,
    seed: Sequence[int],
) -> tuple[Params, int, list[float]]:
    """``config.deep_epochs`` epochs over ``samples`` (each with its base residual at ``first_layer``)
    from ``start``; returns the trained factors, the Adam steps taken and each epoch's mean weighted
    negative log-likelihood per token."""
    params = copy_params(start)
    m1 = {k: (np.zeros_like(a), np.zeros_like(b)) for k, (a, b) in params.items()}
    m2 = {k: (np.zeros_like(a), np.zeros_like(b)) for k, (a, b) in params.items()}
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    rng = np.random.default_rng(list(seed))
    step = 0
    epoch_losses: list[float] = []
    for _ in range(config.deep_epochs):
        total, tokens = 0.0, 0.0
        for i in rng.permutation(len(samples)):
            s = samples[i]
            assert s.residual is not None
            entries = {k: LoraFactors(a, b, scale) for k, (a, b) in params.items()}
            tape = net.tail_forward(s.residual, first_layer, entries)
            rows = np.arange(s.num_prompt - 1, len(s.token_ids) - 1)
            targets = np.asarray(s.token_ids[s.num_prompt:], dtype=np.int64)
            w = np.full(len(rows), s.weight / len(rows), np.float32)
            dr, lp = net.head_backward(tape, rows, targets, w)
            grads, _ = net.tail_backward(tape, dr, entries)
            pull = ewc.penalty_grad(params, keys) if ewc is not None else None
            total += float(-np.mean(lp)) * s.weight
            tokens += s.weight
            step += 1
            for k in keys:
                for j in (0, 1):
                    g = grads[k][j] if k in grads else np.zeros_like(params[k][j])
                    if pull is not None:
                        g = g - pull[k][j]
                    mm, vv = m1[k][j], m2[k][j]
                    mm *= beta1
                    mm += (1 - beta1) * g
                    vv *= beta2
                    vv += (1 - beta2) * g * g
                    mhat = mm / (1 - beta1**step)
                    vhat = vv / (1 - beta2**step)
                    params[k][j][...] += np.float32(config.deep_lr) * mhat / (np.sqrt(vhat) + eps)  # ascent
        epoch_losses.append(total / max(tokens, 1e-12))
    return params, step, epoch_losses
