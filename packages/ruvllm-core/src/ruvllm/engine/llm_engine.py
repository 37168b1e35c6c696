"""The synchronous, step-driven engine: add requests, call ``step()``, read outputs."""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from ruvllm.adapters import AdapterMix, XLoraAdapter
from ruvllm.backend import DeviceSampling, ForwardBatch, SequenceChunk, StepLimits
from ruvllm.block_manager import BlockManager, HybridBlockManager
from ruvllm.engine.config import EngineConfig, EngineConfigError, default_hybrid_blocks, default_num_blocks
from ruvllm.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from ruvllm.engine.sequence import RequestState, Sequence
from ruvllm.engine.step_budget import StepBudget
from ruvllm.engine.types import (
    ChoiceDelta,
    EngineStats,
    GenerationRequest,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from ruvllm.errors import BackendError, RequestError, RequestFailedError
from ruvllm.inference import ChoiceResult, InferenceRequest, InferenceResult
from ruvllm.sampling import Sampler, SampleResult, SamplingParams, device_sampling, sample_batch

if TYPE_CHECKING:
    from ruvllm.runtime import LoadedModel
    from ruvllm.structured import GrammarCompiler
    from ruvllm.tokenizer import Tokenizer

log = structlog.get_logger("ruvllm.engine")


def _table(ids: list[int]) -> np.ndarray:
    """A block table for the backend: blocks released out of a sliding window read as block 0
    (never unmasked)."""
    return np.maximum(np.asarray(ids, dtype=np.int32), 0)


class LLMEngine:
    """Continuous batching over one loaded model.

    ``add_request`` queues a request, ``step`` runs one forward pass over every scheduled sequence
    (prefill chunks and decodes together) and returns a :class:`RequestOutput` delta for each
    request that made progress. ``stream`` and ``generate`` drive ``step`` for you.
    """

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, *, tokenizer: Tokenizer | None = None):
        self.model = model
        self.config = config = config or EngineConfig()
        config.validate()
        mc = model.config
        caps = model.capabilities
        if caps.max_batch is not None and config.max_num_seqs > caps.max_batch:
            raise BackendError(
                f"max_num_seqs {config.max_num_seqs} exceeds the {caps.max_batch} sequences backend "
                f"{model.backend.name!r} runs in one step; set max_num_seqs to at most {caps.max_batch}"
            )
        if config.sampling == "device" and not caps.device_sampling:
            raise EngineConfigError(f"backend {model.backend.name!r} cannot sample on its device; use sampling='host'")
        #: Steps sample on the backend's device (see ``EngineConfig.sampling``).
        self.device_sampling = config.sampling == "device" or (
            config.sampling == "auto" and caps.device_sampling and caps.prefers_device_sampling
        )
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.block_bytes = model.kv_block_bytes(config.block_size, **config.kv_cache_options)
        #: A hybrid KV cache (windowed layers in a pool of their own, see HybridBlockManager) where
        #: the model interleaves windowed and global layers and the backend keeps such pools.
        self.hybrid = bool(mc.hybrid_window) and caps.hybrid_kv
        self.local_blocks = 0
        cache_options = dict(config.kv_cache_options)
        # What the cache holds besides its blocks (a two-tier cache's float slots) comes off the budget.
        reserved, extra = model.kv_reserve(config.block_size, config.max_num_seqs, **config.kv_cache_options)
        cache_options.update(extra)
        sizing = config
        if reserved:
            if config.num_blocks is None and reserved >= config.kv_cache_memory_bytes:
                raise EngineConfigError(
                    f"kv_cache_memory_bytes {config.kv_cache_memory_bytes} does not cover the KV cache's "
                    f"fixed part ({reserved} bytes for {config.max_num_seqs} sequences: {extra}); "
                    "give more memory or fewer sequences"
                )
            sizing = replace(config, kv_cache_memory_bytes=config.kv_cache_memory_bytes - reserved)
        if self.hybrid:
            self.num_blocks, self.local_blocks = default_hybrid_blocks(mc, sizing, self.max_model_len, self.block_bytes)
            self.block_manager: BlockManager | HybridBlockManager = HybridBlockManager(
                self.num_blocks,
                self.local_blocks,
                config.block_size,
                mc.hybrid_window,
                enable_prefix_caching=config.enable_prefix_caching,
                eviction=config.eviction,
            )
            cache_options["local_blocks"] = self.local_blocks
            per_layer = self.block_bytes / mc.num_layers
            local_layers = len(mc.local_layers)
            #: Bytes the KV cache holds.
            self.kv_cache_bytes = reserved + int(
                per_layer * ((mc.num_layers - local_layers) * self.num_blocks + local_layers * self.local_blocks)
            )
        else:
            self.num_blocks = config.num_blocks or default_num_blocks(mc, sizing, self.max_model_len, self.block_bytes)
            self.block_manager = BlockManager(
                self.num_blocks,
                config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                eviction=config.eviction,
                sliding_window=mc.uniform_window,
            )
            self.kv_cache_bytes = reserved + self.num_blocks * self.block_bytes
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.policy,
        )
        self.cache = model.allocate_cache(self.num_blocks, config.block_size, **cache_options)
        #: Prompt tokens per step under ``max_step_ms`` (None: only ``max_num_batched_tokens`` bounds them).
        self.step_budget = (
            StepBudget(config.max_step_ms, config.max_num_batched_tokens, config.max_step_ratio)
            if config.max_step_ms is not None or config.max_step_ratio is not None
            else None
        )
        #: Step shapes the backend compiled in :meth:`precompile`, with their seconds.
        self.precompiled: list[tuple[str, float]] = []
        self.tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        self.eos_token_ids = tuple(sorted(set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        self._grammar_compiler: GrammarCompiler | None = None
        #: Requests that failed alone in the last steps (their streams get the error), taken by
        #: :meth:`take_failures`.
        self._failures: list[RequestFailedError] = []
        #: Set when the forward keeps failing for one request after another: the engine is unusable.
        self.broken: str | None = None
        self._failed_steps = 0
        self._requests: dict[str, RequestState] = {}
        self._order = itertools.count()
        #: Outputs of other requests produced while ``stream``/``generate`` drove the engine.
        self._undelivered: list[RequestOutput] = []
        #: Last-prompt-token hidden states awaiting their request's adapter router, by sequence id.
        self._route_hidden: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------------------------ requests

    def add_request(self, request: GenerationRequest) -> None:
        """Queue ``request``. Raises :class:`RequestError` for invalid or oversized requests."""
        rid = request.request_id
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already running")
        inference = InferenceRequest(
            request_id=rid,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=copy.deepcopy(request.sampling),
            prompt=request.prompt,
            user=request.user,
            metadata=dict(request.metadata),
            adapter=request.adapter,
            model=self.model,
        )
        # Plugins see only requests that pass every check; what they change is checked again.
        self._check(inference.prompt_token_ids, inference.sampling, inference.adapter)
        self.model.host.hook.pre_inference(request=inference)
        prompt = [int(t) for t in inference.prompt_token_ids]
        sampling = inference.sampling
        self._check(prompt, sampling, inference.adapter)
        caps = self.model.capabilities
        if inference.adapter is not None and not caps.adapters:
            raise RequestError(f"backend {self.model.backend.name!r} does not apply adapters (LoRA)")
        if isinstance(inference.adapter, XLoraAdapter) and not (caps.adapter_mix and caps.hidden_states):
            raise RequestError(f"backend {self.model.backend.name!r} does not run X-LoRA (adapter mixes)")
        if inference.adapter_router is not None and not (caps.adapters and caps.hidden_states):
            inference.adapter_router = None  # nothing it could pick would run; the base model serves it
        state = RequestState(
            request=request,
            inference=inference,
            sampling=sampling,
            prompt_token_ids=prompt,
            order=next(self._order),
            metrics=RequestMetrics(prompt_tokens=len(prompt)),
        )
        state.seqs.append(self._new_sequence(state, 0))
        self._requests[rid] = state
        self.scheduler.add(state.seqs[0])

    def _check(self, prompt: list[int], sampling: SamplingParams, adapter: Any = None) -> None:
        """Raise :class:`RequestError` for a prompt or sampling parameters this engine cannot run
        (an X-LoRA ``adapter`` needs twice the blocks: its shadow sequence's too)."""
        vocab = self.model.config.vocab_size
        if not prompt:
            raise RequestError("the prompt is empty")
        bad = next((t for t in prompt if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
        sampling.validate(vocab)
        if sampling.structured is not None:
            self.grammar_compiler().grammar(sampling.structured)  # compiled once, cached; bad -> 400
        if sampling.n > self.config.max_num_seqs:
            raise RequestError(
                f"n ({sampling.n}) exceeds the {self.config.max_num_seqs} sequences this engine runs at once"
            )
        if len(prompt) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt)} tokens; the model context is {self.max_model_len}")
        if len(prompt) + sampling.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model "
                f"context of {self.max_model_len} tokens"
            )
        need = self.block_manager.peak_blocks(len(prompt) + sampling.max_tokens, self.config.max_num_batched_tokens)
        needs = need if isinstance(need, tuple) else (need,)
        if isinstance(adapter, XLoraAdapter):
            needs = tuple(2 * n for n in needs)
        for want, have, what in zip(needs, (self.num_blocks, self.local_blocks), ("", " windowed-layer"), strict=False):
            if want > have:
                raise RequestError(
                    f"the request needs {want}{what} KV blocks but the cache has {have}; "
                    "lower max_tokens or give the engine more KV blocks"
                )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop ``request_id`` now and free its blocks. Returns its final output (finish reason
        ``abort``), or None when no such request is running."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        for seq in state.seqs:
            if not seq.finished:
                self.scheduler.remove(seq)
                seq.finish_reason = "abort"
        n_known = len(state.seqs)
        output = self._output(state, time.monotonic(), finished=True)
        # Choices never forked off still get their (empty) final delta.
        output.deltas.extend(ChoiceDelta(i, "", [], finish_reason="abort") for i in range(n_known, state.sampling.n))
        self._finish_request(state, "abort")
        return output

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._requests)

    def stats(self) -> EngineStats:
        """Engine-wide figures; ``running``/``waiting`` count sequences (choices), ``*_requests``
        requests."""
        running_states = {id(q.state): q.state for q in self.scheduler.running}
        waiting_states = {id(q.state): q.state for q in self.scheduler.waiting if id(q.state) not in running_states}

        def names(states: Iterable[RequestState]) -> tuple[str, ...]:
            found = (getattr(st.adapter, "name", None) for st in states if st.adapter is not None)
            return tuple(sorted({n for n in found if isinstance(n, str) and n}))

        return EngineStats(
            running_requests=len(running_states),
            waiting_requests=len(waiting_states),
            block_size=self.block_manager.block_size,
            running_adapters=names(running_states.values()),
            waiting_adapters=names(waiting_states.values()),
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            blocks_used=self._full_group().num_used_blocks,
            blocks_total=self.num_blocks,
            local_blocks_used=self.block_manager.local.num_used_blocks if self.hybrid else 0,
            local_blocks_total=self.local_blocks,
            preemptions=self.scheduler.preemptions,
            prefix_cache_hit_tokens=self.scheduler.prefix_cache_hit_tokens,
            prefix_cache_queried_tokens=self.scheduler.prefix_cache_queried_tokens,
        )

    def precompile(self, progress: Callable[[int, int, str, float], None] | None = None) -> list[tuple[str, float]]:
        """Have the backend compile every step shape this engine's steps can take (before traffic,
        so none compiles while serving); returns each shape with its seconds ([] for a backend that
        compiles nothing)."""
        adapters = self.model.adapter_limits if self.model.capabilities.adapters else None
        limits = StepLimits(
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            # X-LoRA's scaling passes return hidden states.
            hidden_states="hidden_states" in self.model.step_needs or bool(adapters and adapters.mixes),
            adapters=adapters,
            device_sampling=self.device_sampling,
            all_logits=self.config.precompile_all_logits and self.model.capabilities.all_logits,
        )
        self.precompiled = self.model.precompile(self.cache, limits, progress)
        return self.precompiled

    # ---------------------------------------------------------------------------------- steps

    def step(self) -> list[RequestOutput]:
        """Run one forward step; returns the outputs of requests that made progress."""
        outputs, self._undelivered = self._undelivered, []
        return outputs + self._step()

    def stream(self, request: GenerationRequest) -> Iterator[RequestOutput]:
        """Add ``request`` and yield its outputs as steps produce them. Closing the iterator early
        aborts the request. Other requests keep running; their outputs come from the next ``step``."""
        self.add_request(request)
        rid = request.request_id
        done = False
        try:
            while rid in self._requests:
                outputs = self._step()
                for failure in self.take_failures():
                    if failure.request_id == rid:
                        done = True
                        raise failure
                for out in outputs:
                    if out.request_id != rid:
                        self._undelivered.append(out)
                        continue
                    yield out
                    if out.finished:
                        done = True
                        return
        finally:
            if not done:
                self.abort(rid)

    def generate(self, requests: Iterable[GenerationRequest]) -> list[list[RequestOutput]]:
        """Run ``requests`` to completion together; returns each one's outputs in order."""
        requests = list(requests)
        added: list[str] = []
        try:
            for r in requests:
                self.add_request(r)
                added.append(r.request_id)
        except Exception:
            for rid in added:
                self.abort(rid)
            raise
        collected: dict[str, list[RequestOutput]] = {rid: [] for rid in added}
        pending = set(added)
        while pending:
            outputs = self._step()
            for failure in self.take_failures():
                if failure.request_id in pending:
                    for rid in pending:
                        self.abort(rid)
                    raise failure
            for out in outputs:
                if out.request_id in collected:
                    collected[out.request_id].append(out)
                    if out.finished:
                        pending.discard(out.request_id)
                else:
                    self._undelivered.append(out)
        return [collected[rid] for rid in added]

    def _step(self) -> list[RequestOutput]:
        budget = None
        if self.step_budget is not None:
            decoding = sum(1 for q in self.scheduler.running if len(q.token_ids) - q.num_computed == 1)
            budget = self.step_budget.prefill_budget(decoding)
        sched = self.scheduler.schedule(budget)
        if not sched.chunks:
            if self._requests:
                # Cannot happen for requests that passed add_request's checks.
                raise RuntimeError(
                    f"the scheduler made no progress with {len(self.scheduler.waiting)} waiting sequences"
                )
            return []
        now = time.monotonic()
        for seq in sched.admitted:
            st = seq.state
            if st.first_scheduled is None:
                st.first_scheduled = now
                st.metrics.queue_time = now - st.request.arrival_time
                st.metrics.cached_tokens = seq.num_cached_tokens or 0
        t0 = time.perf_counter()
        sampling = self._device_sampling(sched)
        logits_of = self._forward_isolating(sched, sampling)
        if self.broken is not None:
            return []
        if self.step_budget is not None and len(logits_of) == len(sched.chunks):  # a clean step: learn its cost
            prompt = sum(c.num_tokens for c in sched.chunks if c.num_tokens > 1)
            decoding = sum(1 for c in sched.chunks if c.num_tokens == 1)
            self.step_budget.observe(decoding, prompt, 1000 * (time.perf_counter() - t0))
        sched.chunks = [c for _, (c, _) in sorted(logits_of.items())]  # what ran (failed requests are gone)
        self.scheduler.update_after_forward(sched)
        now = time.monotonic()
        progressed: dict[str, RequestState] = {}
        # All rows of the step are sampled in one batch (the choices of a fork share their row); an
        # error stays with its request.
        sampled: list[tuple[RequestState, list[Sequence], Exception | None]] = []
        samplers: list[Sampler] = []
        rows: list[np.ndarray] = []
        on_device: dict[int, SampleResult] = {}
        for _, (chunk, logits) in sorted(logits_of.items()):
            if not chunk.completes or self._route(chunk):
                continue
            seq, st = chunk.seq, chunk.seq.state
            if not st.forked and st.sampling.n > 1:
                targets = self._fork(seq)
            else:
                targets = [seq]
            error: Exception | None = None
            if isinstance(logits, _DeviceRow):  # sampled in the step (one target: no fork there)
                if not logits.finite:
                    error = FloatingPointError("the model produced non-finite logits for this sequence")
                else:
                    try:
                        on_device[id(seq)] = seq.sampler.commit(logits.token, logits.logprob, logits.top)
                    except Exception as exc:  # its grammar refused the token: this request fails alone
                        error = exc
            elif not np.isfinite(logits).all():
                error = FloatingPointError("the model produced non-finite logits for this sequence")
            else:
                samplers += [s.sampler for s in targets]
                rows += [logits] * len(targets)
            sampled.append((st, targets, error))
        samples = iter(sample_batch(samplers, rows, return_exceptions=True))
        for st, targets, error in sampled:
            rid = st.request.request_id
            picked: list[SampleResult | Exception]
            if error:
                picked = [error]
            elif id(targets[0]) in on_device:
                picked = [on_device[id(targets[0])]]
            else:
                picked = [next(samples) for _ in targets]
            try:
                for s, sample in zip(targets, picked, strict=False):
                    if isinstance(sample, Exception):
                        raise sample
                    self._append_token(s, sample)
            except Exception as exc:  # tied to this request: it fails alone
                self._fail(rid, exc)
                progressed.pop(rid, None)
                continue
            progressed[rid] = st
        outputs = []
        for st in progressed.values():
            m = st.metrics
            if st.last_token_time is None:
                m.ttft = now - st.request.arrival_time
            else:
                m.inter_token_latencies.append(now - st.last_token_time)
            st.last_token_time = now
            for s in st.seqs:
                if s.finished and s in self.scheduler.running:
                    self.scheduler.remove(s)
            finished = st.finished
            outputs.append(self._output(st, now, finished))
            if finished:
                del self._requests[st.request.request_id]
                self._finish_request(st, st.seqs[0].finish_reason or "stop")
        return outputs

    def _fail(self, rid: str, exc: BaseException) -> None:
        reason = str(exc) if isinstance(exc, (FloatingPointError, RequestError)) else f"{type(exc).__name__}: {exc}"
        log.error("request failed", request_id=rid, error=reason)
        self.abort(rid)
        self._failures.append(RequestFailedError(rid, reason))

    def take_failures(self) -> list[RequestFailedError]:
        """Requests that failed alone since the last call (already removed, their blocks free)."""
        out, self._failures = self._failures, []
        return out

    def _device_sampling(self, sched: SchedulerOutput) -> DeviceSampling | None:
        """The step's device-sampling rows, when this engine samples on the device and no chunk
        needs its logits on the host (a request that forks into its ``n`` choices draws them all
        from one row; a prompt whose end an adapter router reads may run again)."""
        if not self.device_sampling:
            return None
        samplers: list[Sampler | None] = []
        for c in sched.chunks:
            st = c.seq.state
            if c.completes and (self._wants_route(c) or (not st.forked and st.sampling.n > 1)):
                return None
            samplers.append(c.seq.sampler if c.completes else None)
        try:
            return device_sampling(samplers, self.model.config.vocab_size)
        except Exception as exc:  # a row's grammar failed: the host sampler fails that request alone
            log.warning("device sampling rows failed; sampling this step on the host", error=repr(exc))
            return None

    def _forward_isolating(
        self, sched: SchedulerOutput, sampling: DeviceSampling | None = None
    ) -> dict[int, tuple[ScheduledChunk, np.ndarray | _DeviceRow]]:
        """Run the step; returns chunk index -> (chunk, its logits row, or what device ``sampling``
        picked for it) for the chunks that ran (and records the prompt logprobs of chunks that
        compute them).

        A step-wide backend error is not blamed on every request in it: the chunks are split in halves
        and each half runs again (a transient error is thus retried once), down to single requests, so
        an error tied to one sequence fails that request alone. Cache positions a failed attempt wrote
        are rewritten by the retry. Requests that fail alone with nothing running in between count
        against the engine; three in a row mark it broken (:attr:`broken`) and fail every request."""
        out: dict[int, tuple[ScheduledChunk, np.ndarray | _DeviceRow]] = {}
        errors: list[Exception] = []

        copied = False  # the step's copy-on-write copies ran (in a pass that succeeded)

        def attempt(indices: list[int]) -> None:
            nonlocal copied
            part = SchedulerOutput(chunks=[sched.chunks[i] for i in indices])
            if not copied:
                part.block_copies, part.local_block_copies = sched.block_copies, sched.local_block_copies
            try:
                mixes = self._scaling_pass(part)  # X-LoRA requests' first pass (it takes the copies)
                if mixes:
                    copied = True
                    part.block_copies, part.local_block_copies = [], []
                batch = self._batch(part, mixes)
                if sampling is not None:
                    batch.sampling = sampling if len(indices) == len(sched.chunks) else sampling.rows(indices)
                result = self.model.forward(batch, self.cache)
                copied = True
                if sampling is not None and result.sampled is None:
                    raise BackendError("the backend returned no device-sampled tokens for a step that asked")
            except Exception as exc:
                errors.append(exc)
                log.warning("engine step failed; retrying in parts", error=repr(exc), chunks=len(indices))
                rids = {sched.chunks[i].seq.state.request.request_id for i in indices}
                if len(rids) == 1:
                    self._fail(next(iter(rids)), exc)
                    return
                # Halves along request boundaries (an n > 1 request's chunks stay together).
                order = list(dict.fromkeys(sched.chunks[i].seq.state.request.request_id for i in indices))
                first = set(order[: len(order) // 2])
                attempt([i for i in indices if sched.chunks[i].seq.state.request.request_id in first])
                attempt([i for i in indices if sched.chunks[i].seq.state.request.request_id not in first])
                return
            got = result.sampled
            for row, i in enumerate(indices):
                if got is not None:
                    k = min(sched.chunks[i].seq.state.sampling.logprobs or 0, got.top_ids.shape[1])
                    ids, lps = got.top_ids[row, :k].tolist(), got.top_logprobs[row, :k].tolist()
                    top = list(zip(ids, lps, strict=True))
                    out[i] = (
                        sched.chunks[i],
                        _DeviceRow(int(got.tokens[row]), float(got.logprobs[row]), top, bool(got.finite[row])),
                    )
                else:
                    out[i] = (sched.chunks[i], np.asarray(result.logits[row]))
                rows = result.all_logits.get(row)
                if rows is not None and self._wants_prompt_logprobs(sched.chunks[i]):
                    self._record_prompt_logprobs(sched.chunks[i], np.asarray(rows))
                hidden = result.hidden_states.get(row)
                if hidden is not None and self._wants_route(sched.chunks[i]):
                    self._route_hidden[sched.chunks[i].seq.seq_id] = np.asarray(hidden[-1], np.float32)

        attempt(list(range(len(sched.chunks))))
        if out:
            self._failed_steps = 0
        elif errors:
            self._failed_steps += len({sched.chunks[i].seq.state.request.request_id for i in range(len(sched.chunks))})
            if self._failed_steps >= 3:
                last = errors[-1]
                self.broken = (
                    f"forward failed for 3 requests in a row, none ran; last error: {type(last).__name__}: {last}"
                )
                log.error("engine broken", reason=self.broken)
                for rid in list(self._requests):
                    self._fail(rid, RuntimeError(self.broken))
        return out

    def _full_group(self) -> BlockManager:
        bm = self.block_manager
        return bm.full if isinstance(bm, HybridBlockManager) else bm

    def _scaling_pass(self, part: SchedulerOutput) -> dict[int, AdapterMix]:
        """X-LoRA's first pass: the shadow sequences of the X-LoRA chunks of ``part`` run the same
        tokens with the scaling pass's adapters (every expert weighted ``scaling_pass_value``) into
        their own blocks; the classifier turns their final hidden states into each token's expert
        weights. Returns chunk index (in ``part``) -> the real pass's :class:`AdapterMix`."""
        rows = [i for i, c in enumerate(part.chunks) if c.seq.shadow_id is not None]
        if not rows:
            return {}
        bm = self.block_manager
        hybrid = isinstance(bm, HybridBlockManager)
        chunks = []
        for i in rows:
            c = part.chunks[i]
            xl = c.seq.state.adapter
            chunks.append(
                SequenceChunk(
                    token_ids=np.asarray(c.token_ids, dtype=np.int32),
                    start_pos=c.start,
                    block_table=_table(bm.block_table(c.seq.shadow_id)),
                    adapter=xl.scaling_pass(c.num_tokens),
                    hidden_states=True,
                    local_block_table=_table(bm.local_block_table(c.seq.shadow_id)) if hybrid else None,
                )
            )
        batch = ForwardBatch(
            chunks=chunks,
            block_size=bm.block_size,
            block_copies=part.block_copies,
            local_block_copies=part.local_block_copies,
        )
        result = self.model.forward(batch, self.cache)
        mixes = {}
        for row, i in enumerate(rows):
            hidden = result.hidden_states.get(row)
            if hidden is None:
                raise BackendError("the backend returned no hidden states for an X-LoRA scaling pass")
            mixes[i] = part.chunks[i].seq.state.adapter.mix(np.asarray(hidden, np.float32))
        return mixes

    def _batch(self, sched: SchedulerOutput, mixes: dict[int, AdapterMix] | None = None) -> ForwardBatch:
        bm = self.block_manager
        hybrid = isinstance(bm, HybridBlockManager)
        mixes = mixes or {}

        chunks = [
            SequenceChunk(
                token_ids=np.asarray(c.token_ids, dtype=np.int32),
                start_pos=c.start,
                block_table=_table(bm.block_table(c.seq.seq_id)),
                adapter=mixes.get(i, c.seq.state.adapter),
                all_logits=self._wants_prompt_logprobs(c),
                hidden_states=self._wants_route(c),
                local_block_table=_table(bm.local_block_table(c.seq.seq_id)) if hybrid else None,
            )
            for i, c in enumerate(sched.chunks)
        ]
        return ForwardBatch(
            chunks=chunks,
            block_size=bm.block_size,
            block_copies=sched.block_copies,
            local_block_copies=sched.local_block_copies,
        )

    @staticmethod
    def _wants_route(c: ScheduledChunk) -> bool:
        """The chunk that ends the prompt of a request whose adapter a router picks."""
        st = c.seq.state
        return (
            st.inference.adapter_router is not None
            and st.inference.adapter is None
            and not st.routed
            and c.seq.index == 0
            and c.completes
            and c.start + c.num_tokens == c.seq.num_prompt_tokens
        )

    def _route(self, chunk: ScheduledChunk) -> bool:
        """Ask the request's router; True when it picked an adapter and the prompt must run again."""
        st = chunk.seq.state
        hidden = self._route_hidden.pop(chunk.seq.seq_id, None)
        if hidden is None or st.routed:
            return False
        st.routed = True
        try:
            adapter = st.inference.adapter_router(hidden)
        except Exception as exc:  # a plugin's failure leaves the request on the base model
            log.warning("adapter router failed", request_id=st.request.request_id, error=repr(exc))
            return False
        if adapter is None:
            return False
        st.inference.adapter = adapter
        self.scheduler.recompute(chunk.seq)
        return True

    @staticmethod
    def _wants_prompt_logprobs(c: ScheduledChunk) -> bool:
        st = c.seq.state
        return st.sampling.prompt_logprobs is not None and c.seq.index == 0 and c.start < c.seq.num_prompt_tokens

    def _record_prompt_logprobs(self, c: ScheduledChunk, rows: np.ndarray) -> None:
        """Row j of a chunk's logits (position ``start + j``) scores the prompt token at the next
        position: its log-probability under the model's raw logits, its rank, the top alternatives."""
        st = c.seq.state
        prompt, top = st.prompt_token_ids, int(st.sampling.prompt_logprobs or 0)
        if st.prompt_logprobs is None:
            st.prompt_logprobs = [None] * len(prompt)
        decode = self.tokenizer.decode
        x = rows.astype(np.float64)
        lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
        for j in range(len(x)):
            q = c.start + j + 1
            if q >= len(prompt):
                break
            t = int(prompt[q])
            lp = x[j] - lse[j]
            best = np.argpartition(-lp, top)[:top] if 0 < top < len(lp) else np.arange(len(lp) if top else 0)
            best = best[np.argsort(-lp[best], kind="stable")]
            st.prompt_logprobs[q] = TokenLogprob(
                token_id=t,
                token=decode([t]),
                logprob=float(lp[t]),
                top=[(int(k), decode([int(k)]), float(lp[k])) for k in best],
                rank=1 + int(np.count_nonzero(lp > lp[t])),
            )

    # --------------------------------------------------------------------------- sequences

    def _new_sequence(self, state: RequestState, index: int) -> Sequence:
        from ruvllm.tokenizer import IncrementalDetokenizer

        spec = state.sampling.structured
        constraint = self.grammar_compiler().constraint(spec) if spec is not None else None
        sampler = Sampler(
            state.sampling, state.prompt_token_ids, self.eos_token_ids, choice_index=index, constraint=constraint
        )
        detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=state.sampling.skip_special_tokens)
        return Sequence(state, index, sampler, detokenizer)

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler of this engine's tokenizer (built on first use, ~1 s)."""
        if self._grammar_compiler is None:
            from ruvllm.structured import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)
        return self._grammar_compiler

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The prompt of an ``n > 1`` request is computed once; its choices then share its blocks."""
        st = parent.state
        for index in range(1, st.sampling.n):
            child = self._new_sequence(st, index)
            st.seqs.append(child)
            self.scheduler.fork(parent, child)
        st.forked = True
        return list(st.seqs)

    def _append_token(self, seq: Sequence, sample: SampleResult) -> None:
        p = seq.state.sampling
        token = sample.token_id
        seq.token_ids.append(token)
        seq.new_token_ids.append(token)
        if p.logprobs is not None:
            seq.new_logprobs.append(self._token_logprob(sample))
        produced = len(seq.token_ids) - seq.num_prompt_tokens
        may_stop = produced >= p.min_tokens
        if token in self.eos_token_ids and not p.ignore_eos and may_stop:
            seq.finish_reason = "stop"
        elif token in p.stop_token_ids and may_stop:
            seq.finish_reason, seq.stop_reason = "stop", token
        else:
            text, stop = seq.text.feed(seq.detokenizer.push(token), may_stop)
            seq.emit_text(text)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
        constraint = seq.sampler.constraint
        if seq.finish_reason is None and constraint is not None and constraint.finished:
            seq.finish_reason = "stop"  # the grammar is complete and allows nothing more
        if seq.finish_reason is None and (produced >= p.max_tokens or len(seq.token_ids) >= self.max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            text, stop = seq.text.finish(seq.detokenizer.flush(), may_stop)
            seq.emit_text(text)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop

    def _token_logprob(self, sample: SampleResult) -> TokenLogprob:
        decode = self.tokenizer.decode
        return TokenLogprob(
            token_id=sample.token_id,
            token=decode([sample.token_id]),
            logprob=sample.logprob,
            top=[(t, decode([t]), lp) for t, lp in sample.top_logprobs],
        )

    # ------------------------------------------------------------------------------ outputs

    def _output(self, st: RequestState, now: float, finished: bool) -> RequestOutput:
        deltas = []
        for s in st.seqs:
            report_finish = s.finished and not s.finish_reported
            if not (s.new_token_ids or s.new_text or report_finish):
                continue
            deltas.append(
                ChoiceDelta(
                    index=s.index,
                    text=s.new_text,
                    token_ids=s.new_token_ids,
                    logprobs=s.new_logprobs if st.sampling.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
            s.new_token_ids, s.new_text, s.new_logprobs = [], "", []
            s.finish_reported = s.finished
        m = st.metrics
        m.completion_tokens = sum(len(s.token_ids) - s.num_prompt_tokens for s in st.seqs)
        if finished:
            m.e2e = now - st.request.arrival_time
        metrics = replace(m, inter_token_latencies=list(m.inter_token_latencies))
        prompt_logprobs = None
        if st.sampling.prompt_logprobs is not None and not st.prompt_logprobs_sent:
            # Reached only once a token was sampled, so the whole prompt has run.
            prompt_logprobs = st.prompt_logprobs or [None] * len(st.prompt_token_ids)
            st.prompt_logprobs_sent = True
        return RequestOutput(st.request.request_id, deltas, finished, metrics, prompt_logprobs)

    def _finish_request(self, st: RequestState, finish_reason: str) -> None:
        first = st.seqs[0]
        m = st.metrics
        result = InferenceResult(
            request_id=st.request.request_id,
            output_token_ids=list(first.output_token_ids),
            text=first.output_text,
            finish_reason=finish_reason,
            prompt_tokens=m.prompt_tokens,
            cached_tokens=m.cached_tokens,
            queue_time=m.queue_time,
            ttft=m.ttft,
            e2e=m.e2e,
            choices=[
                ChoiceResult(s.index, list(s.output_token_ids), s.output_text, s.finish_reason or finish_reason)
                for s in sorted(st.seqs, key=lambda q: q.index)
            ],
        )
        try:
            self.model.host.hook.post_inference(request=st.inference, result=result)
        except Exception as exc:  # an observer's failure must not take the engine down
            log.warning("post_inference hook failed", request_id=st.request.request_id, error=repr(exc))

    def __repr__(self) -> str:
        s = self.stats()
        blocks = f"{s.blocks_used}/{s.blocks_total}"
        return f"LLMEngine({self.model.name}, running={s.running}, waiting={s.waiting}, blocks={blocks})"


@dataclass(slots=True)
class _DeviceRow:
    """What device sampling picked for one chunk."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    finite: bool
