"""What the learner reports: counters, latencies, the scopes' adapters, the deep loop, the bank
and the gate (``Sona.stats``, served at ``GET /v1/sona/stats``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ruvllm_sona.state import SonaState


def _percentiles(values: Iterable[float]) -> dict[str, float | None]:
    v = np.asarray(list(values), dtype=np.float64)
    if not len(v):
        return {"count": 0, "p50_ms": None, "p99_ms": None}
    return {"count": len(v), "p50_ms": round(float(np.percentile(v, 50)) * 1e3, 4),
            "p99_ms": round(float(np.percentile(v, 99)) * 1e3, 4)}



class SonaStats(SonaState):
    """``stats()``: a consistent picture taken under the instance's lock, then each scope's."""

    def stats(self) -> dict[str, Any]:
        with self._lock:
            slots = list(self._slots.values())
            held = len(self._trajectories)
            captured = sum(1 for t in self._trajectories.values() if t.capture is not None)
            waiting = len(self._feedback_waiting)
            counters = dict(self._counters)
            bank = self.bank.stats()
            last_deep = self._last_deep
        adapters = []
        for s in slots:
            with s.lock:
                adapters.append({
                    "scope": s.scope, "version": s.version, "active": not s.snapshot.is_zero,
                    "feedback": s.feedback_count, "instant_updates": s.instant_updates, "deep_runs": s.deep_runs,
                    "baseline": round(s.baseline, 4), "pending_quality": round(s.pending_quality, 4),
                    "routed_from": s.routed_from, "ewc": s.ewc.stats(), "taught_prompts": len(s.taught_keys),
                    "cluster_of": s.cluster_of,
                })
        return {
            "model": self.model_config.name,
            "scope_mode": self.config.scope,
            "adapted": [f"layers.{li}.{p}" for li, p in self.keys],
            "instant_adapted": [f"layers.{li}.{p}" for li, p in self.instant_keys],
            "rank": self.config.rank,
            "counters": counters,
            "trajectories": {"held": held, "captured": captured, "feedback_waiting": waiting},
            "instant_update": _percentiles(self._instant_times),
            "capture": _percentiles(self._capture_times),
            "background_cycle": _percentiles(self._cycle_times),
            "deep": {
                "running": self._deep_thread is not None and self._deep_thread.is_alive(),
                "last": None if last_deep is None else {
                    "scope": last_deep.scope, "samples": last_deep.samples, "steps": last_deep.steps,
                    "seconds": round(last_deep.seconds, 3),
                    "first_epoch_loss": round(last_deep.first_epoch_loss, 4),
                    "last_epoch_loss": round(last_deep.last_epoch_loss, 4),
                    "adapter_version": last_deep.adapter_version,
                },
                "last_error": self._deep_error,
            },
            "bank": bank,
            "gate": {"enabled": self.config.gate, "threshold": self.config.gate_threshold,
                     "clusters": self.config.clustered, "cluster_by": self.config.cluster_by,
                     "max_clusters": self.config.max_clusters,
                     "requests_seen": self.gate_center.count, "applied": counters["gate_applied"],
                     "skipped": counters["gate_skipped"]},
            "adapters": adapters,
        }
