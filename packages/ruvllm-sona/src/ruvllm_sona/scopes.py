"""Adapter scopes: which scope a request learns in, one scope's learner state (:class:`Slot`), fresh
adapter parameters, and the merge of scopes' adapters that new scopes start from."""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ruvllm_sona.config import SonaConfig
from ruvllm_sona.ewc import EwcPlusPlus
from ruvllm_sona.lora import SonaAdapter
from ruvllm_sona.model import LoraFactors, LoraLlama
from ruvllm_sona.params import Key, Params

if TYPE_CHECKING:
    from ruvllm.inference import InferenceRequest

GLOBAL_SCOPE = "global"


def key_scope(api_key_id: str) -> str:
    """The adapter scope of an API key id (``api_key`` scope mode)."""
    return f"key:{api_key_id}"


def scope_of(config: SonaConfig, request: InferenceRequest) -> str:
    """The scope ``request`` is served and taught in under ``config.scope``."""
    mode = config.scope
    if mode == "user" and request.user:
        return f"user:{request.user}"
    if mode == "api_key":
        key = request.metadata.get("api_key_id")
        if key:
            return key_scope(key)
    return GLOBAL_SCOPE


def fresh_params(config: SonaConfig, net: LoraLlama, keys: Sequence[Key], scope: str) -> Params:
    """A new scope's factors: A uniform in +-1/sqrt(fan_in) (seeded by the scope's name), B zero, so
    the adapter starts as the identity."""
    rng = np.random.default_rng([config.seed, zlib.crc32(scope.encode())])
    out: Params = {}
    for li, proj in keys:
        fan_in = net.in_features(proj)
        bound = 1.0 / math.sqrt(fan_in)
        a = rng.uniform(-bound, bound, (config.rank, fan_in)).astype(np.float32)
        out[(li, proj)] = (a, np.zeros((net.out_features(proj), config.rank), np.float32))
    return out


def new_ewc(config: SonaConfig, params: Params) -> EwcPlusPlus:
    c = config
    return EwcPlusPlus(params, c.scale, lam=c.ewc_lambda, decay=c.ewc_decay, threshold=c.boundary_threshold,
                       patience=c.boundary_patience, warmup=c.boundary_warmup)


class Slot:
    """One scope's learner state. ``lock`` guards everything here."""

    def __init__(self, scope: str, params: Params, scale: float, ewc: EwcPlusPlus, baseline: float) -> None:
        self.scope = scope
        self.lock = threading.Lock()
        self.params = params
        self.scale = scale
        self.ewc = ewc
        self.baseline = baseline
        self.version = 0
        self.feedback_count = 0
        self.instant_updates = 0
        self.deep_runs = 0
        self.pending_quality = 0.0
        self.routed_from: str | None = None
        #: The scope this slot is a cluster (one taught topic) of (``SonaConfig.clusters``), or None.
        self.cluster_of: str | None = None
        #: Gate keys of the prompts this scope was taught with (see ``SonaConfig.gate``).
        self.taught_keys: list[np.ndarray] = []
        #: Token sets of the corrections this cluster was taught (``SonaConfig.cluster_by="answer"``).
        self.taught_answers: list[frozenset[int]] = []
        self.snapshot = self._make_snapshot()

    def _make_snapshot(self) -> SonaAdapter:
        return SonaAdapter(
            self.scope, self.version, {k: LoraFactors(a, b, self.scale) for k, (a, b) in self.params.items()}
        )

    def publish(self) -> SonaAdapter:
        """Snapshot the current parameters as a new version (call with ``lock`` held)."""
        self.version += 1
        self.snapshot = self._make_snapshot()
        return self.snapshot


class GateCenter:
    """Running mean of the gate keys of every request seen: cosine similarities are taken after
    subtracting it (final hidden states share a large common direction)."""

    def __init__(self, size: int) -> None:
        self.mean = np.zeros(size, np.float64)
        self.count = 0

    def observe(self, key: np.ndarray) -> None:
        self.count += 1
        self.mean += (np.asarray(key, np.float64) - self.mean) / self.count

    def similarity(self, key: np.ndarray, taught: Sequence[np.ndarray]) -> float | None:
        """Largest centred cosine similarity of ``key`` to ``taught`` (None when nothing is taught)."""
        if not taught:
            return None
        return float(np.max(self.similarities(key, KeyTable.of(taught))))

    def similarities(self, key: np.ndarray, table: KeyTable) -> np.ndarray:
        """Centred cosine similarity of ``key`` to each row of ``table``, in one matrix product.
        Where a vector is (nearly) the centre itself, so that its centred direction is undefined (all
        traffic so far was one prompt), the uncentred cosine stands in for that pair.

        With ``t`` a row, ``q`` the key and ``m`` the centre: ``(t-m).(q-m) = t.q - t.m - m.q + m.m``
        and ``|t-m|^2 = |t|^2 - 2 t.m + |m|^2``, so the rows are never centred one by one. In float64
        the cancellation costs at most ~1e-10 of a similarity wherever the centred norms pass the
        degeneracy test below."""
        raw_q = np.asarray(key, np.float64)
        m = self.mean
        tq, tm = (table.rows @ np.stack([raw_q, m], axis=1)).T
        mm, mq, qq = float(m @ m), float(m @ raw_q), float(raw_q @ raw_q)
        nt = np.sqrt(np.maximum(table.sq - 2.0 * tm + mm, 0.0))
        nq = math.sqrt(max(qq - 2.0 * mq + mm, 0.0))
        rt, rq = np.maximum(np.sqrt(table.sq), 1e-30), max(math.sqrt(qq), 1e-30)
        centred = (tq - tm - mq + mm) / np.maximum(nt * nq, 1e-30)
        uncentred = tq / (rt * rq)
        degenerate = (nt < 1e-3 * rt) | (nq < 1e-3 * rq)
        return np.where(degenerate, uncentred, centred)


class KeyTable:
    """Gate keys stacked for :meth:`GateCenter.similarities`: ``rows`` [n, hidden] in float64, their
    squared norms, and ``owner[i]``, the index of the slot row ``i`` was taught to."""

    def __init__(self, rows: np.ndarray, owner: np.ndarray) -> None:
        self.rows = rows
        self.sq = np.einsum("ij,ij->i", rows, rows)
        self.owner = owner

    @classmethod
    def of(cls, keys: Sequence[np.ndarray], owner: Sequence[int] | None = None) -> KeyTable:
        rows = np.stack([np.asarray(k, np.float64) for k in keys])
        return cls(rows, np.asarray(owner if owner is not None else np.zeros(len(keys)), np.intp))


def merge_adapters(parts: Sequence[tuple[float, Params]], keys: Sequence[Key], rank: int) -> Params:
    """One rank-``rank`` adapter from weighted scopes' adapters: the weighted mean of their weight
    updates ``B A``, truncated by SVD."""
    total = sum(w for w, _ in parts)
    merged: Params = {}
    for k in keys:
        b_cat = np.concatenate([p[k][1] * np.float32(w / total) for w, p in parts], axis=1)
        a_cat = np.concatenate([p[k][0] for _, p in parts], axis=0)
        merged[k] = low_rank_product(b_cat, a_cat, rank)
    return merged


def low_rank_product(b: np.ndarray, a: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Factors ``(A [rank, in], B [out, rank])`` of the best rank-``rank`` approximation of ``b @ a``
    (``b [out, k]``, ``a [k, in]``), through QR of both factors and an SVD of the small core."""
    qb, rb = np.linalg.qr(b.astype(np.float64))
    qa, ra = np.linalg.qr(a.T.astype(np.float64))
    u, s, vt = np.linalg.svd(rb @ ra.T)
    r = min(rank, len(s))
    root = np.sqrt(s[:r])
    b_new = np.zeros((b.shape[0], rank))
    a_new = np.zeros((rank, a.shape[1]))
    b_new[:, :r] = (qb @ u[:, :r]) * root
    a_new[:r] = (root[:, None] * vt[:r]) @ qa.T
    return a_new.astype(np.float32), b_new.astype(np.float32)
