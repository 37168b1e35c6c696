"""``/v1/chat/completions``: a request turned into its run, and the run's outputs into a chat
completion or its stream of chunks (content, reasoning, tool-call deltas, logprobs, usage)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ruvllm.engine.types import ChoiceDelta
from ruvllm.structured import StructuredOutput
from ruvllm_server.errors import bad_request
from ruvllm_server.generation.chat_tools import (
    ChoiceTools,
    ToolSetup,
    split_calls,
    tool_deltas,
    tool_prompt,
    tool_setup,
)
from ruvllm_server.generation.logprobs import chat_logprobs
from ruvllm_server.generation.requests import build_sampling, check_model, encode_chat, engine_request, message_dicts
from ruvllm_server.generation.run import ChoiceAccumulator, Run
from ruvllm_server.generation.sse import SSE_DONE, TextEvent, error_event, sse
from ruvllm_server.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatResponseMessage,
    FunctionCall,
    ToolCallOut,
)
from ruvllm_server.tools import ToolCall, ToolParser, template_knows_tools

if TYPE_CHECKING:
    from ruvllm_server.state import ServerState


@dataclass
class ChatJob:
    state: ServerState
    req: ChatCompletionRequest
    #: The authenticating API key's non-secret id (``middleware.key_id``); None without API keys.
    api_key_id: str | None
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolSetup | None = None
    named_call_id: str = field(default_factory=lambda: ToolCall("x", "{}").id)
    #: Per choice, the stop string or stop token id that ended it (None: another reason), once it ended.
    stop_reasons: dict[int, str | int | None] = field(default_factory=dict)

    @property
    def parser(self) -> ToolParser | None:
        return self.state.tool_parser

    def prepare(self) -> Run:
        req = self.req
        adapter = check_model(self.state, req.model)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        prompt, structured = self.render()
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = build_sampling(
            self.state,
            req,
            max_tokens=max_tokens,
            default_max_tokens=self.state.max_context,
            prompt_len=len(prompt),
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            structured=structured,
        )
        setup = self.tools
        # Harmony's markup (the gpt_oss parsers) is special tokens: keep them in the text for the parsers.
        rp, tp = self.state.reasoning_parser, self.parser
        if (rp is not None and rp.keeps_special_tokens) or (
            setup is not None and setup.mode == "auto" and tp is not None and tp.keeps_special_tokens
        ):
            params.skip_special_tokens = False
        request = engine_request(prompt, params, self.id, req.user, self.api_key_id, adapter, req.speculative)
        return Run(self.state, [request])

    def render(self) -> tuple[list[int], StructuredOutput | None]:
        """The prompt's token ids as the run will have them (the tools and their instructions in
        it), and the output constraint a forced tool call brings."""
        req = self.req
        self.tools = setup = tool_setup(req)
        structured = None
        template_kw: dict[str, Any] = {}
        reads_tools = template_knows_tools(self.state.tokenizer.chat_template)
        messages = message_dicts(req.messages, reads_tools)
        if setup is not None:
            messages, template_kw, structured = tool_prompt(setup, req, reads_tools, messages)
        return encode_chat(self.state, messages, req.add_generation_prompt, **template_kw), structured

    async def complete(self, run: Run) -> ChatCompletion:
        acc: dict[int, ChoiceAccumulator] = {i: ChoiceAccumulator() for i in range(run.requests[0].sampling.n)}
        async for _, out in run.outputs():
            for d in out.deltas:
                a = acc.setdefault(d.index, ChoiceAccumulator())
                a.text.append(d.text)
                a.token_ids.extend(d.token_ids)
                if d.logprobs:
                    a.logprobs.extend(d.logprobs)
                if d.finish_reason:
                    a.finish_reason = d.finish_reason
                    self.stop_reasons[d.index] = d.stop_reason
        want_logprobs = bool(self.req.logprobs)
        choices = []
        for i, a in sorted(acc.items()):
            text, reasoning = "".join(a.text), None
            if self.state.reasoning_parser is not None:
                split = self.state.reasoning_parser().split(text)
                text, reasoning = split.content, split.reasoning
            content, calls, reason = split_calls(self.tools, self.parser, self.named_call_id, text, a.finish_reason)
            message = ChatResponseMessage(
                "assistant",
                content,
                [ToolCallOut(c.id, FunctionCall(c.name, c.arguments)) for c in calls] or None,
                reasoning,
            )
            choices.append(ChatChoice(i, message, chat_logprobs(a.logprobs) if want_logprobs else None, reason))
        return ChatCompletion(self.id, self.created, self.state.model_name, choices, run.usage())

    def _chunk(self, choice: ChatChunkChoice) -> bytes:
        """The chunk of one choice entry. A chunk carries exactly one, as OpenAI's do: the wire has at
        most one entry per choice index in a chunk, and clients (the openai SDK's users, LangChain,
        litellm) read only ``choices[0]``; a choice's several entries for one output (reasoning,
        tool-call deltas, finish reason), and n choices, are several chunks of one write."""
        return sse(ChatCompletionChunk(self.id, self.created, self.state.model_name, [choice]))

    def _content_event(self, index: int) -> TextEvent:
        """The chunk of choice ``index`` that carries only content (most tokens' chunk)."""
        return TextEvent(
            lambda text: ChatCompletionChunk(
                self.id,
                self.created,
                self.state.model_name,
                [ChatChunkChoice(index, ChatDelta(content=text), None, None)],
            )
        )

    async def stream(self, run: Run) -> AsyncIterator[bytes]:
        n = run.requests[0].sampling.n
        want_logprobs = bool(self.req.logprobs)
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        tool_state = {i: ChoiceTools() for i in range(n)} if self.tools is not None else None
        thinking: dict[int, Any] | None = {} if self.state.reasoning_parser is not None else None
        content_events: dict[int, TextEvent] = {}
        # Without a reasoning parser or tools, a delta of text alone is a content chunk as it is.
        plain = thinking is None and tool_state is None
        # Outputs that arrived together go out as one write; the last ones wait for the usage
        # chunk and [DONE], which follow at once, so a request's end is one write too.
        tail = b""
        try:
            yield b"".join(
                self._chunk(ChatChunkChoice(i, ChatDelta(role="assistant", content=""), None, None)) for i in range(n)
            )
            async for batch in run.output_batches():
                events: list[bytes] = []
                for _, out in batch:
                    for d in out.deltas:
                        if d.finish_reason:
                            self.stop_reasons[d.index] = d.stop_reason
                        if plain and d.text and d.finish_reason is None and not (want_logprobs and d.logprobs):
                            event = content_events.get(d.index)
                            if event is None:
                                event = content_events[d.index] = self._content_event(d.index)
                            events.append(event(d.text))
                        else:
                            events += map(self._chunk, self._entries(d, want_logprobs, thinking, tool_state))
                if run.done:
                    tail = b"".join(events)
                elif events:
                    yield b"".join(events)
            if include_usage:
                tail += sse(ChatCompletionChunk(self.id, self.created, self.state.model_name, [], usage=run.usage()))
        except Exception as exc:  # the status line is sent: errors go into the stream
            if tail:
                yield tail
            tail = error_event(exc)
        yield tail + SSE_DONE

    def _entries(
        self,
        d: ChoiceDelta,
        want_logprobs: bool,
        thinking: dict[int, Any] | None,
        tool_state: dict[int, ChoiceTools] | None,
    ) -> list[ChatChunkChoice]:
        """The entries of choice ``d.index`` for one engine delta, in order: reasoning, tool-call
        deltas, content, logprobs and finish reason (several, each then a chunk of its own)."""
        piece = d.text
        entries: list[ChatChunkChoice] = []
        if thinking is not None:
            rp = thinking.get(d.index)
            if rp is None:
                rp = thinking[d.index] = self.state.reasoning_parser()  # type: ignore[misc]
            reasoning, piece = rp.feed(d.text, final=d.finish_reason is not None)
            if reasoning:
                entries.append(ChatChunkChoice(d.index, ChatDelta(reasoning_content=reasoning), None, None))
        if tool_state is not None:
            assert self.tools is not None  # tool_state is made only with tools
            st = tool_state.setdefault(d.index, ChoiceTools())
            entries += tool_deltas(self.tools, self.parser, self.named_call_id, d.index, st, piece, d.finish_reason)
        elif piece or d.finish_reason or (want_logprobs and d.logprobs):
            entries.append(
                ChatChunkChoice(
                    d.index,
                    ChatDelta(content=piece) if piece else ChatDelta(),
                    chat_logprobs(d.logprobs) if want_logprobs and d.logprobs else None,
                    d.finish_reason,
                )
            )
        return entries
