"""What comes in: the hooks (a request's snapshot and router before, its trajectory after), the
held trajectories, feedback and the instant loop's step."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ruvllm.hookspecs import hookimpl
from ruvllm_sona.capture import instant_gradient
from ruvllm_sona.errors import FeedbackError, UnknownResponseError
from ruvllm_sona.gate import SonaGate
from ruvllm_sona.lora import SonaAdapter
from ruvllm_sona.params import flat
from ruvllm_sona.records import FeedbackReceipt, Sample, Trajectory
from ruvllm_sona.scopes import Slot, key_scope

if TYPE_CHECKING:
    from ruvllm.inference import InferenceRequest, InferenceResult

#: Key under which pre_inference leaves the snapshot in ``InferenceRequest.metadata``.
ADAPTER_METADATA_KEY = "sona.adapter"


class SonaIntake(SonaGate):
    """The engine's hooks and the feedback API, with the instant step applied at once when it can."""

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
