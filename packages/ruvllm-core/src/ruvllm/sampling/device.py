"""The device overlay: a step's sampling parameters as rows a backend applies on its device.

A backend that samples on its device (``Capabilities.device_sampling``) gets, per row, the sampling
parameters and an overlay of the few logits that penalties, bias and bans change
(:class:`ruvllm.backend.DeviceSampling`); it applies them to its logits in the reference order of
:class:`~ruvllm.sampling.reference.Sampler` and draws with the uniform drawn here. Only the chosen
tokens (and asked-for log-probabilities) leave the device; :meth:`Sampler.commit` then updates the
host's state. Each sampler's overlay is built on its first device step and then kept up to date one
produced token at a time, so a step costs O(overlay width) per row however long the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ruvllm.backend import DeviceSampling
from ruvllm.sampling.params import SamplingParams
from ruvllm.sampling.reference import Sampler


class DeviceOverlay:
    """One sampler's penalties and bias as sorted token ids, repetition flags and float64 additions."""

    __slots__ = ("add", "ids", "rep")

    def __init__(self, ids: np.ndarray, rep: np.ndarray, add: np.ndarray) -> None:
        self.ids, self.rep, self.add = ids, rep, add

    @classmethod
    def build(cls, sampler: Sampler) -> DeviceOverlay:
        """The overlay of ``sampler``'s state now: its prompt, its produced tokens, its bias."""
        p = sampler.params
        keys: list[np.ndarray] = [np.zeros(0, np.int64)]
        add: list[np.ndarray] = [np.zeros(0)]
        rep: list[np.ndarray] = [np.zeros(0, bool)]
        ids, cnt = sampler.produced()
        if p.repetition_penalty != 1.0:
            seen = np.union1d(sampler._prompt_ids, ids)
            keys.append(seen)
            add.append(np.zeros(len(seen)))
            rep.append(np.ones(len(seen), bool))
        if ids.size and (p.presence_penalty or p.frequency_penalty):
            keys.append(ids)
            add.append(-(p.frequency_penalty * cnt + p.presence_penalty))
            rep.append(np.zeros(len(ids), bool))
        if p.logit_bias:
            keys.append(np.fromiter((int(t) for t in p.logit_bias), dtype=np.int64))
            add.append(np.fromiter(p.logit_bias.values(), dtype=np.float64))
            rep.append(np.zeros(len(p.logit_bias), bool))
        k = np.concatenate(keys)
        uk, inv = np.unique(k, return_inverse=True)
        total = np.zeros(len(uk))
        np.add.at(total, inv, np.concatenate(add))
        flags = np.zeros(len(uk), bool)
        np.logical_or.at(flags, inv, np.concatenate(rep))
        return cls(uk.astype(np.int32), flags, total)

    def record(self, token: int, first: bool, params: SamplingParams) -> None:
        """Count one produced ``token`` (``first``: its first time) under ``params``."""
        p = params
        rep_on = p.repetition_penalty != 1.0
        delta = -(p.frequency_penalty + (p.presence_penalty if first else 0.0))
        if not rep_on and not delta:
            return
        ids = self.ids
        pos = int(np.searchsorted(ids, token))
        if pos < len(ids) and ids[pos] == token:
            self.rep[pos] |= rep_on
            self.add[pos] += delta
        else:
            self.ids, self.rep = np.insert(ids, pos, token), np.insert(self.rep, pos, rep_on)
            self.add = np.insert(self.add, pos, delta)


def device_row(sampler: Sampler, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, float]:
    """``sampler``'s row of :class:`ruvllm.backend.DeviceSampling` for this step: overlay ids
    (sorted), rep flags and additions, the allowed-token bits (None: all) and the repetition penalty.

    The overlay is built on first use and kept by the sampler; the step's bans (min_tokens) are
    applied to a copy."""
    p = sampler.params
    overlay = sampler._overlay
    if not isinstance(overlay, DeviceOverlay):
        overlay = sampler._overlay = DeviceOverlay.build(sampler)
    ids, rep, add = overlay.ids, overlay.rep, overlay.add
    penalty = p.repetition_penalty
    banned = np.asarray(sampler._banned(vocab) if sampler.generated < p.min_tokens else [], np.int64)
    bits = None
    if sampler.constraint is not None:
        allowed = np.zeros(vocab, bool)
        a = sampler.constraint.allowed()
        allowed[: min(len(a), vocab)] = a[:vocab]
        bits = np.packbits(allowed, bitorder="little")
        if banned.size and not np.setdiff1d(np.flatnonzero(allowed), banned).size:
            # Only what the min_tokens ban removed is allowed: the grammar wins, on the raw logits.
            empty = np.zeros(0, np.int32)
            return empty, np.zeros(0, bool), np.zeros(0, np.float32), bits, 1.0
    if banned.size:
        pos = np.searchsorted(ids, banned)
        hit = np.zeros(len(banned), bool)
        if len(ids):
            hit = (pos < len(ids)) & (ids[np.minimum(pos, len(ids) - 1)] == banned)
        add = add.copy()
        add[pos[hit]] = -np.inf
        new = np.unique(banned[~hit])
        if new.size:
            at = np.searchsorted(ids, new)
            ids, rep = np.insert(ids, at, new), np.insert(rep, at, False)
            add = np.insert(add, at, -np.inf)
    return ids, rep, add.astype(np.float32), bits, penalty


#: Overlay widths of :func:`device_sampling` below the vocabulary's (a backend that compiles per
#: shape compiles each).
OVERLAY_WIDTHS = (16, 256, 4096)


def overlay_width(n: int, vocab: int) -> int:
    """The overlay width of a batch whose longest row has ``n`` entries: the smallest of
    :data:`OVERLAY_WIDTHS` that holds it, else the vocabulary rounded up to a multiple of the
    largest (a row has at most one entry per token)."""
    for w in OVERLAY_WIDTHS:
        if n <= w:
            return w
    step = OVERLAY_WIDTHS[-1]
    return -(-max(n, vocab) // step) * step


def overlay_widths(vocab: int) -> list[int]:
    """Every width :func:`overlay_width` gives for this vocabulary."""
    return sorted({overlay_width(n, vocab) for n in (0, *(w + 1 for w in OVERLAY_WIDTHS)) if n <= vocab})


def device_sampling(samplers: Sequence[Sampler | None], vocab: int) -> DeviceSampling:
    """The :class:`ruvllm.backend.DeviceSampling` rows of ``samplers`` for this step (None: a row
    that samples nothing, e.g. a prompt chunk that does not end its prompt). Draws each non-greedy
    sampler's uniform from its generator, as :meth:`Sampler.sample` would; pass the returned tokens
    to :meth:`Sampler.commit`. The same seed thus gives the same tokens as host sampling, but for
    float32 rounding at a CDF boundary or between near-equal logits. Raises what a row's grammar
    raises, having drawn nothing."""
    b = len(samplers)
    greedy = np.ones(b, bool)
    temperature = np.ones(b, np.float32)
    top_k = np.zeros(b, np.int32)
    top_p = np.ones(b, np.float32)
    min_p = np.zeros(b, np.float32)
    penalty = np.ones(b, np.float32)
    uniform = np.zeros(b, np.float32)
    # Every row first (a grammar may raise): a failed build has drawn from no generator.
    rows = [None if s is None else device_row(s, vocab) for s in samplers]
    top = 0
    for i, (s, row) in enumerate(zip(samplers, rows, strict=True)):
        if s is None or row is None:
            continue
        p = s.params
        penalty[i] = row[4]
        if p.logprobs:
            top = max(top, min(p.logprobs, vocab))
        if p.greedy:
            continue
        greedy[i] = False
        temperature[i] = p.temperature
        top_k[i] = p.top_k if 0 < p.top_k < vocab else 0
        top_p[i], min_p[i] = p.top_p, p.min_p
        uniform[i] = s.rng.random()
    width = overlay_width(max((len(r[0]) for r in rows if r is not None), default=0), vocab)
    ids = np.full((b, width), vocab, np.int32)
    rep = np.zeros((b, width), bool)
    add = np.zeros((b, width), np.float32)
    masked = any(r is not None and r[3] is not None for r in rows)
    allowed = np.full((b, -(-vocab // 8)), 0xFF, np.uint8) if masked else None
    for i, r in enumerate(rows):
        if r is None:
            continue
        n = len(r[0])
        ids[i, :n], rep[i, :n], add[i, :n] = r[0], r[1], r[2]
        if r[3] is not None and allowed is not None:
            allowed[i] = r[3]
    return DeviceSampling(
        greedy=greedy,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=penalty,
        uniform=uniform,
        overlay_ids=ids,
        overlay_rep=rep,
        overlay_add=add,
        allowed=allowed,
        top_logprobs=top,
    )
