"""The step executor: runs one scheduled step on the backend so that one bad request never takes the
others down.

A step-wide backend error is not blamed on every request in it: the chunks are split in halves along
request boundaries and each half runs again (a transient error is thus retried once), down to single
requests, so an error tied to one sequence fails that request alone. Requests that fail alone with
nothing running in between count against the engine; three in a row mark it broken.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from ruvllm.backend import DeviceSampling, ForwardOutput, PreparedStep
from ruvllm.block_manager import BlockManager, HybridBlockManager
from ruvllm.engine.batch import forward_batch
from ruvllm.engine.output_processor import OutputProcessor
from ruvllm.engine.routing import AdapterRouter
from ruvllm.engine.scheduler import ScheduledChunk, SchedulerOutput
from ruvllm.engine.xlora import scaling_pass
from ruvllm.errors import BackendError
from ruvllm.sampling import Sampler, device_sampling
from ruvllm.sampling.selection import unlocked

if TYPE_CHECKING:
    from ruvllm.runtime import LoadedModel

log = structlog.get_logger("ruvllm.engine")

#: Requests in a row that fail alone, none running in between, before the engine counts as broken.
BROKEN_AFTER = 3


@dataclass(slots=True)
class DeviceRow:
    """What device sampling picked for one chunk."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    finite: bool


#: Chunk index -> (chunk, its logits row or what device sampling picked for it), for the chunks that ran.
StepRows = dict[int, tuple[ScheduledChunk, "np.ndarray | DeviceRow"]]


def _never(_: ScheduledChunk) -> bool:
    return False


@dataclass(slots=True)
class InFlight:
    """A step launched on the backend and not yet collected (:meth:`StepExecutor.launch`)."""

    sched: SchedulerOutput
    wait: Callable[[], ForwardOutput]
    #: ``time.perf_counter()`` when it was launched.
    started: float


class StepExecutor:
    """Runs scheduled steps of ``model`` over ``cache``. ``fail(request_id, error)`` removes a request
    that failed alone; ``fail_all(reason)`` every request, once the engine is broken."""

    def __init__(
        self,
        model: LoadedModel,
        cache: Any,
        block_manager: BlockManager | HybridBlockManager,
        outputs: OutputProcessor,
        router: AdapterRouter,
        *,
        device_sampling: bool,
        fail: Callable[[str, BaseException], None],
        fail_all: Callable[[str], None],
    ) -> None:
        self.model = model
        self.cache = cache
        self.block_manager = block_manager
        self.outputs = outputs
        self.router = router
        self.device_sampling = device_sampling
        self._fail = fail
        self._fail_all = fail_all
        #: Set when the forward keeps failing for one request after another: the engine is unusable.
        self.broken: str | None = None
        self._failed_steps = 0
        #: Seconds spent in the model's forward, all steps together.
        self.forward_seconds = 0.0

    def sampling_rows(self, sched: SchedulerOutput) -> DeviceSampling | None:
        """The step's device-sampling rows, when this engine samples on the device and no chunk
        needs its logits on the host (a request that forks into its ``n`` choices draws them all
        from one row; a prompt whose end an adapter router reads may run again)."""
        if not self.device_sampling:
            return None
        samplers: list[Sampler | None] = []
        for c in sched.chunks:
            st = c.seq.state
            if c.draft:  # a draft is verified on the host, from every position's logits
                return None
            if c.completes and (self.router.wants(c) or (not st.forked and st.sampling.n > 1)):
                return None
            samplers.append(c.seq.sampler if c.completes else None)
        try:
            return device_sampling(samplers, self.model.config.vocab_size)
        except Exception as exc:  # a row's grammar failed: the host sampler fails that request alone
            log.warning("device sampling rows failed; sampling this step on the host", error=repr(exc))
            return None

    def prepare(self, sched: SchedulerOutput) -> PreparedStep | None:
        """``sched`` (decoding chunks whose tokens the running step is about to sample) prepared to
        launch (see :class:`ruvllm.backend.PreparesSteps`); None where the backend runs it through
        ``forward`` only, or could not prepare it (the step then runs as every step does)."""
        batch = forward_batch(sched, self.block_manager, {}, _never, _never, tokens_pending=True)
        try:
            return self.model.prepare_step(batch, self.cache)
        except Exception as exc:
            log.warning("preparing the next step failed; it runs as usual", error=repr(exc))
            return None

    def launch(self, sched: SchedulerOutput, prepared: PreparedStep, tokens: np.ndarray) -> InFlight | None:
        """Start ``prepared`` with ``tokens``; None when it could not start (run ``sched`` then)."""
        started = time.perf_counter()
        try:
            wait = prepared.launch(tokens)
        except Exception as exc:
            self.forward_seconds += time.perf_counter() - started
            log.warning("launching a prepared step failed; it runs as usual", error=repr(exc))
            return None
        return InFlight(sched, wait, started)

    def collect(self, flight: InFlight, live: list[int]) -> list[tuple[ScheduledChunk, np.ndarray | DeviceRow]]:
        """The rows of a launched step's chunks at indices ``live`` (the others' rows are dropped),
        once it is done. Should it fail, those chunks run again through :meth:`run` (a failure then
        stays with its request)."""
        chunks = flight.sched.chunks
        try:
            result = flight.wait()
        except Exception as exc:
            log.warning("a launched step failed; running it again", error=repr(exc), chunks=len(live))
            if not live:
                return []
            return [row for _, row in sorted(self.run(SchedulerOutput(chunks=[chunks[i] for i in live])).items())]
        finally:
            # Launch to logits: the step's time, the host's work meanwhile (it ran beside the step) included.
            self.forward_seconds += time.perf_counter() - flight.started
        logits = unlocked(result.logits) if isinstance(result.logits, np.ndarray) else result.logits
        self._failed_steps = 0
        return [(chunks[i], np.asarray(logits[i])) for i in live]

    def _all_logits(self, c: ScheduledChunk) -> bool:
        """A chunk returns every position's logits for its prompt's logprobs or to verify its draft."""
        return bool(c.draft) or self.outputs.wants_prompt_logprobs(c)

    def run(self, sched: SchedulerOutput, sampling: DeviceSampling | None = None) -> StepRows:
        """Run the step; returns the rows of the chunks that ran (and records the prompt logprobs
        of chunks that compute them, and the hidden states an adapter router reads).

        Cache positions a failed attempt wrote are rewritten by the retry. When
        :data:`BROKEN_AFTER` requests in a row failed alone, :attr:`broken` is set and every request
        fails."""
        out: StepRows = {}
        errors: list[Exception] = []
        copied = False  # the step's copy-on-write copies ran (in a pass that succeeded)
        chunks = sched.chunks

        def attempt(indices: list[int]) -> None:
            nonlocal copied
            part = SchedulerOutput(chunks=[chunks[i] for i in indices])
            if not copied:
                part.block_copies, part.local_block_copies = sched.block_copies, sched.local_block_copies
            try:
                # X-LoRA requests' first pass (it takes the copies)
                mixes = scaling_pass(self.model, self.cache, self.block_manager, part)
                if mixes:
                    copied = True
                    part.block_copies, part.local_block_copies = [], []
                batch = forward_batch(part, self.block_manager, mixes, self._all_logits, self.router.wants)
                if sampling is not None:
                    batch.sampling = sampling if len(indices) == len(chunks) else sampling.rows(indices)
                started = time.perf_counter()
                try:
                    result = self.model.forward(batch, self.cache)
                finally:
                    self.forward_seconds += time.perf_counter() - started
                copied = True
                if sampling is not None and result.sampled is None:
                    raise BackendError("the backend returned no device-sampled tokens for a step that asked")
            except Exception as exc:
                errors.append(exc)
                log.warning("engine step failed; retrying in parts", error=repr(exc), chunks=len(indices))
                rids = {chunks[i].seq.state.request.request_id for i in indices}
                if len(rids) == 1:
                    self._fail(next(iter(rids)), exc)
                    return
                # Halves along request boundaries (an n > 1 request's chunks stay together).
                order = list(dict.fromkeys(chunks[i].seq.state.request.request_id for i in indices))
                first = set(order[: len(order) // 2])
                attempt([i for i in indices if chunks[i].seq.state.request.request_id in first])
                attempt([i for i in indices if chunks[i].seq.state.request.request_id not in first])
                return
            got = result.sampled
            logits = result.logits
            if got is None and isinstance(logits, np.ndarray):
                # The step's logits as the sampler reads them: NumPy copies a read-only array (jax's
                # host arrays are) before each argmax; the rows are the step's own, never written.
                logits = unlocked(logits)
            for row, i in enumerate(indices):
                c = chunks[i]
                if got is not None:
                    k = min(c.seq.state.sampling.logprobs or 0, got.top_ids.shape[1])
                    ids, lps = got.top_ids[row, :k].tolist(), got.top_logprobs[row, :k].tolist()
                    top = list(zip(ids, lps, strict=True))
                    out[i] = (c, DeviceRow(int(got.tokens[row]), float(got.logprobs[row]), top, bool(got.finite[row])))
                else:
                    out[i] = (c, np.asarray(logits[row]))
                rows = result.all_logits.get(row)
                if c.draft:  # (rows the backend left out fail the request when it is verified)
                    out[i] = (c, np.asarray(rows) if rows is not None else np.empty((0, 0), np.float32))
                if rows is not None and self.outputs.wants_prompt_logprobs(c):
                    self.outputs.record_prompt_logprobs(c, np.asarray(rows))
                hidden = result.hidden_states.get(row)
                if hidden is not None and self.router.wants(c):
                    self.router.hold(c, hidden)

        attempt(list(range(len(chunks))))
        if out:
            self._failed_steps = 0
        elif errors:
            self._failed_steps += len({c.seq.state.request.request_id for c in chunks})
            if self._failed_steps >= BROKEN_AFTER:
                last = errors[-1]
                self.broken = (
                    f"forward failed for {BROKEN_AFTER} requests in a row, none ran; "
                    f"last error: {type(last).__name__}: {last}"
                )
                log.error("engine broken", reason=self.broken)
                self._fail_all(self.broken)
        return out
