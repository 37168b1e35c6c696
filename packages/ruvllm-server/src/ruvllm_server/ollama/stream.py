"""Ollama's answers: a finished chat or completion as its one JSON object, and a stream of chat (or
completion) chunks as Ollama's NDJSON lines: a line per piece of the answer, the tool calls in one
line once they are whole, and a last line with ``done``, ``done_reason`` and the timings."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ruvllm.engine.types import RequestMetrics
from ruvllm_server.generation.sse import sse_objects
from ruvllm_server.ollama.translate import (
    Translated,
    done_reason,
    logprobs,
    now_iso,
    timings,
    tool_calls,
)
from ruvllm_server.ollama.wire import AssistantMessage, ChatPart, GeneratePart, Logprob, TopLogprob
from ruvllm_server.schemas import (
    ChatCompletion,
    ChatLogprobs,
    Completion,
    CompletionLogprobs,
    FunctionCall,
    ToolCallOut,
)

#: NDJSON, as Ollama streams it.
NDJSON = "application/x-ndjson"


def completion_logprobs(lp: CompletionLogprobs | None) -> list[Logprob] | None:
    """A completion's logprobs (parallel lists) as Ollama's entries."""
    if lp is None or not lp.tokens:
        return None
    out = []
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        alts = [TopLogprob(t, v) for t, v in (top or {}).items()]
        out.append(Logprob(token, value if value is not None else 0.0, None, alts))
    return out


@dataclass
class Parts:
    """Builds one request's Ollama objects: ``/api/chat``'s (a message) or ``/api/generate``'s (a
    response text)."""

    translated: Translated
    generate: bool
    started: float = field(default_factory=time.monotonic)

    def part(
        self,
        content: str,
        thinking: str | None = None,
        calls: list[ToolCallOut] | None = None,
        lps: list[Logprob] | None = None,
        **end: Any,
    ) -> ChatPart | GeneratePart:
        thinking = thinking if thinking and self.translated.show_thinking else None
        model, created = self.translated.model, now_iso()
        done = bool(end)
        if self.generate:
            return GeneratePart(
                model=model, created_at=created, response=content, thinking=thinking, done=done, logprobs=lps, **end
            )
        message = AssistantMessage(content=content, thinking=thinking, tool_calls=tool_calls(calls))
        return ChatPart(model=model, created_at=created, message=message, done=done, logprobs=lps, **end)

    def end(self, finish_reason: str | None, metrics: RequestMetrics | None) -> dict[str, Any]:
        """The last line's fields: ``done``, its reason and the timings."""
        t = timings(metrics, self.started)
        return {"done_reason": done_reason(finish_reason), **msgspec.structs.asdict(t)}

    def answer(self, result: ChatCompletion | Completion, metrics: RequestMetrics | None) -> ChatPart | GeneratePart:
        """A finished request as one object."""
        choice = result.choices[0]
        end = self.end(choice.finish_reason, metrics)
        if isinstance(result, Completion):
            return self.part(choice.text, lps=completion_logprobs(choice.logprobs), **end)  # type: ignore[union-attr]
        m = choice.message  # type: ignore[union-attr]
        lps = logprobs(choice.logprobs)  # type: ignore[arg-type]
        return self.part(m.content or "", m.reasoning_content, m.tool_calls, lps, **end)


@dataclass
class _Call:
    id: str | None
    name: str
    arguments: list[str] = field(default_factory=list)


async def ndjson_lines(
    source: AsyncIterator[bytes], parts: Parts, metrics: Callable[[], RequestMetrics | None]
) -> AsyncIterator[bytes]:
    """Ollama's NDJSON lines read from the chat or completions path's SSE stream (its chunks decoded
    again: those paths stay the one place that streams a run). ``metrics()`` is read once the run is
    over."""
    calls: dict[int, _Call] = {}
    finish_reason = None

    def line(part: Any) -> bytes:
        return msgspec.json.encode(part) + b"\n"

    try:
        async for piece in source:
            out: list[bytes] = []
            for obj in sse_objects(piece):
                if "error" in obj:
                    err = obj["error"] or {}
                    yield b"".join(out) + line({"error": str(err.get("message", "error"))})
                    return
                for choice in obj.get("choices", ()):
                    finish_reason = choice.get("finish_reason") or finish_reason
                    if "delta" not in choice:  # a completion chunk
                        lp = msgspec.convert(choice["logprobs"], CompletionLogprobs) if choice.get("logprobs") else None
                        if choice.get("text") or lp is not None:
                            out.append(line(parts.part(choice.get("text", ""), lps=completion_logprobs(lp))))
                        continue
                    d = choice["delta"]
                    for tc in d.get("tool_calls") or ():
                        fn = tc.get("function") or {}
                        call = calls.setdefault(tc["index"], _Call(tc.get("id"), fn.get("name") or ""))
                        call.arguments.append(fn.get("arguments") or "")
                    lp = logprobs(msgspec.convert(choice["logprobs"], ChatLogprobs)) if choice.get("logprobs") else None
                    text, thinking = d.get("content") or "", d.get("reasoning_content")
                    if text or (thinking and parts.translated.show_thinking) or lp:
                        out.append(line(parts.part(text, thinking, lps=lp)))
            if out:
                yield b"".join(out)
        tail = b""
        if calls:  # Ollama sends a call whole, in a line of its own
            whole = [
                ToolCallOut(c.id or "", FunctionCall(c.name, "".join(c.arguments))) for _, c in sorted(calls.items())
            ]
            tail = line(parts.part("", calls=whole))
        yield tail + line(parts.part("", **parts.end(finish_reason, metrics())))
    finally:
        await source.aclose()  # type: ignore[attr-defined]
