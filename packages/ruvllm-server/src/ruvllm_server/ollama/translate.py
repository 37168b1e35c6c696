"""Ollama's requests in the chat and completions paths' terms, and their answers back in Ollama's
shape: the one place where the dialects meet (as :mod:`ruvllm_server.responses.translate` is for
OpenAI's Responses API).

``options`` map to the sampling fields (``num_predict`` to ``max_tokens``, ``repeat_penalty`` to
``repetition_penalty``, ...); ``format`` to ``response_format``; an assistant turn's ``tool_calls``
(arguments as objects) to the chat's calls, each ``tool`` message to the call it answers. Model names
as Ollama's clients send them (``name:tag``) resolve to the served model.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ruvllm.engine.types import RequestMetrics
from ruvllm_server.errors import APIError, bad_request
from ruvllm_server.ollama.wire import (
    ChatRequest,
    GenerateRequest,
    GenerationFields,
    Logprob,
    OllamaMessage,
    Timings,
    ToolCall,
    ToolCallFunction,
    TopLogprob,
)
from ruvllm_server.schemas import (
    ChatCompletionRequest,
    ChatLogprobs,
    ChatMessage,
    CompletionRequest,
    FunctionCall,
    JsonSchemaFormat,
    ResponseFormat,
    StreamOptions,
    ToolCallIn,
    ToolCallOut,
)

if TYPE_CHECKING:
    from ruvllm_server.state import ServerState

#: Sampling options and the chat field each sets.
SAMPLING_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repeat_penalty": "repetition_penalty",
}
#: Options whose value turns a feature off: accepted at that value only (ruvllm has no such sampler).
OFF_VALUES = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}
#: Options that set how Ollama loads a model: this server loads its model once, at start.
LOAD_OPTIONS = frozenset(
    {"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "use_mmap", "use_mlock", "num_thread", "vocab_only",
     "logits_all", "embedding_only", "f16_kv"}
)  # fmt: skip
#: The tag a name without one has, as Ollama's clients read it.
DEFAULT_TAG = "latest"

_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)?$")


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def not_found(name: str) -> APIError:
    return APIError(404, f"model {name!r} not found", param="model", code="model_not_found")


def tagged(name: str) -> str:
    """The served model's name as Ollama lists it (``smollm2:latest``)."""
    return name if ":" in name else f"{name}:{DEFAULT_TAG}"


def served_name(state: ServerState, name: str) -> str:
    """The served model or adapter ``name`` means: itself, or without the ``:latest`` Ollama's
    clients add; anything else is Ollama's not-found."""
    known = {state.model_name, *state.aliases, *state.adapters}
    if name in known:
        return name
    base, _, tag = name.rpartition(":")
    if base and tag == DEFAULT_TAG and base in known:
        return base
    raise not_found(name)


def check_keep_alive(value: float | str | None) -> None:
    """``keep_alive`` as Ollama reads it (seconds, or a duration such as ``5m``, ``-1``, ``0``).
    Accepted and checked; the served model stays loaded whatever it says."""
    if value is None or isinstance(value, (int, float)):
        return
    if not _DURATION.match(value.strip()):
        raise bad_request(f"keep_alive must be a number of seconds or a duration such as 5m, got {value!r}")


# --- options and format ---------------------------------------------------------------------------


@dataclass
class Sampling:
    """What ``options`` set, in the chat path's fields."""

    fields: dict[str, Any]
    max_tokens: int | None = None
    num_ctx: int | None = None


def sampling(options: dict[str, Any] | None, state: ServerState) -> Sampling:
    out: dict[str, Any] = {}
    max_tokens = num_ctx = None
    for key, value in (options or {}).items():
        if value is None:
            continue
        param = f"options.{key}"
        if key in SAMPLING_OPTIONS:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad_request(f"{key} must be a number", param=param)
            whole = key in ("top_k", "seed")
            if whole and not isinstance(value, int):
                raise bad_request(f"{key} must be an integer", param=param)
            out[SAMPLING_OPTIONS[key]] = value
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise bad_request("stop must be a string or a list of strings", param=param)
            out["stop"] = stops
        elif key == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -2:
                raise bad_request("num_predict must be a positive integer, -1 or -2 (until the context)", param=param)
            max_tokens = value if value > 0 else None
        elif key == "num_ctx":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad_request("num_ctx must be a positive integer", param=param)
            if value > state.max_context:
                raise bad_request(
                    f"num_ctx {value} is more than the served context of {state.max_context} tokens "
                    "(ruvllm serve --max-context sets it)",
                    param=param,
                )
            num_ctx = value
        elif key in OFF_VALUES:
            if value != OFF_VALUES[key]:
                raise bad_request(f"{key} is not supported (only {OFF_VALUES[key]}, off)", param=param)
        elif key in LOAD_OPTIONS:
            raise bad_request(
                f"{key} is how a model is loaded: this server loads its model once, set it on ruvllm serve",
                param=param,
            )
        else:
            raise bad_request(f"option {key!r} is not supported", param=param)
    return Sampling(out, max_tokens, num_ctx)


def response_format(fmt: str | dict[str, Any] | None) -> ResponseFormat | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return ResponseFormat("json_object")
    if isinstance(fmt, dict):
        return ResponseFormat("json_schema", JsonSchemaFormat(fmt))
    raise bad_request(f'format must be "json" or a JSON schema, got {fmt!r}', param="format")


def show_thinking(req: GenerationFields, state: ServerState) -> bool:
    """Whether the answer carries ``thinking``: the server's reasoning parser splits it off; ``think``
    true without one is Ollama's "does not support thinking"."""
    think = req.think
    if isinstance(think, str):
        raise bad_request("think levels (low, medium, high) are not supported: give true or false", param="think")
    if think and state.reasoning_parser is None:
        raise bad_request(f"{req.model!r} does not support thinking (the server runs no --reasoning-parser)")
    return think is not False


# --- messages -------------------------------------------------------------------------------------


def _calls(calls: list[dict[str, Any]], where: str) -> list[ToolCallIn]:
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise bad_request("a tool call needs function.name", param=f"{where}.tool_calls[{j}].function.name")
        args = fn.get("arguments", {})  # type: ignore[union-attr]
        if isinstance(args, str):  # some clients send the OpenAI form
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            raise bad_request("tool call arguments must be an object", param=f"{where}.tool_calls[{j}].function")
        call_id = call.get("id") if isinstance(call.get("id"), str) else f"call_{uuid.uuid4().hex[:24]}"
        out.append(ToolCallIn(FunctionCall(name, json.dumps(args, ensure_ascii=False)), call_id))
    return out


def chat_messages(messages: list[OllamaMessage]) -> list[ChatMessage]:
    """The conversation as chat messages. A ``tool`` message answers a call of the assistant turn
    before it: the one its ``tool_call_id`` or ``tool_name`` names, else the next unanswered one."""
    out: list[ChatMessage] = []
    open_calls: list[ToolCallIn] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.images:
            raise bad_request("images are not supported: the served model reads text only", param=f"{where}.images")
        if m.role == "assistant":
            calls = _calls(m.tool_calls or [], where)
            out.append(ChatMessage("assistant", m.content or None, tool_calls=calls or None))
            open_calls = list(calls)
        elif m.role == "tool":
            match = [c for c in open_calls if m.tool_call_id in (None, c.id)]
            match = [c for c in match if m.tool_name in (None, c.function.name)]
            if not match:
                named = m.tool_call_id or m.tool_name
                raise bad_request(
                    f"a tool message must answer a tool call of the assistant message before it"
                    f"{f' (none is {named!r})' if named else ''}",
                    param=f"{where}.role",
                )
            open_calls.remove(match[0])
            out.append(ChatMessage("tool", m.content, tool_call_id=match[0].id))
        elif m.role in ("system", "user"):
            out.append(ChatMessage(m.role, m.content))
            open_calls = []
        else:
            raise bad_request(f"role must be system, user, assistant or tool, got {m.role!r}", param=f"{where}.role")
    return out


# --- requests -------------------------------------------------------------------------------------


@dataclass
class Translated:
    """An Ollama request in the chat (or completions) path's terms."""

    chat: ChatCompletionRequest | CompletionRequest
    model: str
    num_ctx: int | None
    show_thinking: bool


def _common(req: GenerationFields, state: ServerState) -> tuple[str, Sampling, dict[str, Any]]:
    check_keep_alive(req.keep_alive)
    model = served_name(state, req.model)
    s = sampling(req.options, state)
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise bad_request("top_logprobs must be between 0 and 20", param="top_logprobs")
    fields: dict[str, Any] = {
        **s.fields,
        "model": model,
        "max_tokens": s.max_tokens,
        "response_format": response_format(req.format),
        "stream": req.stream,
        "stream_options": StreamOptions(include_usage=True) if req.stream else None,
    }
    return model, s, fields


def chat_request(req: ChatRequest, state: ServerState) -> Translated:
    model, s, fields = _common(req, state)
    chat = ChatCompletionRequest(
        messages=chat_messages(req.messages),
        tools=req.tools or None,
        logprobs=req.logprobs or (req.top_logprobs is not None) or None,
        top_logprobs=req.top_logprobs,
        **fields,
    )
    return Translated(chat, model, s.num_ctx, show_thinking(req, state))


def generate_request(req: GenerateRequest, state: ServerState) -> Translated:
    """A generate request: the prompt as a user turn of the chat template, or (``raw``) as it is."""
    for name in ("suffix", "template", "context", "images"):
        if getattr(req, name):
            raise bad_request(f"{name} is not supported by this server", param=name)
    model, s, fields = _common(req, state)
    chat: ChatCompletionRequest | CompletionRequest
    if req.raw:
        if req.system:
            raise bad_request("a raw prompt takes no system message (it is sent as it is)", param="system")
        chat = CompletionRequest(
            prompt=req.prompt, logprobs=req.top_logprobs or (0 if req.logprobs else None), **fields
        )
    else:
        messages = [ChatMessage("system", req.system)] if req.system else []
        chat = ChatCompletionRequest(
            messages=[*messages, ChatMessage("user", req.prompt)],
            logprobs=req.logprobs or (req.top_logprobs is not None) or None,
            top_logprobs=req.top_logprobs,
            **fields,
        )
    return Translated(chat, model, s.num_ctx, show_thinking(req, state))


def fit_context(run: Any, num_ctx: int | None) -> None:
    """``num_ctx`` bounds the request: its prompt must fit, and it generates no further."""
    if num_ctx is None:
        return
    for r in run.requests:
        room = num_ctx - len(r.prompt_token_ids)
        if room < 1:
            raise bad_request(
                f"the prompt is {len(r.prompt_token_ids)} tokens, which leaves no room in num_ctx {num_ctx}",
                param="options.num_ctx",
            )
        r.sampling.max_tokens = min(r.sampling.max_tokens, room)


# --- answers --------------------------------------------------------------------------------------


def done_reason(finish_reason: str | None) -> str:
    """Ollama says ``length`` for a cut answer and ``stop`` otherwise (tool calls included)."""
    return "length" if finish_reason == "length" else "stop"


def timings(metrics: RequestMetrics | None, started: float) -> Timings:
    """Counts and nanosecond durations of a finished request: the engine's own (queue, first token,
    end; all from its arrival). No load: the served model was loaded at start."""
    if metrics is None:
        total = time.monotonic() - started
        return Timings(
            total_duration=int(total * 1e9), load_duration=0, prompt_eval_count=0, prompt_eval_duration=0,
            eval_count=0, eval_duration=0,
        )  # fmt: skip
    ns = 1e9
    return Timings(
        total_duration=int(metrics.e2e * ns),
        load_duration=0,
        prompt_eval_count=metrics.prompt_tokens,
        prompt_eval_duration=int(max(metrics.ttft - metrics.queue_time, 0.0) * ns),
        eval_count=metrics.completion_tokens,
        eval_duration=int(max(metrics.e2e - metrics.ttft, 0.0) * ns),
    )


def tool_calls(calls: list[ToolCallOut] | None) -> list[ToolCall] | None:
    """Calls with their arguments as objects (arguments a length cut left unfinished: ``{}``)."""
    if not calls:
        return None
    out = []
    for k, c in enumerate(calls):
        try:
            args = json.loads(c.function.arguments) if c.function.arguments else {}
        except json.JSONDecodeError:
            args = {}
        out.append(ToolCall(ToolCallFunction(c.function.name, args if isinstance(args, dict) else {}, k), c.id or None))
    return out


def logprobs(chat: ChatLogprobs | None) -> list[Logprob] | None:
    if chat is None or not chat.content:
        return None
    return [
        Logprob(t.token, t.logprob, t.bytes, [TopLogprob(a.token, a.logprob, a.bytes) for a in t.top_logprobs])
        for t in chat.content
    ]
