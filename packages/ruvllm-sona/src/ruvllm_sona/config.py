"""SONA's settings, validated against the model they will adapt."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ruvllm.model_config import ModelConfig
from ruvllm_sona.errors import SonaError
from ruvllm_sona.model import PROJECTIONS

SCOPES = ("global", "user", "api_key")
CAPTURE_MODES = ("eager", "on_feedback")


@dataclass(frozen=True)
class SonaConfig:
    #: Whose adapter a request gets: one for everyone, per ``InferenceRequest.user``, or per API key
    #: (``request.metadata["api_key_id"]``, set by the server). Requests without one use "global".
    scope: str = "global"
    #: Adapted projections and layers (None: the last ``num_layers`` layers).
    projections: tuple[str, ...] = ("q_proj", "v_proj")
    layers: tuple[int, ...] | None = None
    num_layers: int = 2
    rank: int = 2
    #: LoRA scale is ``alpha / rank``.
    alpha: float = 4.0
    # -- instant loop (per feedback, last layer's attention factors) -------------------------------
    instant_lr: float = 0.5
    #: Largest L2 norm of one instant step's direction (gradient minus EWC pull).
    instant_max_norm: float = 1.0
    #: Reward baseline: exponential moving average of the scope's scores.
    baseline_decay: float = 0.9
    initial_baseline: float = 0.5
    #: Per-token weight of a corrected completion (it is supervised: advantage 1 times this).
    correction_weight: float = 1.0
    # -- EWC++ ----------------------------------------------------------------------------------
    #: Strength of the EWC++ pull (relative to the trajectory-mean log-likelihood's Fisher).
    ewc_lambda: float = 5e4
    ewc_decay: float = 0.9
    #: A task boundary: the mean of the last ``boundary_patience`` trajectories' gradient statistics
    #: lies further from the current task's mean than this many times the squared distance that
    #: stationary traffic gives (see ewc.py).
    boundary_threshold: float = 2.3
    boundary_patience: int = 2
    boundary_warmup: int = 6
    # -- background loop ------------------------------------------------------------------------
    background_interval: float = 0.1
    #: ``eager``: recompute every finished response in the background so feedback applies at once;
    #: ``on_feedback``: only responses that get feedback (saves CPU, feedback waits one capture).
    capture: str = "eager"
    captures_per_cycle: int = 4
    max_trajectories: int = 512
    trajectory_ttl: float = 3600.0
    bank_patterns: int = 8
    bank_max_entries: int = 4096
    bank_recluster_every: int = 16
    #: A new scope starts from the adapter of the best-rated scope of the nearest pattern when the
    #: cosine similarity of its first prompt reaches this and that pattern's mean score reaches
    #: ``route_min_quality``.
    route_threshold: float = 0.9
    route_min_quality: float = 0.6
    # -- gate: what was taught applies to requests about it -----------------------------------------
    #: Apply a scope's adapter only to requests whose prompt is near one the scope was taught with:
    #: the cosine similarity of the final-norm hidden states at the prompts' last tokens (the backend's
    #: base-model run of the request, centred on the mean over all requests seen) reaches
    #: ``gate_threshold``. Off: every request of the scope gets its adapter.
    gate: bool = True
    gate_threshold: float = 0.6
    #: Prompts a scope remembers as taught (the oldest are dropped beyond).
    gate_max_keys: int = 256
    #: Teach each topic its own adapter (needs ``gate``): a correction trains the adapter of one of
    #: the scope's clusters (see ``cluster_by``) or starts a new cluster (a fresh adapter); the gate
    #: applies the adapter of the cluster whose taught prompts are nearest the request's (at least
    #: ``gate_threshold``). Off: one adapter per scope, applied to requests near any of its taught
    #: prompts. None (the default): on exactly when ``gate`` is.
    clusters: bool | None = None
    #: With ``clusters``, what decides a correction's cluster. ``"answer"``: the cluster whose
    #: corrections share the most of this correction's tokens (Jaccard of the token sets, at least
    #: ``cluster_answer_overlap``), so one answer taught through differently worded questions stays
    #: one topic and questions of one wording about different subjects stay apart. ``"prompt"``: the
    #: cluster whose taught prompts are nearest the response's prompt (at least ``gate_threshold``; a
    #: response that ran under a cluster's adapter teaches that cluster).
    cluster_by: str = "answer"
    cluster_answer_overlap: float = 0.5
    #: Most clusters one scope keeps. At the cap, a correction that would start a new cluster joins
    #: the cluster whose taught prompts are nearest its prompt instead, so nothing taught is dropped
    #: and the router's work stays bounded.
    max_clusters: int = 64
    # -- deep loop ------------------------------------------------------------------------------
    #: Start a deep run when a scope's accumulated quality (positive advantages plus correction
    #: weights since its last run) reaches this; 0 disables the trigger (``deep_train`` still works).
    deep_trigger: float = 8.0
    deep_epochs: int = 8
    deep_lr: float = 5e-3
    deep_max_samples: int = 64
    seed: int = 0

    @property
    def clustered(self) -> bool:
        """Whether corrections teach clusters (``clusters``, which follows ``gate`` when unset)."""
        return self.gate if self.clusters is None else self.clusters

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def adapted_layers(self, model: ModelConfig) -> tuple[int, ...]:
        if self.layers is not None:
            return tuple(sorted(set(self.layers)))
        return tuple(range(model.num_layers - self.num_layers, model.num_layers))

    def validate(self, model: ModelConfig) -> None:
        def bad(msg: str) -> None:
            raise SonaError(f"bad SONA config: {msg}")

        if self.scope not in SCOPES:
            bad(f"scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")
        if self.capture not in CAPTURE_MODES:
            bad(f"capture must be one of {', '.join(CAPTURE_MODES)}, got {self.capture!r}")
        if not self.projections:
            bad("projections is empty")
        for p in self.projections:
            if p not in PROJECTIONS:
                bad(f"unknown projection {p!r} (known: {', '.join(PROJECTIONS)})")
        if self.layers is None and not 1 <= self.num_layers <= model.num_layers:
            bad(f"num_layers must be in 1..{model.num_layers}, got {self.num_layers}")
        if self.layers is not None:
            if not self.layers:
                bad("layers is empty")
            for li in self.layers:
                if not 0 <= li < model.num_layers:
                    bad(f"layer {li} is outside 0..{model.num_layers - 1}")
        if not 1 <= self.rank <= 64:
            bad(f"rank must be in 1..64, got {self.rank}")
        for name in ("alpha", "background_interval", "trajectory_ttl", "boundary_threshold"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                bad(f"{name} must be a positive number, got {v!r}")
        for name in ("instant_lr", "instant_max_norm", "correction_weight", "ewc_lambda", "deep_trigger", "deep_lr"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                bad(f"{name} must be a non-negative number, got {v!r}")
        for name in ("baseline_decay", "ewc_decay", "initial_baseline"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                bad(f"{name} must be in [0, 1], got {v!r}")
        if self.clusters is not None and not isinstance(self.clusters, bool):
            bad(f"clusters must be true, false or unset, got {self.clusters!r}")
        if self.clusters and not self.gate:
            bad("clusters needs gate (the gate picks a request's cluster)")
        if self.cluster_by not in ("prompt", "answer"):
            bad(f"cluster_by must be 'prompt' or 'answer', got {self.cluster_by!r}")
        if not 0.0 < self.cluster_answer_overlap <= 1.0:
            bad(f"cluster_answer_overlap must be in (0, 1], got {self.cluster_answer_overlap!r}")
        if not -1.0 <= self.gate_threshold <= 1.0:
            bad(f"gate_threshold must be in [-1, 1], got {self.gate_threshold!r}")
        for name in ("gate_max_keys", "boundary_patience", "captures_per_cycle", "max_trajectories", "bank_patterns",
                     "bank_max_entries", "bank_recluster_every", "deep_epochs", "deep_max_samples", "max_clusters"):
            if getattr(self, name) < 1:
                bad(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if self.boundary_warmup < 2:
            bad(f"boundary_warmup must be at least 2, got {self.boundary_warmup}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
