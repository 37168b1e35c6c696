"""Output processing: sampled tokens become text, finish reasons and :class:`RequestOutput` deltas.

Detokenization is incremental (one token at a time); stop strings are cut out of the text as they
appear (:class:`~ruvllm.engine.sequence.StopStringText`); log-probabilities are decoded into
:class:`TokenLogprob`; a finished request's result goes to the ``post_inference`` hook.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import structlog

from ruvllm.engine.scheduler import ScheduledChunk
from ruvllm.engine.sequence import RequestState, Sequence
from ruvllm.engine.types import ChoiceDelta, RequestOutput, TokenLogprob
from ruvllm.inference import ChoiceResult, InferenceResult
from ruvllm.sampling import SampleResult

if TYPE_CHECKING:
    from ruvllm.plugins import PluginHost
    from ruvllm.tokenizer import Tokenizer

log = structlog.get_logger("ruvllm.engine")


class OutputProcessor:
    """Turns a step's samples into each request's output; ``host`` is the plugin host whose
    ``post_inference`` hook sees every finished request."""

    def __init__(
        self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int, host: PluginHost
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.host = host

    def append_token(self, seq: Sequence, sample: SampleResult) -> None:
        """Add ``sample``'s token to ``seq``: its text, logprobs and whether it finishes the choice
        (eos, a stop token or string, a complete grammar, max_tokens or the context's end)."""
        p = seq.state.sampling
        token = sample.token_id
        seq.token_ids.append(token)
        seq.new_token_ids.append(token)
        if p.logprobs is not None:
            seq.new_logprobs.append(self.token_logprob(sample))
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

    def token_logprob(self, sample: SampleResult) -> TokenLogprob:
        decode = self.tokenizer.decode
        return TokenLogprob(
            token_id=sample.token_id,
            token=decode([sample.token_id]),
            logprob=sample.logprob,
            top=[(t, decode([t]), lp) for t, lp in sample.top_logprobs],
        )

    @staticmethod
    def wants_prompt_logprobs(c: ScheduledChunk) -> bool:
        st = c.seq.state
        return st.sampling.prompt_logprobs is not None and c.seq.index == 0 and c.start < c.seq.num_prompt_tokens

    def record_prompt_logprobs(self, c: ScheduledChunk, rows: np.ndarray) -> None:
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

    def output(self, st: RequestState, now: float, finished: bool) -> RequestOutput:
        """The request's delta since its last output (its choices' new tokens, text and finish)."""
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

    def finish_request(self, st: RequestState, finish_reason: str) -> None:
        """Hand the finished request's result to the ``post_inference`` hook."""
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
            self.host.hook.post_inference(request=st.inference, result=result)
        except Exception as exc:  # an observer's failure must not take the engine down
            log.warning("post_inference hook failed", request_id=st.request.request_id, error=repr(exc))
