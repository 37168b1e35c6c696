"""The synchronous, step-driven engine: add requests, call ``step()``, read outputs.

:class:`LLMEngine` composes one part per job: the KV plan (:mod:`~ruvllm.engine.kv_plan`) sizes the
cache, the scheduler picks each step's chunks, the step executor (:mod:`~ruvllm.engine.step_executor`)
runs them with failures isolated per request, the batch sampler picks the tokens and the output
processor (:mod:`~ruvllm.engine.output_processor`) turns them into text and outputs. X-LoRA's shadow
sequences are handled in :mod:`~ruvllm.engine.xlora`, adapter routers in :mod:`~ruvllm.engine.routing`,
speculative decoding's drafts and their verification in :mod:`~ruvllm.engine.speculation`, the
launch of a decoding step before the previous one's outputs are made in :mod:`~ruvllm.engine.pipeline`.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from ruvllm.adapters import XLoraAdapter
from ruvllm.backend import StepLimits
from ruvllm.block_manager import BlockManager, HybridBlockManager
from ruvllm.engine.config import DEFAULT_KV_RULE, EngineConfig, EngineConfigError
from ruvllm.engine.kv_plan import plan_kv_cache
from ruvllm.engine.output_processor import OutputProcessor
from ruvllm.engine.pipeline import DecodePipeline
from ruvllm.engine.routing import AdapterRouter
from ruvllm.engine.scheduler import ScheduledChunk, Scheduler
from ruvllm.engine.sequence import RequestState, Sequence
from ruvllm.engine.speculation import Speculation
from ruvllm.engine.step_budget import StepBudget
from ruvllm.engine.step_executor import DeviceRow, StepExecutor
from ruvllm.engine.types import ChoiceDelta, EngineStats, GenerationRequest, RequestMetrics, RequestOutput
from ruvllm.engine.xlora import with_shadow
from ruvllm.errors import BackendError, RequestError, RequestFailedError
from ruvllm.inference import InferenceRequest
from ruvllm.sampling import Sampler, SampleResult, SamplingParams, sample_batch
from ruvllm.sampling.batch import NON_FINITE
from ruvllm.speculative import SpeculationStats
from ruvllm.speculative.draft import DraftProposer

if TYPE_CHECKING:
    from ruvllm.runtime import LoadedModel
    from ruvllm.structured import GrammarCompiler
    from ruvllm.tokenizer import Tokenizer

log = structlog.get_logger("ruvllm.engine")

#: A request's picks from one step: its state, the sequences they go to and one pick (or error) each.
Drawn = tuple[RequestState, list[Sequence], list[SampleResult | Exception]]


class LLMEngine:
    """Continuous batching over one loaded model.

    ``add_request`` queues a request, ``step`` runs one forward pass over every scheduled sequence
    (prefill chunks and decodes together) and returns a :class:`RequestOutput` delta for each
    request that made progress. ``stream`` and ``generate`` drive ``step`` for you.
    """

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        draft_model: LoadedModel | None = None,
    ):
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
        plan = plan_kv_cache(model, config, self.max_model_len)
        self.block_bytes = plan.block_bytes
        #: A hybrid KV cache (windowed layers in a pool of their own, see HybridBlockManager) where
        #: the model interleaves windowed and global layers and the backend keeps such pools.
        self.hybrid = plan.hybrid
        self.num_blocks, self.local_blocks = plan.num_blocks, plan.local_blocks
        #: Bytes the KV cache holds.
        self.kv_cache_bytes = plan.kv_cache_bytes
        #: The budget its blocks were counted under (None: ``num_blocks`` was given).
        self.kv_budget_bytes = plan.budget_bytes
        if plan.default_budget:
            log.info(
                "kv cache sized by the default rule",
                rule=DEFAULT_KV_RULE,
                kv_cache_mib=round(plan.kv_cache_bytes / 2**20, 1),
                kv_tokens=plan.num_blocks * config.block_size,
                max_model_len=self.max_model_len,
            )
        self.block_manager: BlockManager | HybridBlockManager = plan.block_manager(config, mc)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.policy,
        )
        self.cache = model.allocate_cache(self.num_blocks, config.block_size, **plan.cache_options)
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
        self._requests: dict[str, RequestState] = {}
        self._order = itertools.count()
        #: Outputs of other requests produced while ``stream``/``generate`` drove the engine.
        self._undelivered: list[RequestOutput] = []
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len, model.host)
        self.router = AdapterRouter(self.scheduler)
        self.executor = StepExecutor(
            model,
            self.cache,
            self.block_manager,
            self.outputs,
            self.router,
            device_sampling=self.device_sampling,
            fail=self._fail,
            fail_all=self._fail_all,
        )
        #: Steps launched while the step before them runs (``EngineConfig.pipeline_decode``).
        self.pipeline = DecodePipeline(self)
        #: Steps that ran the model and their seconds (EngineStats.steps / step_seconds).
        self._steps = 0
        self._step_seconds = 0.0
        #: Speculative decoding's drafting and verification (None: ``config.speculative`` is off).
        self.speculator: Speculation | None = None
        if config.speculative is not None:
            self.speculator = Speculation(
                model,
                self.cache,
                config,
                self.scheduler,
                self.outputs,
                self.num_blocks,
                self.max_model_len,
                draft_model,
            )
        #: Speculative decoding's counters (drafted and accepted tokens).
        self.speculation: SpeculationStats = self.speculator.stats if self.speculator else SpeculationStats()
        #: The draft model's proposer (``speculative="draft"``).
        self.drafter: DraftProposer | None = self.speculator.drafter if self.speculator else None

    @property
    def broken(self) -> str | None:
        """Set when the forward keeps failing for one request after another: the engine is unusable."""
        return self.executor.broken

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
        needs = with_shadow(need if isinstance(need, tuple) else (need,), adapter)
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
        output = self.outputs.output(state, time.monotonic(), finished=True)
        # Choices never forked off still get their (empty) final delta.
        output.deltas.extend(ChoiceDelta(i, "", [], finish_reason="abort") for i in range(n_known, state.sampling.n))
        self.outputs.finish_request(state, "abort")
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
            spec_draft_tokens=self.speculation.drafted,
            spec_accepted_tokens=self.speculation.accepted,
            spec_verifications=self.speculation.verifications,
            steps=self._steps,
            step_seconds=self._step_seconds,
            forward_seconds=self.executor.forward_seconds,
            pipelined_steps=self.pipeline.steps,
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
            # Speculation's verification chunks return every position's logits.
            all_logits=(self.config.precompile_all_logits or self.config.speculative is not None)
            and self.model.capabilities.all_logits,
            draft_tokens=self.speculator.max_draft_tokens() if self.speculator else 0,
        )
        self.precompiled = self.model.precompile(self.cache, limits, progress)
        if self.speculator is not None:
            self.precompiled += self.speculator.precompile_draft(progress)
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
        started, forward = time.perf_counter(), self.executor.forward_seconds
        try:
            return self._run_step()
        finally:
            if self.executor.forward_seconds != forward:  # a step that ran the model
                self._steps += 1
                self._step_seconds += time.perf_counter() - started

    def _run_step(self) -> list[RequestOutput]:
        if self.pipeline.flight is not None:
            outputs = self.pipeline.advance()
            if outputs or self.pipeline.flight is not None:
                return outputs
            # (every row of the collected step was dropped: a step is scheduled as usual)
        budget = None
        if self.step_budget is not None:
            # A prompt budget only where some prompt has tokens left to compute: a step of decoding
            # sequences alone carries no prompt tokens whatever the budget.
            decoding, prompting = 0, bool(self.scheduler.waiting)
            for q in self.scheduler.running:
                if len(q.token_ids) - q.num_computed == 1:
                    decoding += 1
                else:
                    prompting = True
            if prompting:
                budget = self.step_budget.prefill_budget(decoding)
        if self.speculator is not None:
            self.speculator.propose()
        sched = self.scheduler.schedule(budget)
        self.pipeline.pay_owed_copies(sched)
        for c in sched.chunks:
            c.seq.draft = []  # the chunk holds what runs
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
        sampling = self.executor.sampling_rows(sched)
        if sampling is None and self.pipeline.launch(sched):
            return self.pipeline.advance()
        logits_of = self.executor.run(sched, sampling)
        if self.broken is not None:
            return []
        if self.step_budget is not None and len(logits_of) == len(sched.chunks):  # a clean step: learn its cost
            prompt = sum(c.num_tokens for c in sched.chunks if c.num_tokens > 1 and not c.draft)
            decoding = sum(1 for c in sched.chunks if c.num_tokens == 1 or c.draft)
            self.step_budget.observe(decoding, prompt, 1000 * (time.perf_counter() - t0))
        ran = sorted(logits_of.items())
        sched.chunks = [c for _, (c, _) in ran]  # what ran (failed requests are gone)
        self.scheduler.update_after_forward(sched)
        now = time.monotonic()
        return self._emit(self._sample([row for _, row in ran]), now)

    def _sample(self, ran: list[tuple[ScheduledChunk, np.ndarray | DeviceRow]]) -> list[RequestState]:
        """Sample the next token of every chunk in ``ran`` that completes its sequence and append it;
        returns the requests that progressed. All host rows are sampled in one batch (the choices of
        a fork share their row); an error stays with its request, which fails alone."""
        return self._commit(self._draw(ran))

    def _draw(self, ran: list[tuple[ScheduledChunk, np.ndarray | DeviceRow]]) -> list[Drawn]:
        """:meth:`_sample`'s first half: each request's picks (or its error), nothing appended yet
        (a verified draft is appended here: its request's entry has no targets)."""
        drawn: list[Drawn] = []
        sampled: list[tuple[RequestState, list[Sequence], Exception | None]] = []
        samplers: list[Sampler] = []
        rows: list[np.ndarray] = []
        on_device: dict[int, SampleResult] = {}
        for chunk, logits in ran:
            if not chunk.completes or self.router.route(chunk):
                continue
            seq, st = chunk.seq, chunk.seq.state
            if chunk.draft and self.speculator is not None:
                try:
                    self.speculator.verify(chunk, np.asarray(logits))
                except Exception as exc:  # tied to this request: it fails alone
                    drawn.append((st, [], [exc]))
                    continue
                drawn.append((st, [], []))
                continue
            if not st.forked and st.sampling.n > 1:
                targets = self._fork(seq)
            else:
                targets = [seq]
            error: Exception | None = None
            if isinstance(logits, DeviceRow):  # sampled in the step (one target: no fork there)
                if not logits.finite:
                    error = FloatingPointError(NON_FINITE)
                else:
                    try:
                        on_device[id(seq)] = seq.sampler.commit(logits.token, logits.logprob, logits.top)
                    except Exception as exc:  # its grammar refused the token: this request fails alone
                        error = exc
            else:  # (a row that is not all finite fails its request: sample_batch checks it)
                samplers += [s.sampler for s in targets]
                rows += [logits] * len(targets)
            sampled.append((st, targets, error))
        samples = iter(sample_batch(samplers, rows, return_exceptions=True, check_finite=True))
        for st, targets, error in sampled:
            picked: list[SampleResult | Exception]
            if error:
                picked = [error]
            elif id(targets[0]) in on_device:
                picked = [on_device[id(targets[0])]]
            else:
                picked = [next(samples) for _ in targets]
            drawn.append((st, targets, picked))
        return drawn

    def _commit(self, drawn: list[Drawn]) -> list[RequestState]:
        """:meth:`_sample`'s second half: append the picks; returns the requests that progressed."""
        progressed: dict[str, RequestState] = {}
        for st, targets, picked in drawn:
            rid = st.request.request_id
            try:
                if not targets and picked and isinstance(picked[0], Exception):  # a draft verification failed
                    raise picked[0]
                for s, sample in zip(targets, picked, strict=False):
                    if isinstance(sample, Exception):
                        raise sample
                    self.outputs.append_token(s, sample)
            except Exception as exc:  # tied to this request: it fails alone
                self._fail(rid, exc)
                progressed.pop(rid, None)
                continue
            progressed[rid] = st
        return list(progressed.values())

    def _emit(self, progressed: list[RequestState], now: float) -> list[RequestOutput]:
        """The outputs of the requests that progressed in this step (at ``now``); finished ones leave."""
        outputs = []
        for st in progressed:
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
            outputs.append(self.outputs.output(st, now, finished))
            if finished:
                del self._requests[st.request.request_id]
                self.outputs.finish_request(st, st.seqs[0].finish_reason or "stop")
        return outputs

    def _fail(self, rid: str, exc: BaseException) -> None:
        reason = str(exc) if isinstance(exc, (FloatingPointError, RequestError)) else f"{type(exc).__name__}: {exc}"
        log.error("request failed", request_id=rid, error=reason)
        self.abort(rid)
        self._failures.append(RequestFailedError(rid, reason))

    def _fail_all(self, reason: str) -> None:
        for rid in list(self._requests):
            self._fail(rid, RuntimeError(reason))

    def take_failures(self) -> list[RequestFailedError]:
        """Requests that failed alone since the last call (already removed, their blocks free)."""
        out, self._failures = self._failures, []
        return out

    def _full_group(self) -> BlockManager:
        bm = self.block_manager
        return bm.full if isinstance(bm, HybridBlockManager) else bm

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

    def __repr__(self) -> str:
        s = self.stats()
        blocks = f"{s.blocks_used}/{s.blocks_total}"
        return f"LLMEngine({self.model.name}, running={s.running}, waiting={s.waiting}, blocks={blocks})"
