"""The deep loop's runs: when a scope has earned one, the run in its own thread (one at a time),
and the swap of its result into the scope (training itself is ``ruvllm_sona.deep.fit_deep``)."""

from __future__ import annotations

import copy
import threading
import time

import structlog

from ruvllm_sona.deep import fit_deep
from ruvllm_sona.errors import SonaError
from ruvllm_sona.params import copy_params
from ruvllm_sona.records import DeepRunReport
from ruvllm_sona.scopes import GLOBAL_SCOPE
from ruvllm_sona.state import SonaState

log = structlog.get_logger("ruvllm.sona")


class SonaDeepRuns(SonaState):
    """Deep runs over a scope's stored samples and explicit EWC++ task boundaries."""

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
