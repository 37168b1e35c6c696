"""From OpenAI requests to engine requests, and from engine outputs to OpenAI responses and SSE streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import jinja2
import msgspec
import structlog

from ruvllm.engine import EngineDeadError
from ruvllm.engine.types import ChoiceDelta, GenerationRequest, RequestMetrics, RequestOutput, TokenLogprob
from ruvllm.errors import RequestError, RuvllmError
from ruvllm.sampling import SamplingParams
from ruvllm.structured import StructuredOutput
from ruvllm_server.errors import APIError, bad_request, model_not_found
from ruvllm_server.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ErrorBody,
    ErrorResponse,
    FunctionCall,
    FunctionDelta,
    PromptLogprob,
    PromptTokensDetails,
    SamplingFields,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from ruvllm_server.tools import (
    ToolCall,
    ToolParser,
    calls_from_required,
    check_tools,
    named_schema,
    required_schema,
    template_knows_tools,
    tool_system_prompt,
)

if TYPE_CHECKING:
    from ruvllm_server.state import ServerState

log = structlog.get_logger("ruvllm.server")

#: Most stop strings per request.
MAX_STOP_STRINGS = 16
#: Most choices (prompts x n) per completions request.
MAX_CHOICES = 256
#: OpenAI's default ``max_tokens`` of /v1/completions.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: Stand-in for ``-inf`` log probabilities, which JSON cannot carry.
MIN_LOGPROB = -9999.0

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


# --- request conversion -----------------------------------------------------------------------


def check_model(state: ServerState, name: str | None) -> Any:
    """The LoRA adapter ``name`` picks (None: the base model); an unknown name is a 404."""
    if name is None or name == state.model_name:
        return None
    adapter = state.adapters.get(name)
    if adapter is None:
        raise model_not_found(name)
    return adapter


def message_dicts(messages: list[ChatMessage], template_reads_tools: bool = True) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (content parts joined into one string). An assistant
    turn's ``tool_calls`` go to the template with their arguments as objects, as transformers passes
    them; a template that knows no tools gets them written into the content instead, as the ``json``
    tool format (what :func:`ruvllm_server.tools.tool_system_prompt` asks the model to write)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"content part type {part.type!r} is not supported (only 'text')",
                        param=f"messages[{i}].content[{j}]",
                    )
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = m.content or ""
        d: dict[str, Any] = {"role": m.role, "content": content}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                try:
                    args = json.loads(c.function.arguments) if c.function.arguments else {}
                except json.JSONDecodeError:
                    raise bad_request(
                        "tool call arguments must be JSON text",
                        param=f"messages[{i}].tool_calls[{j}].function.arguments",
                    ) from None
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            if template_reads_tools:
                d["tool_calls"] = calls
            else:
                written = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
                text = json.dumps(written[0] if len(written) == 1 else written, ensure_ascii=False)
                d["content"] = f"{content}\n{text}" if content else text
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def encode_chat(
    state: ServerState,
    messages: list[ChatMessage] | list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **template_kw: Any,
) -> list[int]:
    if messages and not isinstance(messages[0], dict):
        reads_tools = template_knows_tools(state.tokenizer.chat_template)
        dicts = message_dicts(messages, reads_tools)  # type: ignore[arg-type]
    else:
        dicts = messages  # type: ignore[assignment]
    try:
        return state.tokenizer.encode_chat(dicts, add_generation_prompt=add_generation_prompt, **template_kw)
    except jinja2.TemplateError as exc:
        # Templates reject conversations they cannot render (e.g. roles that do not alternate).
        raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None
    except RequestError:
        raise
    except RuvllmError as exc:
        raise bad_request(str(exc), param="messages") from None


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}", param="stop")
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", param="stop")
    return stops


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
    return out


def structured_output(req: SamplingFields) -> StructuredOutput | None:
    """The request's output constraint, from whichever one field gives it: ``response_format``
    (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` or its ``guided_*`` fields."""
    found: list[StructuredOutput] = []
    rf = req.response_format
    if rf is not None:
        if rf.type == "json_object":
            found.append(StructuredOutput("json_object", param="response_format"))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema is None:
                raise bad_request(
                    "response_format json_schema needs json_schema.schema", param="response_format.json_schema"
                )
            found.append(StructuredOutput.json_schema(rf.json_schema.schema))
        elif rf.type != "text":
            raise bad_request(
                f"response_format type must be text, json_object or json_schema, got {rf.type!r}",
                param="response_format.type",
            )
    so = req.structured_outputs
    if so is not None:
        given = [
            k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(so, k) not in (None, False)
        ]
        if len(given) != 1:
            raise bad_request(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}",
                param="structured_outputs",
            )
        found.append(_vllm_constraint(given[0], getattr(so, given[0]), f"structured_outputs.{given[0]}"))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            found.append(_vllm_constraint(name, value, f"guided_{name}"))
    if len(found) > 1:
        names = ", ".join(f.param.split(".")[0] for f in found)
        raise bad_request(f"give one output constraint, not several ({names})", param=found[1].param.split(".")[0])
    return found[0] if found else None


def _vllm_constraint(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput.json_schema(value, param=param)
    if kind == "json_object":
        return StructuredOutput("json_object", param=param)
    if kind == "choice":
        return StructuredOutput.choice(value, param=param)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param=param)
    return StructuredOutput(kind, value, param)  # type: ignore[arg-type]


def build_sampling(
    state: ServerState,
    req: SamplingFields,
    *,
    max_tokens: int | None,
    default_max_tokens: int,
    prompt_len: int,
    logprobs: int | None,
    structured: StructuredOutput | None = None,
) -> SamplingParams:
    n = req.n if req.n is not None else 1
    if n > state.settings.max_n:
        raise bad_request(f"n must be at most {state.settings.max_n}, got {n}", param="n")
    limit = state.max_context
    if prompt_len >= limit:
        raise bad_request(
            f"the prompt is {prompt_len} tokens, which leaves no room in the context of {limit} tokens",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise bad_request(
            f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the context of {limit} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    params = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else min(default_max_tokens, limit - prompt_len),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=_logit_bias(req.logit_bias),
        seed=req.seed,
        stop=_stop_strings(req.stop),
        stop_token_ids=list(req.stop_token_ids or []),
        min_tokens=req.min_tokens or 0,
        ignore_eos=bool(req.ignore_eos),
        n=n,
        logprobs=logprobs,
        structured=structured or structured_output(req),
    )
    vocab = state.model.config.vocab_size if state.model is not None else None
    if vocab is not None:
        bad_ids = [t for t in params.stop_token_ids if t >= vocab]
        if bad_ids:
            raise bad_request(
                f"stop_token_ids {bad_ids} are outside the vocabulary (0..{vocab - 1})", param="stop_token_ids"
            )
    params.validate(vocab)
    return params


def completion_prompts(state: ServerState, prompt: str | list[Any]) -> list[list[int]]:
    """Token ids of each prompt of a completions request."""
    tok = state.tokenizer
    vocab = tok.vocab_size
    if isinstance(prompt, str):
        prompts = [tok.encode(prompt)]
    elif not prompt:
        raise bad_request("prompt must not be an empty list", param="prompt")
    elif all(isinstance(p, str) for p in prompt):
        prompts = [tok.encode(p) for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, list) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
            param="prompt",
        )
    for i, ids in enumerate(prompts):
        if not ids:
            raise bad_request(f"prompt {i} is empty", param="prompt")
        if any(t < 0 or t >= vocab for t in ids):
            raise bad_request(f"prompt {i} has token ids outside the vocabulary (0..{vocab - 1})", param="prompt")
    return prompts


def engine_request(
    prompt: list[int],
    params: SamplingParams,
    request_id: str,
    user: str | None,
    api_key_id: str | None,
    adapter: Any = None,
) -> GenerationRequest:
    """The engine request of one prompt. ``user`` is the client's claim (OpenAI ``user``), the key id
    its fallback; only ``metadata["api_key_id"]`` is authenticated, so plugins that scope state by
    key (SONA's ``api_key`` scope) read that."""
    metadata: dict[str, Any] = {"api_key_id": api_key_id} if api_key_id else {}
    return GenerationRequest(
        prompt, params, request_id=request_id, user=user or api_key_id, metadata=metadata, adapter=adapter
    )


# --- running requests -------------------------------------------------------------------------


@dataclass
class ChoiceAccumulator:
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

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(index of the engine request, output)`` as they arrive. Leaving early (client gone,
        error, cancellation) aborts what has not finished."""
        engine = self.state.engine
        assert engine is not None
        try:
            if len(self.requests) == 1:
                async for out in engine.generate(self.requests[0]):
                    yield self._note(0, out)
            else:
                async for item in self._merged():
                    yield self._note(*item)
        finally:
            await self._abort_unfinished()

    def _note(self, i: int, out: RequestOutput) -> tuple[int, RequestOutput]:
        self.last[i] = out
        if out.finished:
            self.finished.add(i)
            adapter = getattr(self.requests[i].adapter, "name", None) if self.requests[i].adapter is not None else None
            self.state.metrics.observe_request(
                out.metrics, [d.finish_reason for d in out.deltas if d.finish_reason], adapter
            )
        return i, out

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        engine = self.state.engine
        assert engine is not None
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(i: int, req: GenerationRequest) -> None:
            try:
                async for out in engine.generate(req):
                    queue.put_nowait((i, out))
                queue.put_nowait(None)
            except Exception as exc:  # handed to the consumer, which re-raises it
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.requests)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
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


def _clamp(lp: float) -> float:
    return lp if lp > MIN_LOGPROB else MIN_LOGPROB


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        [
            ChatTokenLogprob(
                e.token,
                _clamp(e.logprob),
                _bytes(e.token),
                [TopLogprob(tok, _clamp(lp), _bytes(tok)) for _, tok, lp in e.top],
            )
            for e in entries
        ]
    )


def completion_logprobs(entries: list[TokenLogprob], offset: int, top: int) -> CompletionLogprobs:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[_clamp(e.logprob) for e in entries],
        top_logprobs=[{tok: _clamp(lp) for _, tok, lp in e.top} if top else None for e in entries],
        text_offset=offsets,
    )


def prompt_logprobs_vllm(entries: list[TokenLogprob | None]) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, the token's own entry and the top alternatives
    (their rank is their place among them), keyed by token id."""
    out: list[dict[str, PromptLogprob] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): PromptLogprob(_clamp(e.logprob), e.rank, e.token)}
        for r, (tid, tok, lp) in enumerate(e.top, 1):
            d.setdefault(str(tid), PromptLogprob(_clamp(lp), r, tok))
        out.append(d)
    return out


def echoed_prompt_logprobs(
    prompt_ids: list[int], entries: list[TokenLogprob | None], top: int, decode: Callable[[list[int]], str]
) -> CompletionLogprobs:
    """The prompt's part of ``echo`` + ``logprobs`` (OpenAI's legacy completions): every prompt token,
    its logprob (None for the first), its top alternatives, offsets into the echoed text."""
    tokens, lps, tops, offsets, at = [], [], [], [], 0
    for tid, e in zip(prompt_ids, entries, strict=True):
        text = e.token if e is not None else decode([tid])
        tokens.append(text)
        lps.append(_clamp(e.logprob) if e is not None else None)
        tops.append({tok: _clamp(lp) for _, tok, lp in e.top[:top]} if e is not None and top else None)
        offsets.append(at)
        at += len(text)
    return CompletionLogprobs(tokens, lps, tops, offsets)


def _error_event(exc: Exception) -> bytes:
    if isinstance(exc, APIError):
        return sse(exc.body)
    if isinstance(exc, RequestError):
        return sse(ErrorResponse(ErrorBody(str(exc), "invalid_request_error")))
    if isinstance(exc, EngineDeadError):
        return sse(ErrorResponse(ErrorBody("the server is shutting down", "service_unavailable", code="shutting_down")))
    log.exception("generation failed mid-stream")
    return sse(ErrorResponse(ErrorBody("internal server error (logged)", "server_error", code="internal_error")))


# --- chat -------------------------------------------------------------------------------------


@dataclass
class ToolSetup:
    """How one chat request uses tools: ``mode`` none / auto / required / named."""

    tools: list[dict[str, Any]]
    mode: str
    name: str | None = None
    parallel: bool = True


def tool_setup(req: ChatCompletionRequest) -> ToolSetup | None:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    tools = check_tools(req.tools)
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice in ("none", "auto", "required"):
        return ToolSetup(tools, choice or "auto", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        named_schema(tools, name)  # an unknown name is a 400 naming tool_choice
        return ToolSetup(tools, "named", name, parallel)
    raise bad_request(
        "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


@dataclass
class ChoiceTools:
    """Per-choice tool-call state while streaming (auto mode holds back what may be a call)."""

    text: str = ""
    emitted: int = 0
    call_at: int | None = None
    started_named: bool = False


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

    @property
    def parser(self) -> ToolParser | None:
        return self.state.tool_parser

    def prepare(self) -> Run:
        req = self.req
        adapter = check_model(self.state, req.model)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        self.tools = setup = tool_setup(req)
        structured = None
        template_kw: dict[str, Any] = {}
        messages = message_dicts(req.messages, template_knows_tools(self.state.tokenizer.chat_template))
        if setup is not None:
            if setup.mode in ("required", "named") and structured_output(req) is not None:
                raise bad_request("a forced tool call cannot also have an output constraint", param="tool_choice")
            if setup.mode == "named":
                structured = StructuredOutput.json_schema(named_schema(setup.tools, setup.name), param="tool_choice")
            elif setup.mode == "required":
                structured = StructuredOutput.json_schema(required_schema(setup.tools, setup.parallel), param="tools")
            if template_knows_tools(self.state.tokenizer.chat_template):
                template_kw["tools"] = setup.tools  # as transformers passes them
            elif setup.mode != "none":
                messages = _with_system_text(messages, tool_system_prompt(setup.tools, setup.parallel))
        prompt = encode_chat(self.state, messages, req.add_generation_prompt, **template_kw)
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
        return Run(self.state, [engine_request(prompt, params, self.id, req.user, self.api_key_id, adapter)])

    def _calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, tool calls, finish reason) of a finished choice's text."""
        setup = self.tools
        if setup is None or setup.mode == "none":
            return text, [], finish_reason
        if setup.mode == "named":  # the arguments, as far as they got (finish_reason says whether whole)
            return None, [ToolCall(setup.name or "", text, self.named_call_id)], finish_reason
        if finish_reason != "stop":
            return text, [], finish_reason
        if setup.mode == "required":
            return None, calls_from_required(text), "tool_calls"
        assert self.parser is not None
        parsed = self.parser.parse(text, setup.tools)
        if not parsed.tool_calls:
            return text, [], finish_reason
        return parsed.content, parsed.tool_calls, "tool_calls"

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
        want_logprobs = bool(self.req.logprobs)
        choices = []
        for i, a in sorted(acc.items()):
            text, reasoning = "".join(a.text), None
            if self.state.reasoning_parser is not None:
                split = self.state.reasoning_parser().split(text)
                text, reasoning = split.content, split.reasoning
            content, calls, reason = self._calls(text, a.finish_reason)
            message = ChatResponseMessage(
                "assistant",
                content,
                [ToolCallOut(c.id, FunctionCall(c.name, c.arguments)) for c in calls] or None,
                reasoning,
            )
            choices.append(ChatChoice(i, message, chat_logprobs(a.logprobs) if want_logprobs else None, reason))
        return ChatCompletion(self.id, self.created, self.state.model_name, choices, run.usage())

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse(ChatCompletionChunk(self.id, self.created, self.state.model_name, choices, usage=usage))

    def _tool_deltas(self, index: int, st: ChoiceTools, piece: str, finish_reason: str | None) -> list[ChatChunkChoice]:
        """Stream chunks for one engine delta of a choice when the request has tools: content as it
        comes, except what is (or may become) a tool call, which goes out as tool-call deltas (id and
        name first, then argument fragments)."""
        setup = self.tools
        assert setup is not None
        st.text += piece
        out: list[ChatChunkChoice] = []

        def content(text: str) -> None:
            if text:
                out.append(ChatChunkChoice(index, ChatDelta(content=text), None, None))

        if setup.mode == "named":
            if not st.started_named:
                st.started_named = True
                first = ToolCallDelta(0, FunctionDelta(setup.name, ""), self.named_call_id, "function")
                out.append(ChatChunkChoice(index, ChatDelta(tool_calls=[first]), None, None))
            if piece:
                delta = ToolCallDelta(0, FunctionDelta(arguments=piece))
                out.append(ChatChunkChoice(index, ChatDelta(tool_calls=[delta]), None, None))
            if finish_reason:
                out.append(ChatChunkChoice(index, ChatDelta(), None, finish_reason))
            return out
        if setup.mode == "auto" and st.call_at is None and self.parser is not None:
            pending = st.text[st.emitted :]
            # A parser whose calls open the output cannot find one once content went out.
            open_ = st.emitted == 0 or not self.parser.markers_at_start
            at = self.parser.call_start(pending) if open_ else None
            if at is not None:
                st.call_at = st.emitted + at
                content(pending[:at])
                st.emitted = st.call_at
            elif finish_reason is None:
                keep = self.parser.may_start(pending) if open_ else 0
                content(pending[: len(pending) - keep])
                st.emitted += len(pending) - keep
        elif setup.mode == "none":
            content(st.text[st.emitted :])
            st.emitted = len(st.text)
        if finish_reason is None:
            return out
        _, calls, reason = self._calls(st.text, finish_reason)
        if calls:
            for k, c in enumerate(calls):
                head = ToolCallDelta(k, FunctionDelta(c.name, ""), c.id, "function")
                out.append(ChatChunkChoice(index, ChatDelta(tool_calls=[head]), None, None))
                out.append(
                    ChatChunkChoice(
                        index,
                        ChatDelta(tool_calls=[ToolCallDelta(k, FunctionDelta(arguments=c.arguments))]),
                        None,
                        None,
                    )
                )
        else:
            content(st.text[st.emitted :])
        st.emitted = len(st.text)
        out.append(ChatChunkChoice(index, ChatDelta(), None, reason))
        return out

    async def stream(self, run: Run) -> AsyncIterator[bytes]:
        n = run.requests[0].sampling.n
        want_logprobs = bool(self.req.logprobs)
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        tool_state = {i: ChoiceTools() for i in range(n)} if self.tools is not None else None
        thinking: dict[int, Any] | None = {} if self.state.reasoning_parser is not None else None
        try:
            yield self._chunk(
                [ChatChunkChoice(i, ChatDelta(role="assistant", content=""), None, None) for i in range(n)]
            )
            async for _, out in run.outputs():
                choices = []
                for d in out.deltas:
                    piece = d.text
                    if thinking is not None:
                        rp = thinking.setdefault(d.index, self.state.reasoning_parser())  # type: ignore[misc]
                        reasoning, piece = rp.feed(d.text, final=d.finish_reason is not None)
                        if reasoning:
                            choices.append(ChatChunkChoice(d.index, ChatDelta(reasoning_content=reasoning), None, None))
                    if tool_state is not None:
                        st = tool_state.setdefault(d.index, ChoiceTools())
                        choices.extend(self._tool_deltas(d.index, st, piece, d.finish_reason))
                        continue
                    if not piece and not d.finish_reason and not (want_logprobs and d.logprobs):
                        continue
                    choices.append(
                        ChatChunkChoice(
                            d.index,
                            ChatDelta(content=piece) if piece else ChatDelta(),
                            chat_logprobs(d.logprobs) if want_logprobs and d.logprobs else None,
                            d.finish_reason,
                        )
                    )
                if choices:
                    yield self._chunk(choices)
            if include_usage:
                yield self._chunk([], usage=run.usage())
        except Exception as exc:  # the status line is sent: errors go into the stream
            yield _error_event(exc)
        yield SSE_DONE


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``messages`` with ``text`` added to the system message (a new one first if there is none)."""
    if messages and messages[0].get("role") in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{text}".strip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# --- completions ------------------------------------------------------------------------------


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
            requests.append(engine_request(ids, params, rid, req.user, self.api_key_id, adapter))
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

    async def stream(self, run: Run) -> AsyncIterator[bytes]:
        n = run.requests[0].sampling.n
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        offsets: dict[int, int] = {}
        try:
            if self.req.echo:
                echoes = [CompletionChoice(i, self._echo(i // n), None, None) for i in range(len(run.requests) * n)]
                yield sse(Completion(self.id, self.created, self.state.model_name, echoes))
            async for p, out in run.outputs():
                choices = []
                for d in out.deltas:
                    if not d.text and not d.finish_reason and not (self.req.logprobs is not None and d.logprobs):
                        continue
                    i = self._index(run, p, d.index)
                    lp = None
                    if self.req.logprobs is not None and d.logprobs:
                        start = offsets.get(i, len(self._echo(p)))
                        lp = completion_logprobs(d.logprobs, start, self.req.logprobs)
                        offsets[i] = start + sum(len(e.token) for e in d.logprobs)
                    choices.append(CompletionChoice(i, d.text, lp, d.finish_reason))
                if choices:
                    yield sse(Completion(self.id, self.created, self.state.model_name, choices))
            if include_usage:
                yield sse(Completion(self.id, self.created, self.state.model_name, [], usage=run.usage()))
        except Exception as exc:  # the status line is sent: errors go into the stream
            yield _error_event(exc)
        yield SSE_DONE
