"""The SONA learner's state: the model it differentiates, its scopes' slots, the queues and
counters every job shares, and the two locks (the instance's, then one per scope, never the other
way round). The jobs are classes built on this one (``gate``, ``intake``, ``background``,
``deep_runs``, ``stats``); ``ruvllm_sona.sona.Sona`` puts them together."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ruvllm_sona.bank import ReasoningBank
from ruvllm_sona.capture import INSTANT_PROJECTIONS
from ruvllm_sona.config import SonaConfig
from ruvllm_sona.errors import SonaError
from ruvllm_sona.lora import SonaAdapter
from ruvllm_sona.model import LoraLlama
from ruvllm_sona.params import Key, Params, copy_params
from ruvllm_sona.records import DeepRunReport, Sample, Trajectory
from ruvllm_sona.scopes import GLOBAL_SCOPE, GateCenter, KeyTable, Slot, fresh_params, new_ewc, scope_of

if TYPE_CHECKING:
    from ruvllm.checkpoint import Checkpoint
    from ruvllm.inference import InferenceRequest
    from ruvllm.tokenizer import Tokenizer


class SonaState:
    """What every part of the learner reads and writes; built once per loaded model."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        config: SonaConfig | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        state_dir: str | Path | None = None,
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

    def _keys_changed(self, slot: Slot) -> None:
        """Drop the router's table of ``slot``'s scope (its taught keys or its clusters changed)."""
        with self._lock:
            self._key_tables.pop(slot.cluster_of or slot.scope, None)
