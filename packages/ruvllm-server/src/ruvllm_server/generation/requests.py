"""From an OpenAI request's fields to the engine's requests: the adapter the model name picks, the
chat prompt rendered by the template, the sampling parameters (stop strings, logit bias, the output
constraint) checked against the context, the prompts of a completions request."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import jinja2

from ruvllm.engine.types import GenerationRequest
from ruvllm.errors import RequestError, RuvllmError
from ruvllm.sampling import SamplingParams
from ruvllm.structured import StructuredOutput
from ruvllm_server.errors import bad_request, model_not_found
from ruvllm_server.schemas import ChatCompletionRequest, ChatMessage, SamplingFields
from ruvllm_server.tools import template_knows_tools

if TYPE_CHECKING:
    from ruvllm_server.state import ServerState

#: Most stop strings per request.
MAX_STOP_STRINGS = 16


def check_model(state: ServerState, name: str | None) -> Any:
    """The LoRA adapter ``name`` picks (None: the base model); an unknown name is a 404."""
    if name is None or name == state.model_name or name in state.aliases:
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
            found.append(StructuredOutput.json_schema(rf.json_schema.schema, strict=rf.json_schema.strict is True))
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
    speculative: bool | None = None,
) -> GenerationRequest:
    """The engine request of one prompt. ``user`` is the client's claim (OpenAI ``user``), the key id
    its fallback; only ``metadata["api_key_id"]`` is authenticated, so plugins that scope state by
    key (SONA's ``api_key`` scope) read that. ``speculative=False``: the request opts out of speculative
    decoding."""
    metadata: dict[str, Any] = {"api_key_id": api_key_id} if api_key_id else {}
    return GenerationRequest(
        prompt,
        params,
        request_id=request_id,
        user=user or api_key_id,
        metadata=metadata,
        adapter=adapter,
        speculative=speculative is not False,
    )
