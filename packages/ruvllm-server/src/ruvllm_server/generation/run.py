"""Running the engine requests of one HTTP request: their outputs as one interleaved stream (n > 1
and several prompts are several engine requests), what has not finished aborted when the consumer
leaves, usage summed over them; and a handler's work cancelled when its client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from ruvllm.engine import EngineDeadError
from ruvllm.engine.types import ChoiceDelta, GenerationRequest, RequestMetrics, RequestOutput, TokenLogprob
from ruvllm_server.schemas import PromptTokensDetails, Usage

if TYPE_CHECKING:
    from ruvllm_server.state import ServerState

log = structlog.get_logger("ruvllm.server")


@dataclass
class ChoiceAccumulator:
    """One choice's deltas gathered for a response that is not streamed."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Run:
    """The engine requests of one HTTP request, consumed as one interleaved stream."""

    state: ServerState
    requests: list[GenerationRequest]
    finished: set[int] = field(default_factory=set)
    last: dict[int, RequestOutput] = field(default_factory=dict)

    async def compile_constraint(self) -> None:
        """Compile the run's structured-output constraint (a schema, a grammar, a forced call's
        arguments) now, as the engine would when the request is added. A stream's status line and
        first chunk go out before that, so a constraint llguidance rejects would reach a streaming
        client as an error chunk; compiled here it is a 400 naming the field. The compiler caches by
        text, so the engine does not compile it again."""
        specs = {r.sampling.structured for r in self.requests if r.sampling.structured is not None}
        engine = self.state.engine
        for spec in specs:
            if engine is not None:
                # Off the event loop: the first grammar of a tokenizer takes about a second.
                await asyncio.to_thread(engine.engine.grammar_compiler().grammar, spec)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(index of the engine request, output)`` as they arrive. Leaving early (client gone,
        error, cancellation) aborts what has not finished."""
        async for batch in self.output_batches():
            for item in batch:
                yield item

    async def output_batches(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """As :meth:`outputs`, every output that arrived while the caller was busy in one list (a
        stream writes them at once)."""
        engine = self.state.engine
        assert engine is not None
        try:
            if len(self.requests) == 1:
                async for outs in engine.generate_batches(self.requests[0]):
                    yield [self._note(0, out) for out in outs]
            else:
                async for batch in self._merged():
                    yield [self._note(*item) for item in batch]
        finally:
            await self._abort_unfinished()

    @property
    def done(self) -> bool:
        """Every engine request has finished (its final output was read)."""
        return len(self.finished) == len(self.requests)

    def _note(self, i: int, out: RequestOutput) -> tuple[int, RequestOutput]:
        self.last[i] = out
        if out.finished:
            self.finished.add(i)
            adapter = getattr(self.requests[i].adapter, "name", None) if self.requests[i].adapter is not None else None
            self.state.metrics.observe_request(
                out.metrics, [d.finish_reason for d in out.deltas if d.finish_reason], adapter
            )
        return i, out

    async def _merged(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        engine = self.state.engine
        assert engine is not None
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(i: int, req: GenerationRequest) -> None:
            try:
                async for outs in engine.generate_batches(req):
                    for out in outs:
                        queue.put_nowait((i, out))
                queue.put_nowait(None)
            except Exception as exc:  # handed to the consumer, which re-raises it
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.requests)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                batch = []
                while True:
                    if item is None:
                        remaining -= 1
                    elif isinstance(item, BaseException):
                        if batch:  # what came before the failure is delivered first
                            yield batch
                        raise item
                    else:
                        batch.append(item)
                    if queue.empty():
                        break
                    item = queue.get_nowait()
                if batch:
                    yield batch
        finally:
            for t in tasks:
                t.cancel()

    async def _abort_unfinished(self) -> None:
        engine = self.state.engine
        pending = [i for i in range(len(self.requests)) if i not in self.finished]
        if not pending or engine is None:
            return
        # Shielded: this runs while the surrounding scope is being cancelled (client disconnect).
        with anyio.CancelScope(shield=True):
            for i, r in enumerate(self.requests):
                if i in self.finished:
                    continue
                final = None
                with contextlib.suppress(EngineDeadError):
                    final = await engine.abort(r.request_id)
                if final is None:
                    # It had finished (or never started) in the engine; the client left before the
                    # last output was read. Counted once all the same, as the client saw it.
                    seen = self.last.get(i)
                    metrics = (
                        seen.metrics if seen is not None else RequestMetrics(prompt_tokens=len(r.prompt_token_ids))
                    )
                    final = RequestOutput(r.request_id, [ChoiceDelta(0, "", [], finish_reason="abort")], True, metrics)
                self._note(i, final)
        log.info("aborted unfinished requests", count=len(pending))

    def usage(self) -> Usage:
        prompt = sum(o.metrics.prompt_tokens for o in self.last.values())
        completion = sum(o.metrics.completion_tokens for o in self.last.values())
        cached = sum(o.metrics.cached_tokens for o in self.last.values())
        return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached_tokens=cached))


async def cancel_on_disconnect(receive: Callable[[], Any], work: Callable[[], Any]) -> Any:
    """Run ``work()`` but cancel it if the client disconnects first (then returns None)."""
    result = None
    error: Exception | None = None

    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    log.info("client disconnected before the response")
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch)
        try:
            result = await work()
        except Exception as exc:  # re-raised below as itself, not wrapped in an ExceptionGroup
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result
