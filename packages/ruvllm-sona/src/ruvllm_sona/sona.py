"""SONA: per-scope MicroLoRA adapters that learn from feedback on three time scales.

This module is the orchestrator (hooks, locks, the background and deep threads, feedback); its parts
live beside it: ``scopes`` (which scope a request learns in, a scope's state, merging), ``capture``
(recomputing a trajectory, the instant gradient), ``deep`` (the deep loop's training), ``bank`` (the
ReasoningBank), ``persistence`` (state on disk) and ``records`` (what is kept and reported).

* pre_inference picks the request's scope and attaches that scope's current adapter snapshot.
* post_inference keeps the finished trajectory (prompt + completion + snapshot) for a while.
* The background loop (a thread, every ``background_interval`` s) recomputes trajectories
  (``capture``), feeds the EWC++ Fisher estimate and task-boundary detector, fills and clusters the
  ReasoningBank, routes new scopes to similar scopes' adapters, merges scope adapters, applies
  feedback that waited for a capture, and starts deep runs.
* ``feedback`` applies the instant loop at once when the trajectory is captured: the exact gradient
  of the advantage-weighted (or corrected) log-likelihood w.r.t. the last layer's attention factors,
  minus the EWC++ pull, one clipped step, a new snapshot.
* The deep loop (its own thread) fine-tunes every adapted factor over the scope's stored samples
  with Adam and the EWC++ penalty, then swaps the result in under the scope's lock.

Snapshots are immutable; publishing replaces a reference under a lock, so a request keeps the
adapter it started with whatever happens while it runs.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from ruvllm.errors import RuvllmError
from ruvllm.hookspecs import hookimpl
from ruvllm_sona.bank import ReasoningBank
from ruvllm_sona.capture import INSTANT_PROJECTIONS, capture_trajectory, instant_gradient
from ruvllm_sona.config import SonaConfig
from ruvllm_sona.deep import fit_deep
from ruvllm_sona.errors import FeedbackError, SonaError, UnknownResponseError
from ruvllm_sona.lora import SonaAdapter
from ruvllm_sona.model import LoraLlama
from ruvllm_sona.params import Key, Params, copy_params, flat
from ruvllm_sona.persistence import STATE_FORMAT, load_gate_center, load_state, save_gate_center, save_state
from ruvllm_sona.records import DeepRunReport, FeedbackReceipt, Sample, Trajectory
from ruvllm_sona.scopes import (
    GLOBAL_SCOPE,
    GateCenter,
    KeyTable,
    Slot,
    fresh_params,
    key_scope,
    low_rank_product,
    merge_adapters,
    new_ewc,
    scope_of,
)

if TYPE_CHECKING:
    from ruvllm.checkpoint import Checkpoint
    from ruvllm.inference import InferenceRequest, InferenceResult
    from ruvllm.runtime import LoadedModel
    from ruvllm.tokenizer import Tokenizer

log = structlog.get_logger("ruvllm.sona")

#: Key under which pre_inference leaves the snapshot in ``InferenceRequest.metadata``.
ADAPTER_METADATA_KEY = "sona.adapter"


def _percentiles(values: Iterable[float]) -> dict[str, float | None]:
    v = np.asarray(list(values), dtype=np.float64)
    if not len(v):
        return {"count": 0, "p50_ms": None, "p99_ms": None}
    return {"count": len(v), "p50_ms": round(float(np.percentile(v, 50)) * 1e3, 4),
            "p99_ms": round(float(np.percentile(v, 99)) * 1e3, 4)}


class Sona:
    """The SONA learner for one loaded model. Register it (or the ``ruvllm_sona.plugin`` module after
    :func:`ruvllm_sona.plugin.attach`) with the model's plugin host so the engine calls its hooks."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        config: SonaConfig | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        state_dir: str | Path | None = None,
        start: bool = True,
        net: LoraLlama | None = None,
    ) -> None:
        self.config = config = config or SonaConfig()
        mc = checkpoint.config
        config.validate(mc)
        self.model_config = mc
        self.net = net if net is not None else LoraLlama.from_checkpoint(checkpoint)
        self._tokenizer = tokenizer
        self._checkpoint = checkpoint
        layers = config.adapted_layers(mc)
        self.keys: list[Key] = [(li, p) for li in layers for p in config.projections]
        self.first_layer = layers[0]
        last = mc.num_layers - 1
        self.instant_keys: list[Key] = [(last, p) for p in config.projections if p in INSTANT_PROJECTIONS and
                                        last in layers]
        if config.instant_lr > 0 and not self.instant_keys:
            raise SonaError(
                "bad SONA config: the instant loop adapts the last layer's q/k/v/o projections; include layer "
                f"{last} and one of them, or set instant_lr=0"
            )
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self._lock = threading.RLock()
        self._slots: dict[str, Slot] = {}
        self._trajectories: OrderedDict[str, Trajectory] = OrderedDict()
        self._capture_queue: deque[str] = deque(maxlen=config.max_trajectories)
        self._feedback_waiting: list[str] = []
        self._route_queue: deque[tuple[str, list[int]]] = deque()
        self._samples: dict[str, deque[Sample]] = {}
        self._merged: Params | None = None
        self._merge_dirty = False
        self.bank = ReasoningBank(mc.hidden_size, max_entries=config.bank_max_entries,
                                  num_patterns=config.bank_patterns, seed=config.seed)
        self._counters = {"trajectories": 0, "captures": 0, "capture_errors": 0, "feedback": 0,
                          "corrections": 0, "instant_updates": 0, "boundaries": 0, "merges": 0, "routed": 0,
                          "deep_runs": 0, "cycles": 0, "gate_applied": 0, "gate_skipped": 0,
                          "cluster_cap_joins": 0}
        #: The gate's centre and the keys of requests not yet finished, by request id.
        self.gate_center = GateCenter(mc.hidden_size)
        self._pending_keys: OrderedDict[str, np.ndarray] = OrderedDict()
        self._merged_keys: list[np.ndarray] = []
        #: Each scope's taught keys stacked for the router (see ``_key_table``), valid until a slot of
        #: that scope (its own or a cluster) is made or its taught keys change (``_keys_changed``).
        self._key_tables: dict[str, tuple[list[Slot], KeyTable | None]] = {}
        self._instant_times: deque[float] = deque(maxlen=2000)
        self._capture_times: deque[float] = deque(maxlen=500)
        self._cycle_times: deque[float] = deque(maxlen=500)
        self._last_deep: DeepRunReport | None = None
        self._deep_thread: threading.Thread | None = None
        self._deep_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cycle_lock = threading.Lock()
        self._slot(GLOBAL_SCOPE)
        if self.state_dir is not None and (self.state_dir / "manifest.json").is_file():
            self.load(self.state_dir)
        if start:
            self.start()

    @classmethod
    def for_model(cls, model: LoadedModel, config: SonaConfig | None = None, **kw: Any) -> Sona:
        """SONA for a loaded model; without a tokenizer, corrections must come as token ids."""
        try:
            tokenizer = model.tokenizer
        except RuvllmError:
            tokenizer = None
        return cls(model.checkpoint, config, tokenizer=tokenizer, **kw)

    # -- threads ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background loop (idempotent)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._background, name="sona-background", daemon=True)
                self._thread.start()

    def close(self, save: bool = True) -> None:
        """Stop the loops (waiting for a deep run in flight) and save state when a directory is set."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._deep_thread is not None:
            self._deep_thread.join()
        if save and self.state_dir is not None:
            self.save(self.state_dir)

    def _background(self) -> None:
        while not self._stop.wait(self.config.background_interval):
            try:
                self.run_cycle()
            except Exception as exc:  # the loop must survive a bad trajectory
                log.warning("sona background cycle failed", error=repr(exc))

    # -- scopes -----------------------------------------------------------------------------------
    def scope_of(self, request: InferenceRequest) -> str:
        return scope_of(self.config, request)

    @property
    def _isolated(self) -> bool:
        """API-key scopes are tenants: no routing from, or merging with, another key's adapter, so
        one key's feedback never shapes another key's outputs."""
        return self.config.scope == "api_key"

    def _slot(self, scope: str, prompt: Sequence[int] | None = None, cluster_of: str | None = None) -> Slot:
        with self._lock:
            slot = self._slots.get(scope)
            if slot is not None:
                return slot
            # A cluster (``cluster_of``'s, see ``SonaConfig.clusters``) learns one topic from scratch.
            shared = self._merged is not None and not self._isolated and cluster_of is None
            params = copy_params(self._merged) if shared else fresh_params(self.config, self.net, self.keys, scope)
            slot = Slot(scope, params, self.config.scale, new_ewc(self.config, params), self.config.initial_baseline)
            slot.cluster_of = cluster_of
            if shared:
                slot.taught_keys = list(self._merged_keys)
            self._slots[scope] = slot
            self._keys_changed(slot)
            self._samples[scope] = deque(maxlen=self.config.deep_max_samples)
            if scope != GLOBAL_SCOPE and prompt and not self._isolated:
                self._route_queue.append((scope, list(prompt)))
            return slot

    def adapter(self, scope: str = GLOBAL_SCOPE) -> SonaAdapter:
        """The current snapshot of ``scope`` (created empty if new)."""
        slot = self._slot(scope)
        with slot.lock:
            return slot.snapshot

    # -- hooks ------------------------------------------------------------------------------------
    @hookimpl
    def pre_inference(self, request: InferenceRequest) -> None:
        if request.adapter is not None:
            return  # the request runs an adapter the user chose; SONA neither replaces nor learns it
        scope = self.scope_of(request)
        slot = self._slot(scope, request.prompt_token_ids)
        with slot.lock:
            snap = slot.snapshot
        request.metadata[ADAPTER_METADATA_KEY] = snap
        info: dict[str, Any] = {"scope": scope, "adapter_version": snap.version}
        request.metadata["sona"] = info
        if not self.config.gate:
            # An all-zero adapter changes nothing; leaving it off keeps the request prefix-cacheable.
            request.adapter = None if snap.is_zero else snap
            return
        rid = request.request_id
        metadata = request.metadata

        def router(key: np.ndarray) -> SonaAdapter | None:
            if not self.config.clustered:
                return self._gate(rid, scope, snap, key, info)
            chosen = self._gate_clusters(rid, scope, key, info)
            if chosen is not None:  # the trajectory is recorded under the cluster's snapshot
                metadata[ADAPTER_METADATA_KEY] = chosen
            return chosen

        request.adapter_router = router

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

    def _keys_changed(self, slot: Slot) -> None:
        """Drop the router's table of ``slot``'s scope (its taught keys or its clusters changed)."""
        with self._lock:
            self._key_tables.pop(slot.cluster_of or slot.scope, None)

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

    @hookimpl
    def post_inference(self, request: InferenceRequest, result: InferenceResult) -> None:
        snap = request.metadata.get(ADAPTER_METADATA_KEY)
        if not isinstance(snap, SonaAdapter) or result.finish_reason == "abort" or not result.output_token_ids:
            return
        with self._lock:
            key = self._pending_keys.pop(request.request_id, None)
        traj = Trajectory(request.request_id, snap.scope, [int(t) for t in request.prompt_token_ids],
                          [int(t) for t in result.output_token_ids], snap, time.monotonic(), key=key)
        self.record(traj)

    def record(self, traj: Trajectory) -> None:
        """Hold a finished trajectory for feedback (post_inference does this for engine requests)."""
        with self._lock:
            self._trajectories[traj.request_id] = traj
            self._trajectories.move_to_end(traj.request_id)
            self._counters["trajectories"] += 1
            while len(self._trajectories) > self.config.max_trajectories:
                old, _ = self._trajectories.popitem(last=False)
                if old in self._feedback_waiting:
                    self._feedback_waiting.remove(old)
            if self.config.capture == "eager":
                self._capture_queue.append(traj.request_id)

    # -- feedback ---------------------------------------------------------------------------------
    def feedback(
        self, response_id: str, score: float, correction: str | Sequence[int] | None = None, *,
        api_key_id: str | None = None,
    ) -> FeedbackReceipt:
        """Rate a finished response (``score`` in [0, 1]) and optionally give the completion it
        should have been. Applies the instant step now when the trajectory is already captured.

        The feedback goes to the scope the response was generated under. ``api_key_id`` is the
        caller's authenticated key id: in ``api_key`` scope mode a response generated under another
        key (or none) is refused as unknown, so one key can neither teach nor probe another's adapter."""
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise FeedbackError(f"score must be a number in [0, 1], got {score!r}")
        if not 0.0 <= score <= 1.0:
            raise FeedbackError(f"score must be in [0, 1], got {score}")
        with self._lock:
            traj = self._trajectories.get(response_id)
        if (traj is not None and api_key_id is not None and self.config.scope == "api_key"
                and traj.scope != key_scope(api_key_id)):
            traj = None  # another key's response: answered exactly like an unknown one
        if traj is None:
            raise UnknownResponseError(f"no response {response_id!r} is held for feedback (unknown or expired)")
        correction_ids = self._correction_ids(correction) if correction is not None else None
        if self.config.clustered and correction_ids is not None:
            traj.scope = self._cluster_for(traj, correction_ids)
        slot = self._slot(traj.scope)
        with slot.lock:
            advantage = float(score) - slot.baseline
            d = self.config.baseline_decay
            slot.baseline = d * slot.baseline + (1.0 - d) * float(score)
            slot.feedback_count += 1
            slot.pending_quality += max(advantage, 0.0) + (self.config.correction_weight if correction_ids else 0.0)
            current = slot.snapshot
        with self._lock:
            self._counters["feedback"] += 1
            traj.score = float(score)
            self.bank.set_quality(response_id, float(score))
            if (correction_ids is not None or advantage > 0) and traj.key is not None:
                self._teach_key(slot, traj.key)
            if correction_ids is not None:
                self._counters["corrections"] += 1
                rid = f"{response_id}#correction{self._counters['corrections']}"
                fixed = Trajectory(rid, traj.scope, traj.prompt_ids, correction_ids, current, time.monotonic(),
                                   correction_of=response_id, pending_weight=self.config.correction_weight)
                self._trajectories[rid] = fixed
                self._feedback_waiting.append(rid)
                self._add_sample(fixed, self.config.correction_weight)
                return FeedbackReceipt(response_id, traj.scope, "queued", advantage, current.version)
            if advantage > 0:
                self._add_sample(traj, advantage)
            if traj.capture is None:
                traj.pending_weight = advantage
                if response_id not in self._feedback_waiting:
                    self._feedback_waiting.append(response_id)
                return FeedbackReceipt(response_id, traj.scope, "queued", advantage, current.version)
        version = self._apply_instant(traj, advantage)
        return FeedbackReceipt(response_id, traj.scope, "applied", advantage, version)

    def _teach_key(self, slot: Slot, key: np.ndarray) -> None:
        """Remember ``key`` as a prompt ``slot`` was taught with (the gate opens near it)."""
        with slot.lock:
            if any(np.array_equal(key, k) for k in slot.taught_keys):
                return
            slot.taught_keys.append(key)
            del slot.taught_keys[: max(0, len(slot.taught_keys) - self.config.gate_max_keys)]
        self._keys_changed(slot)

    def _correction_ids(self, correction: str | Sequence[int]) -> list[int]:
        if isinstance(correction, str):
            if not correction.strip():
                raise FeedbackError("correction must be non-empty text")
            if self._tokenizer is None:
                raise FeedbackError("this SONA instance has no tokenizer; send the correction as token ids")
            ids = list(self._tokenizer.encode(correction, add_special_tokens=False))
            eos = self.model_config.eos_token_ids or tuple(self._tokenizer.eos_token_ids)
            if eos:  # the corrected answer ends where the model should stop
                ids.append(int(eos[0]))
        else:
            ids = [int(t) for t in correction]
        if not ids:
            raise FeedbackError("correction encodes to no tokens")
        if any(not 0 <= t < self.model_config.vocab_size for t in ids):
            raise FeedbackError(f"correction token ids must be in 0..{self.model_config.vocab_size - 1}")
        return ids

    def _add_sample(self, traj: Trajectory, weight: float) -> None:
        cap = traj.capture
        self._samples[traj.scope].append(Sample(
            traj.request_id, traj.prompt_ids + traj.completion_ids, len(traj.prompt_ids), float(weight),
            cap.residual if cap is not None else None,
        ))

    def _apply_instant(self, traj: Trajectory, weight: float) -> int:
        """One instant step from a captured trajectory: ``weight`` per token (advantage or the
        correction weight), averaged over the completion's tokens. Returns the new version."""
        cap = traj.capture
        slot = self._slot(traj.scope)
        if cap is None or cap.instant is None or self.config.instant_lr == 0 or weight == 0:
            with slot.lock:
                return slot.version
        t0 = time.perf_counter()
        t_count = len(cap.rows)
        grads = instant_gradient(self.net, cap.instant, np.full(t_count, weight / t_count, np.float32),
                                 self.instant_keys)
        lr = np.float32(self.config.instant_lr)
        norm = float(np.linalg.norm(flat(grads, list(grads))))
        clip = np.float32(min(1.0, self.config.instant_max_norm / norm) if norm > 0 else 1.0)
        with slot.lock:
            for k, (da, db) in grads.items():
                a, b = slot.params[k]
                a += lr * clip * da
                b += lr * clip * db
            slot.instant_updates += 1
            version = slot.publish().version
        self._instant_times.append(time.perf_counter() - t0)
        with self._lock:
            self._counters["instant_updates"] += 1
            self._merge_dirty = True
        return version

    # -- background -------------------------------------------------------------------------------
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

    # -- deep loop --------------------------------------------------------------------------------
    def _maybe_start_deep(self) -> bool:
        trigger = self.config.deep_trigger
        if trigger <= 0 or (self._deep_thread is not None and self._deep_thread.is_alive()):
            return False
        with self._lock:
            ready = [s for s in self._slots.values() if s.pending_quality >= trigger and self._samples[s.scope]]
        if not ready:
            return False
        self.deep_train(max(ready, key=lambda s: s.pending_quality).scope)
        return True

    def deep_train(self, scope: str = GLOBAL_SCOPE, wait: bool = False, *, ewc: bool = True) -> DeepRunReport | None:
        """Start a deep run for ``scope`` in its own thread; with ``wait`` return its report.
        ``ewc=False`` trains without the EWC++ penalty (for comparisons)."""
        with self._lock:
            if self._deep_thread is not None and self._deep_thread.is_alive():
                if not wait:
                    return None
                running = self._deep_thread
            else:
                running = None
            if scope not in self._slots:
                raise SonaError(f"no adapter scope {scope!r}")
            if not self._samples[scope]:
                raise SonaError(f"scope {scope!r} has no stored samples (positive or corrected feedback) to train on")
        if running is not None:
            running.join()
            return self.deep_train(scope, wait, ewc=ewc)
        result: list[DeepRunReport] = []

        def run() -> None:
            try:
                result.append(self._deep_run(scope, ewc))
            except Exception as exc:  # reported in stats; serving goes on
                self._deep_error = f"{type(exc).__name__}: {exc}"
                log.warning("sona deep run failed", scope=scope, error=self._deep_error)

        thread = threading.Thread(target=run, name=f"sona-deep-{scope}", daemon=True)
        with self._lock:
            self._deep_thread = thread
        thread.start()
        if not wait:
            return None
        thread.join()
        if not result:
            raise SonaError(f"deep run failed: {self._deep_error}")
        return result[0]

    def _deep_run(self, scope: str, use_ewc: bool = True) -> DeepRunReport:
        c = self.config
        t_start = time.perf_counter()
        slot = self._slot(scope)
        with self._lock:
            samples = list(self._samples[scope])
        for s in samples:
            if s.residual is None:
                s.residual = self.net.prefix(s.token_ids, self.first_layer)
        with slot.lock:
            start = copy_params(slot.params)
            ewc = copy.deepcopy(slot.ewc) if use_ewc and slot.ewc.active else None
            slot.pending_quality = 0.0
        params, step, epoch_losses = fit_deep(self.net, self.keys, self.first_layer, samples, start, slot.scale, ewc,
                                              c, seed=(c.seed, self._counters["deep_runs"]))
        with slot.lock:
            # Keep what the instant loop learnt while this run trained.
            slot.params = {k: (params[k][0] + (slot.params[k][0] - start[k][0]),
                               params[k][1] + (slot.params[k][1] - start[k][1])) for k in self.keys}
            slot.deep_runs += 1
            version = slot.publish().version
        report = DeepRunReport(scope, len(samples), step, time.perf_counter() - t_start, epoch_losses[0],
                               epoch_losses[-1], version)
        with self._lock:
            self._counters["deep_runs"] += 1
            self._last_deep = report
            self._merge_dirty = True
        return report

    def consolidate(self, scope: str = GLOBAL_SCOPE) -> None:
        """Declare an EWC++ task boundary for ``scope`` now."""
        slot = self._slot(scope)
        with slot.lock:
            slot.ewc.consolidate(slot.params)
        with self._lock:
            self._counters["boundaries"] += 1

    # -- stats ------------------------------------------------------------------------------------
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

    # -- persistence ------------------------------------------------------------------------------
    def save(self, directory: str | Path | None = None) -> Path:
        """Write adapters (safetensors, one file per scope, with their EWC++ state), the bank
        (safetensors + JSON) and ``manifest.json`` (written last) to ``directory``."""
        target = Path(directory) if directory is not None else self.state_dir
        if target is None:
            raise SonaError("no state directory: pass one to save() or to Sona(state_dir=...)")
        target.mkdir(parents=True, exist_ok=True)
        with self._lock:
            slots = list(self._slots.values())
            self.bank.save(target)
            save_gate_center(target, self.gate_center)
        return save_state(target, slots, self.config, self.keys, self.model_config, self.net)

    def load(self, directory: str | Path) -> None:
        """Replace this instance's adapters and bank by those saved in ``directory``."""
        slots, bank = load_state(Path(directory), self.config, self.keys, self.model_config, self.net)
        center = load_gate_center(Path(directory), self.model_config.hidden_size)
        with self._lock:
            self._slots = slots
            for scope in slots:
                self._samples.setdefault(scope, deque(maxlen=self.config.deep_max_samples))
            self.bank = bank
            self.gate_center = center
            self._key_tables.clear()
        self._slot(GLOBAL_SCOPE)



__all__ = [
    "ADAPTER_METADATA_KEY",
    "GLOBAL_SCOPE",
    "STATE_FORMAT",
    "DeepRunReport",
    "FeedbackReceipt",
    "Sample",
    "Sona",
    "Trajectory",
    "key_scope",
    "low_rank_product",
]
