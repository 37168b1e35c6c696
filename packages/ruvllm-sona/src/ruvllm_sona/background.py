"""The background cycle: expire and capture trajectories (Fisher terms, residuals, bank entries),
apply feedback that waited for its capture, recluster the bank, route new scopes, merge scopes'
adapters and start deep runs. The background thread (``ruvllm_sona.sona.Sona.start``) runs one
cycle every ``background_interval`` s; ``run_cycle`` runs one now."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from ruvllm_sona.capture import capture_trajectory
from ruvllm_sona.deep_runs import SonaDeepRuns
from ruvllm_sona.errors import SonaError
from ruvllm_sona.intake import SonaIntake
from ruvllm_sona.params import copy_params
from ruvllm_sona.records import Trajectory
from ruvllm_sona.scopes import GLOBAL_SCOPE, merge_adapters

log = structlog.get_logger("ruvllm.sona")


class SonaBackground(SonaIntake, SonaDeepRuns):
    """One background cycle and its steps."""

    def run_cycle(self) -> dict[str, Any]:
        """One background cycle, synchronously (the background thread calls this every interval)."""
        with self._cycle_lock:  # one cycle at a time, whoever calls
            return self._cycle()

    def _cycle(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self._lock:
            self._expire()
            to_capture = [self._trajectories[r] for r in self._feedback_waiting
                    if r in self._trajectories and self._trajectories[r].capture is None
                    and self._trajectories[r].capture_error is None]
            budget = self.config.captures_per_cycle
            while len(to_capture) < budget and self._capture_queue:
                t = self._trajectories.get(self._capture_queue.pop())  # newest first
                if t is not None and t.capture is None and t.capture_error is None and t not in to_capture:
                    to_capture.append(t)
        captured = 0
        for traj in to_capture:
            captured += self._capture(traj)
        applied = self._apply_waiting()
        with self._lock:
            if self.bank.added_since_clustering >= self.config.bank_recluster_every or (
                    len(self.bank) and not self.bank.patterns):
                self.bank.cluster()
        routed = self._route_pending()
        merged = self._maybe_merge()
        started = self._maybe_start_deep()
        worked = bool(captured or applied or routed or merged or started)
        elapsed = time.perf_counter() - t0
        with self._lock:
            self._counters["cycles"] += 1
            if worked:
                self._cycle_times.append(elapsed)
        return {"captured": captured, "applied": applied, "routed": routed, "merged": merged,
                "deep_started": started, "seconds": elapsed}

    def _expire(self) -> None:
        horizon = time.monotonic() - self.config.trajectory_ttl
        while self._trajectories:
            rid, traj = next(iter(self._trajectories.items()))
            if traj.created >= horizon:
                break
            self._trajectories.popitem(last=False)
            if rid in self._feedback_waiting:
                self._feedback_waiting.remove(rid)

    def _capture(self, traj: Trajectory) -> int:
        tokens = traj.prompt_ids + traj.completion_ids
        snap = traj.adapter
        t0 = time.perf_counter()
        try:
            if len(tokens) > self.model_config.max_position_embeddings:
                raise SonaError(f"trajectory of {len(tokens)} tokens exceeds the model context")
            fisher, cap = capture_trajectory(self.net, tokens, len(traj.prompt_ids), snap.entries, snap.version,
                                             self.first_layer, self.instant_keys)
            base = self.net.tail_forward(cap.residual[: len(traj.prompt_ids)], self.first_layer, {})
            embedding = base.z.mean(axis=0)
        except Exception as exc:
            traj.capture_error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._counters["capture_errors"] += 1
            log.warning("sona capture failed", request_id=traj.request_id, error=traj.capture_error)
            return 0
        self._capture_times.append(time.perf_counter() - t0)
        slot = self._slot(traj.scope)
        # A cluster (``SonaConfig.clusters``) holds one taught topic, and the gate keeps it from other
        # requests, so its EWC++ observes nothing: a boundary inside one topic would anchor the
        # penalty at a half-taught adapter and hold it against the rest of that very lesson
        # (measured: 13 of 16 facts learnt with it, 16 of 16 without; docs/sona.md).
        observe = slot.ewc.lam > 0 and slot.cluster_of is None
        with slot.lock:
            boundary = slot.ewc.observe(fisher, slot.params) if observe else False
        with self._lock:
            traj.capture = cap
            self._counters["captures"] += 1
            self._counters["boundaries"] += int(boundary)
            for s in self._samples.get(traj.scope, ()):
                if s.request_id == traj.request_id and s.residual is None:
                    s.residual = cap.residual
            if traj.correction_of is None:
                self.bank.add(traj.request_id, traj.scope, embedding, traj.created, traj.score)
        return 1

    def _apply_waiting(self) -> int:
        with self._lock:
            ready = [self._trajectories[r] for r in self._feedback_waiting
                     if r in self._trajectories and (self._trajectories[r].capture is not None
                                                     or self._trajectories[r].capture_error is not None)]
            for t in ready:
                self._feedback_waiting.remove(t.request_id)
        applied = 0
        for t in ready:
            weight, t.pending_weight = t.pending_weight, None
            if t.capture is not None and weight is not None:
                self._apply_instant(t, weight)
                applied += 1
        return applied

    def embed(self, token_ids: Sequence[int]) -> np.ndarray:
        """Mean-pooled final-norm hidden state of ``token_ids`` under the base model (the bank's key)."""
        r = self.net.prefix(token_ids, self.first_layer)
        return self.net.tail_forward(r, self.first_layer, {}).z.mean(axis=0)

    def _route_pending(self) -> int:
        routed = 0
        while True:
            with self._lock:
                if not self._route_queue or not self.bank.patterns:
                    return routed
                scope, prompt = self._route_queue.popleft()
                slot = self._slots.get(scope)
            if slot is None or slot.feedback_count:
                continue
            match = self.bank.route(self.embed(prompt), self.config.route_threshold, self.config.route_min_quality)
            if match is None or match.pattern.scope in (None, scope):
                continue
            source = self._slot(str(match.pattern.scope))
            with source.lock:
                params, ewc = copy_params(source.params), copy.deepcopy(source.ewc)
                keys = list(source.taught_keys)
            with slot.lock:
                if slot.feedback_count:
                    continue
                slot.params, slot.ewc, slot.taught_keys = params, ewc, keys
                slot.routed_from = source.scope
                slot.publish()
            with self._lock:
                self._counters["routed"] += 1
            self._keys_changed(slot)
            routed += 1

    def _maybe_merge(self) -> bool:
        """Fold every non-global scope's adapter into one rank-``rank`` adapter (feedback-weighted
        mean of their weight updates, truncated SVD) that new scopes start from."""
        with self._lock:
            if not self._merge_dirty or self.config.scope == "global" or self._isolated:
                return False
            self._merge_dirty = False
            slots = [s for s in self._slots.values() if s.scope != GLOBAL_SCOPE]
        parts, keys = [], []
        for s in slots:
            with s.lock:
                if s.feedback_count:
                    parts.append((float(s.feedback_count), copy_params(s.params)))
                    keys += s.taught_keys
        if not parts:
            return False
        merged = merge_adapters(parts, self.keys, self.config.rank)
        with self._lock:
            self._merged = merged
            self._merged_keys = keys[-self.config.gate_max_keys :]
            self._counters["merges"] += 1
        return True
