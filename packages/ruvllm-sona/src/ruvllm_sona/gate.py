"""The gate of each request (engine thread) and the clusters of a scope: which adapter, if any, a
prompt runs under, and where a correction teaches (``SonaConfig.gate``, ``SonaConfig.clusters``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from ruvllm_sona.lora import SonaAdapter
from ruvllm_sona.records import Trajectory
from ruvllm_sona.scopes import KeyTable, Slot
from ruvllm_sona.state import SonaState

log = structlog.get_logger("ruvllm.sona")


class SonaGate(SonaState):
    """The router a request carries and the scope's clusters it chooses among."""

    def _gate(
        self, rid: str, scope: str, snap: SonaAdapter, key: np.ndarray, info: dict[str, Any]
    ) -> SonaAdapter | None:
        """The router of one request (engine thread): remember its key, then apply the scope's
        adapter only if the prompt is near one the scope was taught with."""
        key = np.asarray(key, np.float32).copy()
        slot = self._slot(scope)
        with self._lock:
            self.gate_center.observe(key)
            self._pending_keys[rid] = key
            while len(self._pending_keys) > self.config.max_trajectories:
                self._pending_keys.popitem(last=False)
            with slot.lock:
                taught = list(slot.taught_keys)
            similarity = None if snap.is_zero else self.gate_center.similarity(key, taught)
        applied = similarity is not None and similarity >= self.config.gate_threshold
        with self._lock:
            self._counters["gate_applied" if applied else "gate_skipped"] += 1
        info.update(applied=applied, similarity=None if similarity is None else round(similarity, 4))
        log.debug("sona gate", request_id=rid, scope=scope, similarity=info["similarity"], applied=applied)
        return snap if applied else None

    def _clusters(self, scope: str) -> list[Slot]:
        """The scope's own slot and its clusters' (``SonaConfig.clusters``)."""
        with self._lock:
            return [s for s in self._slots.values() if s.scope == scope or s.cluster_of == scope]

    def _key_table(self, scope: str) -> tuple[list[Slot], KeyTable | None]:
        """The scope's slots (its own and its clusters') and their taught keys in one table, rebuilt
        only after one of them changed."""
        with self._lock:
            cached = self._key_tables.get(scope)
            if cached is not None:
                return cached
            slots = self._clusters(scope)
            keys: list[np.ndarray] = []
            owner: list[int] = []
            for i, slot in enumerate(slots):
                with slot.lock:
                    keys += slot.taught_keys
                    owner += [i] * len(slot.taught_keys)
            table = KeyTable.of(keys, owner) if keys else None
            self._key_tables[scope] = (slots, table)
            return slots, table

    def _nearest(
        self, scope: str, key: np.ndarray, applicable: bool = True, clusters_only: bool = False
    ) -> tuple[Slot | None, float | None]:
        """The slot of ``scope`` (or of one of its clusters) whose taught prompts are nearest ``key``,
        and that similarity; (None, None) when none was taught. ``applicable``: only slots whose
        adapter changes anything (what the gate may apply); else also clusters whose first correction
        is not applied yet (where the next correction belongs). ``clusters_only``: not the scope's
        own slot. One matrix product over every taught key of the scope, whatever the clusters."""
        slots, table = self._key_table(scope)
        if table is None:
            return None, None
        with self._lock:
            sims = self.gate_center.similarities(key, table)
        best = np.full(len(slots), -np.inf)
        np.maximum.at(best, table.owner, sims)
        for i, slot in enumerate(slots):
            if (applicable and slot.snapshot.is_zero) or (clusters_only and slot.cluster_of is None):
                best[i] = -np.inf
        i = int(np.argmax(best))
        if best[i] == -np.inf:
            return None, None
        return slots[i], float(best[i])

    def _gate_clusters(self, rid: str, scope: str, key: np.ndarray, info: dict[str, Any]) -> SonaAdapter | None:
        """The router with clusters: the adapter of the cluster nearest the prompt, if near enough."""
        key = np.asarray(key, np.float32).copy()
        with self._lock:
            self.gate_center.observe(key)
            self._pending_keys[rid] = key
            while len(self._pending_keys) > self.config.max_trajectories:
                self._pending_keys.popitem(last=False)
        slot, similarity = self._nearest(scope, key)
        applied = slot is not None and similarity is not None and similarity >= self.config.gate_threshold
        chosen = None
        if applied:
            with slot.lock:
                chosen = slot.snapshot
        with self._lock:
            self._counters["gate_applied" if applied else "gate_skipped"] += 1
        info.update(applied=applied, similarity=None if similarity is None else round(similarity, 4),
                    cluster=chosen.scope if chosen is not None else None)  # fmt: skip
        log.debug("sona gate", request_id=rid, scope=scope, similarity=info["similarity"], applied=applied,
                  cluster=info["cluster"])  # fmt: skip
        return chosen

    def _cluster_for(self, traj: Trajectory, correction: Sequence[int]) -> str:
        """Where a correction of ``traj`` teaches with clusters (``SonaConfig.cluster_by``): by
        prompt, the cluster it ran under, else the scope's cluster nearest its prompt (at least
        ``gate_threshold``); by answer, the scope's cluster whose corrections share most of this
        one's tokens (at least ``cluster_answer_overlap``); else a new cluster."""
        with self._lock:
            ran_under = self._slots.get(traj.scope)
        base = ran_under.cluster_of if ran_under is not None and ran_under.cluster_of is not None else traj.scope
        if self.config.cluster_by == "answer":
            answer = frozenset(correction)
            with self._lock:  # the choice and the record in one hold: two corrections of a new answer
                best: tuple[Slot | None, float] = (None, 0.0)  # make one cluster, not two
                for slot in self._clusters(base):
                    with slot.lock:
                        overlap = max((len(answer & a) / len(answer | a) for a in slot.taught_answers), default=0.0)
                    if overlap > best[1]:
                        best = (slot, overlap)
                near = best[0] if best[1] >= self.config.cluster_answer_overlap else None
                chosen = near.scope if near is not None else self._new_cluster(base, traj.key)
                slot = self._slots[chosen]
                with slot.lock:
                    if answer not in slot.taught_answers:
                        slot.taught_answers.append(answer)
                        del slot.taught_answers[: max(0, len(slot.taught_answers) - self.config.gate_max_keys)]
            return chosen
        if traj.key is None or base != traj.scope:
            return traj.scope
        slot, similarity = self._nearest(traj.scope, traj.key, applicable=False)
        if slot is not None and similarity is not None and similarity >= self.config.gate_threshold:
            return slot.scope
        return self._new_cluster(traj.scope, traj.key)

    def _new_cluster(self, scope: str, key: np.ndarray | None) -> str:
        """A new cluster (a fresh adapter) of ``scope``; its name. At ``max_clusters`` the existing
        cluster whose taught prompts are nearest ``key`` (the prompt being corrected) instead, else
        the most recently made one."""
        with self._lock:  # (re-entrant: the new cluster's slot is made under the same hold)
            clusters = [s for s in self._slots.values() if s.cluster_of == scope]
            n = len(clusters)
            if n >= self.config.max_clusters:
                near = self._nearest(scope, key, applicable=False, clusters_only=True)[0] if key is not None else None
                joined = near if near is not None else clusters[-1]
                self._counters["cluster_cap_joins"] += 1
                log.info("sona cluster cap reached; the correction joins the nearest cluster", scope=scope,
                         max_clusters=self.config.max_clusters, cluster=joined.scope)
                return joined.scope
            name = f"{scope}#topic{n}"
            while name in self._slots:
                n += 1
                name = f"{scope}#topic{n}"
            self._slot(name, cluster_of=scope)
        return name
