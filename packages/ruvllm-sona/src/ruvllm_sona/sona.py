"""SONA: per-scope MicroLoRA adapters that learn from feedback on three time scales.

``Sona`` is the public learner: its lifecycle (the background thread, closing, saving and loading
state). Each of its jobs is a module beside it, one class each, put together here:

* ``state`` (``SonaState``): the shared state, the scopes' slots and the two locks.
* ``gate`` (``SonaGate``): per request (engine thread), the adapter its prompt runs under, and the
  clusters of a scope (where a correction teaches).
* ``intake`` (``SonaIntake``): pre_inference picks the request's scope and attaches that scope's
  current adapter snapshot; post_inference keeps the finished trajectory for a while; ``feedback``
  applies the instant loop at once when the trajectory is captured: the exact gradient of the
  advantage-weighted (or corrected) log-likelihood w.r.t. the last layer's attention factors,
  minus the EWC++ pull, one clipped step, a new snapshot.
* ``background`` (``SonaBackground``): the cycle the background thread runs every
  ``background_interval`` s: recompute trajectories (``capture``), feed the EWC++ Fisher estimate
  and task-boundary detector, fill and cluster the ReasoningBank, route new scopes to similar
  scopes' adapters, merge scope adapters, apply feedback that waited for a capture, start deep runs.
* ``deep_runs`` (``SonaDeepRuns``): the deep loop (its own thread) fine-tunes every adapted factor
  over the scope's stored samples with Adam and the EWC++ penalty (``deep.fit_deep``), then swaps
  the result in under the scope's lock.
* ``stats`` (``SonaStats``): what is reported.

Their parts: ``scopes``, ``capture``, ``deep``, ``bank``, ``persistence`` and ``records``.

Snapshots are immutable; publishing replaces a reference under a lock, so a request keeps the
adapter it started with whatever happens while it runs.
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from ruvllm.errors import RuvllmError
from ruvllm_sona.background import SonaBackground
from ruvllm_sona.config import SonaConfig
from ruvllm_sona.errors import SonaError
from ruvllm_sona.intake import ADAPTER_METADATA_KEY
from ruvllm_sona.model import LoraLlama
from ruvllm_sona.persistence import STATE_FORMAT, load_gate_center, load_state, save_gate_center, save_state
from ruvllm_sona.records import DeepRunReport, FeedbackReceipt, Sample, Trajectory
from ruvllm_sona.scopes import GLOBAL_SCOPE, key_scope, low_rank_product
from ruvllm_sona.stats import SonaStats

if TYPE_CHECKING:
    from ruvllm.checkpoint import Checkpoint
    from ruvllm.runtime import LoadedModel
    from ruvllm.tokenizer import Tokenizer

log = structlog.get_logger("ruvllm.sona")


class Sona(SonaBackground, SonaStats):
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
        super().__init__(checkpoint, config, tokenizer=tokenizer, state_dir=state_dir, net=net)
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
