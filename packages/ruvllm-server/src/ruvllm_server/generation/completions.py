"""``/v1/completions``: a request's prompts (times ``n``) turned into one run, and the run's outputs
into a completion or its stream, with ``echo``, legacy ``logprobs`` and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ruvllm.engine.types import TokenLogprob
from ruvllm_server.errors import bad_request
from ruvllm_server.generation.logprobs import completion_logprobs, echoed_prompt_logprobs, prompt_logprobs_vllm
from ruvllm_server.generation.requests import build_sampling, check_model, completion_prompts, engine_request
from ruvllm_server.generation.run import ChoiceAccumulator, Run
from ruvllm_server.generation.sse import SSE_DONE, TextEvent, error_event, sse
from ruvllm_server.schemas import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest

if TYPE_CHECKING:
    from ruvllm_server.state import ServerState

#: Most choices (prompts x n) per completions request.
MAX_CHOICES = 256
#: OpenAI's default ``max_tokens`` of /v1/completions.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass
class CompletionJob:
    state: ServerState
    req: CompletionRequest
    #: The authenticating API key's non-secret id (``middleware.key_id``); None without API keys.
    api_key_id: str | None
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    prompts_text: list[str] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)

    def prepare(self) -> Run:
        req = self.req
        adapter = check_model(self.state, req.model)
        if req.suffix:
            raise bad_request("suffix is not supported by this server", param="suffix")
        n = req.n or 1
        if req.best_of is not None and req.best_of != n:
            raise bad_request("best_of other than n is not supported", param="best_of")
        prompts = completion_prompts(self.state, req.prompt)
        if len(prompts) * n > MAX_CHOICES:
            raise bad_request(f"prompts x n must be at most {MAX_CHOICES}, got {len(prompts) * n}", param="prompt")
        if req.echo:
            self.prompts_text = [self.state.tokenizer.decode(p) for p in prompts]
        self.prompts = prompts
        echo_lp = bool(req.echo) and req.logprobs is not None
        want_prompt = req.prompt_logprobs is not None or echo_lp
        if want_prompt and req.stream:
            raise bad_request(
                "prompt log-probabilities (prompt_logprobs, or echo with logprobs) are not streamed; "
                "send the request with stream false",
                param="prompt_logprobs" if req.prompt_logprobs is not None else "echo",
            )
        requests = []
        for i, ids in enumerate(prompts):
            params = build_sampling(
                self.state,
                req,
                max_tokens=req.max_tokens,
                default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
                prompt_len=len(ids),
                logprobs=req.logprobs,
            )
            if want_prompt:
                params.prompt_logprobs = max(req.prompt_logprobs or 0, req.logprobs if echo_lp else 0)
            rid = self.id if len(prompts) == 1 else f"{self.id}-{i}"
            requests.append(engine_request(ids, params, rid, req.user, self.api_key_id, adapter, req.speculative))
        return Run(self.state, requests)

    def _index(self, run: Run, prompt_index: int, choice_index: int) -> int:
        return prompt_index * run.requests[0].sampling.n + choice_index

    def _echo(self, prompt_index: int) -> str:
        return self.prompts_text[prompt_index] if self.req.echo else ""

    async def complete(self, run: Run) -> Completion:
        n = run.requests[0].sampling.n
        acc: dict[int, ChoiceAccumulator] = {i: ChoiceAccumulator() for i in range(len(run.requests) * n)}
        prompt_lp: dict[int, list[TokenLogprob | None]] = {}
        async for p, out in run.outputs():
            if out.prompt_logprobs is not None:
                prompt_lp[p] = out.prompt_logprobs
            for d in out.deltas:
                a = acc[self._index(run, p, d.index)]
                a.text.append(d.text)
                if d.logprobs:
                    a.logprobs.extend(d.logprobs)
                if d.finish_reason:
                    a.finish_reason = d.finish_reason
        choices = []
        for i, a in sorted(acc.items()):
            echo = self._echo(i // n)
            lp = (
                completion_logprobs(a.logprobs, len(echo), self.req.logprobs) if self.req.logprobs is not None else None
            )
            entries = prompt_lp.get(i // n)
            if lp is not None and self.req.echo and entries is not None:
                head = echoed_prompt_logprobs(self.prompts[i // n], entries, self.req.logprobs or 0,
                                              self.state.tokenizer.decode)  # fmt: skip
                lp = CompletionLogprobs(
                    head.tokens + lp.tokens,
                    head.token_logprobs + lp.token_logprobs,
                    head.top_logprobs + lp.top_logprobs,
                    head.text_offset + lp.text_offset,
                )
            plp = prompt_logprobs_vllm(entries) if self.req.prompt_logprobs is not None and entries else None
            choices.append(CompletionChoice(i, echo + "".join(a.text), lp, a.finish_reason, plp))
        return Completion(self.id, self.created, self.state.model_name, choices, usage=run.usage())

    def _chunk(self, choice: CompletionChoice) -> bytes:
        """The chunk of one choice: a chunk carries exactly one, as OpenAI's do (clients read only
        ``choices[0]``); the choices of outputs that came together are several chunks of one write."""
        return sse(Completion(self.id, self.created, self.state.model_name, [choice]))

    def _text_event(self, index: int) -> TextEvent:
        """The chunk of choice ``index`` that carries only text (most tokens' chunk)."""
        return TextEvent(
            lambda text: Completion(
                self.id, self.created, self.state.model_name, [CompletionChoice(index, text, None, None)]
            )
        )

    async def stream(self, run: Run) -> AsyncIterator[bytes]:
        n = run.requests[0].sampling.n
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        offsets: dict[int, int] = {}
        want_logprobs = self.req.logprobs is not None
        text_events: dict[int, TextEvent] = {}
        # Outputs that arrived together go out as one write; the last ones wait for the usage
        # chunk and [DONE], which follow at once, so a request's end is one write too.
        tail = b""
        try:
            if self.req.echo:
                indexes = range(len(run.requests) * n)
                yield b"".join(self._chunk(CompletionChoice(i, self._echo(i // n), None, None)) for i in indexes)
            async for batch in run.output_batches():
                events: list[bytes] = []
                for p, out in batch:
                    for d in out.deltas:
                        i = self._index(run, p, d.index)
                        if d.text and d.finish_reason is None and not (want_logprobs and d.logprobs):
                            event = text_events.get(i)
                            if event is None:
                                event = text_events[i] = self._text_event(i)
                            events.append(event(d.text))
                            continue
                        if not d.text and not d.finish_reason and not (want_logprobs and d.logprobs):
                            continue
                        lp = None
                        if self.req.logprobs is not None and d.logprobs:
                            start = offsets.get(i, len(self._echo(p)))
                            lp = completion_logprobs(d.logprobs, start, self.req.logprobs)
                            offsets[i] = start + sum(len(e.token) for e in d.logprobs)
                        events.append(self._chunk(CompletionChoice(i, d.text, lp, d.finish_reason)))
                if run.done:
                    tail = b"".join(events)
                elif events:
                    yield b"".join(events)
            if include_usage:
                tail += sse(Completion(self.id, self.created, self.state.model_name, [], usage=run.usage()))
        except Exception as exc:  # the status line is sent: errors go into the stream
            if tail:
                yield tail
            tail = error_event(exc)
        yield tail + SSE_DONE
