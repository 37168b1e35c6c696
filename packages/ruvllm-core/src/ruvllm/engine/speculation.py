"""The engine side of speculative decoding: which sequences draft and how much, the draft model, and
the verification of each draft chunk's logits.

:class:`Speculation` is composed by :class:`~ruvllm.engine.llm_engine.LLMEngine` when
``EngineConfig.speculative`` is set. Before a step is scheduled, :meth:`Speculation.propose` gives the
decoding sequences their drafts (``Sequence.draft``), which the scheduler runs as one chunk of
``k + 1`` positions; after the forward, :meth:`Speculation.verify` keeps the longest prefix the target
agrees with plus its own token, and gives the refused positions' blocks back. The proposers and the
verifier themselves live in :mod:`ruvllm.speculative`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ruvllm.backend import RewritesKVPositions, StepLimits
from ruvllm.engine.config import EngineConfig, EngineConfigError
from ruvllm.errors import BackendError
from ruvllm.speculative import DraftLength, NgramIndex, SpeculationStats, StepCosts, verify_draft
from ruvllm.speculative.draft import DraftProposer, DraftRequest, check_same_tokenizer, draft_vocabulary
from ruvllm.speculative.source import MODEL, NGRAM, DraftPassCosts, SequenceDrafting

#: What a draft model's pass costs, as a fraction of a target step, until one is measured (and for a
#: sampled request, whose drafts must not depend on the clock): the issue-56 pair's by bytes.
DRAFT_COST_PRIOR = 0.5

if TYPE_CHECKING:
    from ruvllm.engine.output_processor import OutputProcessor
    from ruvllm.engine.scheduler import ScheduledChunk, Scheduler
    from ruvllm.engine.sequence import Sequence
    from ruvllm.runtime import LoadedModel


class Speculation:
    """Drafting and verification for an engine over ``model`` (its ``cache``, ``scheduler`` and
    ``outputs``); the draft model's cache gets ``num_blocks`` blocks; ``draft_model``: the draft for
    ``speculative="draft"`` (None: loaded from ``config.draft_model``). Refuses, by name, a backend or
    cache that cannot run speculation."""

    def __init__(
        self,
        model: LoadedModel,
        cache: Any,
        config: EngineConfig,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        num_blocks: int,
        max_model_len: int,
        draft_model: LoadedModel | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.config = config
        self.scheduler = scheduler
        self.outputs = outputs
        self.max_model_len = max_model_len
        #: Drafted and accepted token counters.
        self.stats = SpeculationStats()
        #: Decode-only steps' measured milliseconds by row count, which price the drafts.
        self.costs = StepCosts(config.speculative_position_cost)
        #: The last step's decoding rows (0: not a decode-only step) and when it started.
        self._last_step: tuple[int, float] | None = None
        self._check()
        #: The draft model's proposer (``speculative="draft"`` or ``"ngram+draft"``).
        self.drafter: DraftProposer | None = None
        #: The draft model's measured milliseconds per pass (``ngram+draft`` prices its tokens by them).
        self.draft_costs = DraftPassCosts()
        if config.speculative in ("draft", "ngram+draft"):
            draft = draft_model if draft_model is not None else self._load_draft()
            check_same_tokenizer(draft, model)
            vocab = None
            if config.draft_vocab_size is not None:
                if draft is model or draft.model is model.model:
                    raise EngineConfigError(
                        "draft_vocab_size cuts the draft's output head: the draft must be loaded apart "
                        "from the target (not the target's own model object)"
                    )
                special = [*outputs.eos_token_ids, *draft.tokenizer.inner.get_added_tokens_decoder()]
                vocab = draft_vocabulary(draft.config.vocab_size, config.draft_vocab_size, special)
            # Catching up is one chunk per sequence, no longer than a step's (a precompiled shape).
            self.drafter = DraftProposer(
                draft,
                num_blocks=num_blocks,
                block_size=config.block_size,
                max_chunk=config.max_num_batched_tokens,
                vocab=vocab,
            )

    def _check(self) -> None:
        """Refuse speculative decoding, by name, on a backend that cannot run it: the verification
        needs every position's logits, and the refused positions' keys/values are dropped by writing
        them again later, which the backend's cache must allow."""
        name = self.model.backend.name
        if not self.model.capabilities.all_logits:
            raise EngineConfigError(
                f"backend {name!r} does not return every position's logits; speculative decoding needs them"
            )
        bm = self.model.model
        if not (isinstance(bm, RewritesKVPositions) and bm.kv_rewrites_positions(self.cache)):
            raise EngineConfigError(
                f"backend {name!r} cannot drop KV positions of this cache (kv_cache_options "
                f"{self.config.kv_cache_options or {}}); speculative decoding needs a cache that can"
            )

    def _load_draft(self) -> LoadedModel:
        """``config.draft_model`` on the target's backend (``same``: the target's checkpoint)."""
        from ruvllm.backend import LoadOptions
        from ruvllm.runtime import load_model

        ref = self.config.draft_model or ""
        if ref == "same":
            ref = str(self.model.checkpoint.path)
        options = LoadOptions(quantization=self.config.draft_quantization or "auto")
        return load_model(ref, backend=self.model.backend.name, options=options, host=self.model.host)

    def max_draft_tokens(self) -> int:
        """The most draft tokens one step carries (see :meth:`propose`)."""
        cfg = self.config
        return max(0, min(cfg.speculative_step_tokens - 1, cfg.max_num_seqs * cfg.num_speculative_tokens))

    def precompile_draft(
        self, progress: Callable[[int, int, str, float], None] | None = None
    ) -> list[tuple[str, float]]:
        """Have the draft's backend compile its steps (one token per sequence, and catching up);
        returns each shape with its seconds ([] without a draft model)."""
        if self.drafter is None:
            return []
        cfg = self.config
        limits = StepLimits(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )
        done = self.drafter.model.precompile(self.drafter.cache, limits, progress)
        return [(f"draft {name}", s) for name, s in done]

    @staticmethod
    def speculates(seq: Sequence) -> bool:
        """Whether ``seq`` may draft: not when its request opted out, nor for an X-LoRA request
        (its scaling pass runs in a shadow sequence of its own)."""
        st = seq.state
        return st.request.speculative and seq.shadow_id is None and (st.forked or st.sampling.n == 1)

    def propose(self) -> None:
        """Draft tokens for the decoding sequences, oldest first, while the step's decoding positions
        (``speculative_step_tokens``) last, then only as many as their expected gain pays for at this
        step's measured cost per row (:class:`~ruvllm.speculative.StepCosts`): a step of many
        sequences drafts less, then nothing. With ``ngram+draft`` each sequence drafts from the
        prompt lookup or the draft model, whichever yields more per cost
        (:class:`~ruvllm.speculative.source.SequenceDrafting`)."""
        cfg = self.config
        self._learn_last_step()
        decoding = [q for q in self.scheduler.running if len(q.token_ids) - q.num_computed == 1]
        room = cfg.speculative_step_tokens - len(decoding)
        wanted: list[tuple[Sequence, int]] = []
        model_drafts: set[Any] = set()  # the sequences the draft model drafts for
        for seq in sorted(decoding, key=self.scheduler.key):
            seq.draft, seq.draft_q = [], None
            if room <= 0 or not self.speculates(seq):
                continue
            spec = seq.speculation
            if spec is None:
                spec = seq.speculation = self._new_drafting()
            p = seq.state.sampling
            # Kept tokens plus the bonus one stay within max_tokens and the context.
            produced = len(seq.token_ids) - seq.num_prompt_tokens
            left = min(p.max_tokens - produced, self.max_model_len - len(seq.token_ids))
            cap = min(room, left - 1)
            if cap <= 0:
                continue
            if cfg.speculative == "ngram+draft":
                # A sampled request is priced by the priors: its draws must not depend on the clock.
                measured = p.greedy
                source, k, found = spec.choose(
                    seq.token_ids, cap, self._verify_cost(measured), self._draft_cost(measured)
                )
            elif cfg.speculative == "ngram":
                source, k = NGRAM, min(spec.ngram.want(), cap)
                spec.index.sync(seq.token_ids)
                found = spec.index.propose(k) if k > 0 else []
            else:
                source, k, found = MODEL, min(spec.model.want(), cap), []
            spec.source = source
            if source == NGRAM:
                seq.draft = found
                k = len(found)
            if k <= 0:
                continue
            if source == MODEL:
                model_drafts.add(seq.seq_id)
            wanted.append((seq, k))
            room -= k
        # What this load pays for (the n-gram drafts as found; the draft model's before it runs).
        offered = [k for _, k in wanted]
        rates = [q.speculation.length.rate for q, _ in wanted]
        # One decoding sequence: its step reads the weights whatever it verifies, so its drafts are
        # not priced here (and a seeded request alone drafts the same whatever the clock says).
        keep = offered if len(decoding) <= 1 else self.costs.allot(len(decoding), rates, offered)
        wanted = [(q, n) for (q, _), n in zip(wanted, keep, strict=True)]
        for seq, n in wanted:
            seq.draft = seq.draft[:n]
        wanted = [(q, n) for q, n in wanted if n > 0]
        by_model = [(q, n) for q, n in wanted if q.seq_id in model_drafts]
        if self.drafter is not None and by_model:
            live = {q.seq_id for q in self.scheduler.running}
            reqs = [DraftRequest(q.seq_id, q.token_ids, k, q.state.sampling, q.sampler.rng) for q, k in by_model]
            drafts = self.drafter.propose(reqs, live)
            for seq, _ in by_model:
                seq.draft, seq.draft_q = drafts.get(seq.seq_id, ([], None))
            for ms in self.drafter.pass_ms:
                self.draft_costs.observe(ms)
            self.drafter.pass_ms.clear()
        for seq, _ in wanted:
            constraint = seq.sampler.constraint
            if seq.draft and constraint is not None and not constraint.allowed()[seq.draft[0]]:
                seq.draft, seq.draft_q = [], None  # the grammar refuses it: cut at its first token
            if seq.draft:
                self.stats.count(seq.speculation.source, len(seq.draft))
        # A step of decoding rows only, unless a prompt may join it (then its time is not the rows').
        # Timed from here: the rows' cost, not the proposing's (a draft model's passes are its own).
        only_decode = bool(decoding) and len(decoding) == len(self.scheduler.running) and not self.scheduler.waiting
        rows = len(decoding) + sum(len(q.draft) for q in decoding)
        self._last_step = (rows if only_decode else 0, time.perf_counter())

    def _new_drafting(self) -> SequenceDrafting:
        cfg = self.config

        def length() -> DraftLength:
            return DraftLength(
                cfg.num_speculative_tokens,
                stop_below=cfg.speculative_min_acceptance,
                row_cost=cfg.speculative_position_cost,
            )

        source = MODEL if cfg.speculative == "draft" else NGRAM
        return SequenceDrafting(NgramIndex(cfg.ngram_n_min, cfg.ngram_n_max), length(), length(), source)

    def _verify_cost(self, measured: bool) -> Callable[[int], float]:
        """A one-sequence step verifying ``k`` draft tokens, in plain steps: measured where this
        engine ran such steps (:class:`~ruvllm.speculative.StepCosts`), else by the prior
        ``1 + speculative_position_cost * k``."""
        row = self.config.speculative_position_cost
        plain = self.costs.estimate(1) if measured else 0.0
        if plain <= 0:
            return lambda k: 1.0 + row * k
        return lambda k: max(1.0, self.costs.estimate(1 + k) / plain)

    def _draft_cost(self, measured: bool) -> float:
        """A draft model's pass, in target steps: measured, else :data:`DRAFT_COST_PRIOR`."""
        plain = self.costs.estimate(1) if measured else 0.0
        ms = self.draft_costs.ms()
        return ms / plain if plain > 0 and ms > 0 else DRAFT_COST_PRIOR

    def _learn_last_step(self) -> None:
        """The last step ran from the end of its :meth:`propose` to this one: what its rows cost, when
        it was a decode-only step (all of it, host work and verification included, is the rows')."""
        if self._last_step is None:
            return
        rows, started = self._last_step
        self._last_step = None
        if rows > 0:
            self.costs.observe(rows, 1000.0 * (time.perf_counter() - started))

    def verify(self, chunk: ScheduledChunk, rows: np.ndarray) -> None:
        """Keep the longest prefix of ``chunk``'s draft the target agrees with, plus its own next
        token; the refused positions' blocks go back (:meth:`Scheduler.accept_draft`)."""
        seq = chunk.seq
        if rows.ndim != 2 or len(rows) != len(chunk.draft) + 1:
            raise BackendError(f"the backend returned {rows.shape} logits for a draft of {len(chunk.draft)} tokens")
        if not np.isfinite(rows).all():
            raise FloatingPointError("the model produced non-finite logits for this sequence")
        accepted = 0
        q = seq.draft_q[: len(chunk.draft)] if seq.draft_q is not None else None
        seq.draft_q = None
        for sample, kept in verify_draft(seq.sampler, rows, chunk.draft, q):
            self.outputs.append_token(seq, sample)
            accepted += kept
            if seq.finished:
                break
        self.scheduler.accept_draft(seq, accepted)
        self.stats.drafted += len(chunk.draft)
        self.stats.accepted += accepted
        self.stats.verifications += 1
        if seq.speculation is not None:
            seq.speculation.observe(len(chunk.draft), accepted)
            self.stats.keep(seq.speculation.source, accepted)
