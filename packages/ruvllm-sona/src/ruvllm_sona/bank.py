"""The ReasoningBank: trajectory embeddings (mean-pooled final-norm hidden states of the prompt),
clustered by k-means into patterns, searched by cosine similarity.

Each pattern remembers how well its trajectories were rated and which adapter scope earned the best
ratings, so a request from a scope with no history of its own can start from the adapter of the
scope whose traffic it resembles.

On disk: ``bank.safetensors`` (``embeddings [N, d]`` unit-normalised float32, ``quality [N]`` with NaN
for unrated, ``assignments [N]`` int32 with -1 before clustering, ``centroids [K, d]``) and
``bank.json`` (format, dim, per-entry request id / scope / time, per-pattern size / mean quality /
scope).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ruvllm_sona.errors import SonaStateError

BANK_FORMAT = "ruvllm-sona-bank/1"


@dataclass(frozen=True)
class BankEntry:
    request_id: str
    scope: str
    created: float


@dataclass(frozen=True)
class Pattern:
    index: int
    size: int
    #: Mean score of the rated member trajectories (NaN when none was rated).
    mean_quality: float
    #: The scope whose rated trajectories in this pattern scored best on average (None: unrated).
    scope: str | None


@dataclass(frozen=True)
class PatternMatch:
    pattern: Pattern
    similarity: float


def _unit(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return (x / np.maximum(n, 1e-12)).astype(np.float32)


class ReasoningBank:
    def __init__(self, dim: int, *, max_entries: int = 4096, num_patterns: int = 8, seed: int = 0) -> None:
        if max_entries < 1 or num_patterns < 1:
            raise ValueError("the bank needs room for at least one entry and one pattern")
        self.dim = dim
        self.max_entries = max_entries
        self.num_patterns = num_patterns
        self.seed = seed
        self._emb = np.zeros((0, dim), np.float32)
        self._quality = np.zeros(0, np.float32)
        self._assign = np.zeros(0, np.int32)
        self._entries: list[BankEntry] = []
        self._index: dict[str, int] = {}
        self.centroids = np.zeros((0, dim), np.float32)
        self.patterns: list[Pattern] = []
        self.added_since_clustering = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(
        self, request_id: str, scope: str, embedding: np.ndarray, created: float, quality: float | None = None
    ) -> None:
        e = _unit(np.asarray(embedding, np.float32).reshape(1, self.dim))
        if request_id in self._index:  # re-captured: replace the embedding
            self._emb[self._index[request_id]] = e[0]
            return
        if len(self._entries) >= self.max_entries:  # forget the oldest
            self._emb, self._quality, self._assign = self._emb[1:], self._quality[1:], self._assign[1:]
            self._entries = self._entries[1:]
            self._index = {en.request_id: i for i, en in enumerate(self._entries)}
        self._index[request_id] = len(self._entries)
        self._entries.append(BankEntry(request_id, scope, created))
        self._emb = np.concatenate([self._emb, e])
        self._quality = np.append(self._quality, np.float32(np.nan if quality is None else quality))
        self._assign = np.append(self._assign, np.int32(-1))
        self.added_since_clustering += 1

    def set_quality(self, request_id: str, quality: float) -> bool:
        i = self._index.get(request_id)
        if i is None:
            return False
        self._quality[i] = quality
        return True

    # -- clustering -------------------------------------------------------------------------------
    def cluster(self) -> list[Pattern]:
        """Spherical k-means (k-means++ seeding, scipy's Lloyd iterations on unit vectors)."""
        from scipy.cluster.vq import kmeans2

        n = len(self._entries)
        self.added_since_clustering = 0
        if n == 0:
            self.centroids, self.patterns = np.zeros((0, self.dim), np.float32), []
            return []
        k = min(self.num_patterns, n)
        if k == 1:
            centroids, labels = self._emb.mean(axis=0, keepdims=True), np.zeros(n, np.int32)
        else:
            with warnings.catch_warnings():  # an empty cluster (duplicate points) is dropped below
                warnings.simplefilter("ignore")
                centroids, labels = kmeans2(
                    self._emb.astype(np.float64), k, minit="++", seed=np.random.default_rng(self.seed), missing="warn"
                )
        used = np.unique(labels)
        remap = np.full(k, -1, np.int32)
        remap[used] = np.arange(len(used), dtype=np.int32)
        self.centroids = _unit(np.asarray(centroids, np.float32)[used])
        self._assign = remap[np.asarray(labels)]
        self.patterns = [self._pattern(i) for i in range(len(used))]
        return self.patterns

    def _pattern(self, i: int) -> Pattern:
        members = np.flatnonzero(self._assign == i)
        q = self._quality[members]
        rated = members[~np.isnan(q)]
        mean_q = float(np.mean(self._quality[rated])) if len(rated) else math.nan
        by_scope: dict[str, list[float]] = {}
        for j in rated:
            by_scope.setdefault(self._entries[j].scope, []).append(float(self._quality[j]))
        scope = max(by_scope, key=lambda s: (np.mean(by_scope[s]), len(by_scope[s]))) if by_scope else None
        return Pattern(i, len(members), mean_q, scope)

    # -- retrieval --------------------------------------------------------------------------------
    def search(self, embedding: np.ndarray, k: int = 3) -> list[PatternMatch]:
        """The ``k`` patterns nearest to ``embedding`` by cosine similarity, best first."""
        if not self.patterns:
            return []
        sims = self.centroids @ _unit(np.asarray(embedding, np.float32).reshape(self.dim))
        order = np.argsort(-sims)[:k]
        return [PatternMatch(self.patterns[i], float(sims[i])) for i in order]

    def route(self, embedding: np.ndarray, threshold: float, min_quality: float) -> PatternMatch | None:
        """The nearest pattern when it is similar enough and well rated, else None."""
        best = self.search(embedding, 1)
        if not best:
            return None
        m = best[0]
        if m.similarity < threshold or m.pattern.scope is None or not m.pattern.mean_quality >= min_quality:
            return None
        return m

    def stats(self) -> dict[str, object]:
        return {
            "entries": len(self._entries),
            "rated": int(np.sum(~np.isnan(self._quality))),
            "patterns": [
                {"size": p.size, "mean_quality": None if math.isnan(p.mean_quality) else round(p.mean_quality, 4),
                 "scope": p.scope}
                for p in self.patterns
            ],
        }

    # -- persistence ------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        from safetensors.numpy import save_file

        tmp = directory / "bank.safetensors.tmp"
        save_file(
            {
                "embeddings": np.ascontiguousarray(self._emb),
                "quality": np.ascontiguousarray(self._quality),
                "assignments": np.ascontiguousarray(self._assign),
                "centroids": np.ascontiguousarray(self.centroids),
            },
            str(tmp),
        )
        os.replace(tmp, directory / "bank.safetensors")
        manifest = {
            "format": BANK_FORMAT,
            "dim": self.dim,
            "entries": [asdict(e) for e in self._entries],
            "patterns": [asdict(p) | {"mean_quality": None if math.isnan(p.mean_quality) else p.mean_quality}
                         for p in self.patterns],
        }
        tmpj = directory / "bank.json.tmp"
        tmpj.write_text(json.dumps(manifest, indent=1))
        os.replace(tmpj, directory / "bank.json")

    def load(self, directory: Path) -> None:
        from safetensors.numpy import load_file

        try:
            manifest = json.loads((directory / "bank.json").read_text())
            arrays = load_file(str(directory / "bank.safetensors"))
        except Exception as exc:  # OSError, JSON errors, safetensors' own SafetensorError
            raise SonaStateError(f"{directory}: the ReasoningBank could not be read ({exc})") from exc
        if manifest.get("format") != BANK_FORMAT or manifest.get("dim") != self.dim:
            raise SonaStateError(
                f"{directory}: bank format {manifest.get('format')!r} dim {manifest.get('dim')} does not match "
                f"{BANK_FORMAT!r} dim {self.dim}"
            )
        entries = [BankEntry(e["request_id"], e["scope"], float(e["created"])) for e in manifest["entries"]]
        emb = arrays["embeddings"]
        if emb.shape != (len(entries), self.dim) or arrays["quality"].shape != (len(entries),):
            raise SonaStateError(f"{directory}: bank.safetensors does not match bank.json")
        self._entries = entries
        self._index = {e.request_id: i for i, e in enumerate(entries)}
        self._emb, self._quality = emb.astype(np.float32), arrays["quality"].astype(np.float32)
        self._assign = arrays["assignments"].astype(np.int32)
        self.centroids = arrays["centroids"].astype(np.float32)
        self.patterns = [
            Pattern(int(p["index"]), int(p["size"]),
                    math.nan if p["mean_quality"] is None else float(p["mean_quality"]), p["scope"])
            for p in manifest["patterns"]
        ]
