"""Tool calling: the grammars that force a call, and the parsers that find calls in free text.

``tool_choice`` ``required`` or a named function is enforced by a JSON-schema constraint
(:func:`required_schema`, :func:`named_schema`), so the arguments always validate against the
function's ``parameters``. Under ``auto`` the model writes what it likes and a :class:`ToolParser`
extracts calls in the format its chat template taught it (``hermes``: ``<tool_call>{...}</tool_call>``
as Qwen2.5/Qwen3 and Hermes templates do; ``llama3_json``: Llama 3.x's JSON with ``parameters``;
``mistral``: ``[TOOL_CALLS][...]``; ``gpt_oss``: harmony messages to ``functions.NAME``; ``json``: a
bare JSON object or list, the format :func:`tool_system_prompt` asks for from models whose template
knows no tools).

Parsers are found by name in :func:`tool_parsers`: the built-in ones plus those plugins add through
the ``register_tool_parsers`` hook (:mod:`ruvllm_server.hookspecs`), so a third party adds a format
without touching the server. (This module was ``ruvllm.tools``; that name forwards here for one more
release, with a DeprecationWarning.)
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ruvllm.errors import RequestError
from ruvllm_server.hookspecs import server_hooks

if TYPE_CHECKING:
    from ruvllm.plugins import PluginHost


@dataclass(frozen=True)
class ToolCall:
    name: str
    #: The arguments as JSON text (what the OpenAI API sends).
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


class ToolParser(ABC):
    """Finds tool calls in a model's output. Subclasses set ``name`` and ``markers`` (text that starts
    a call: in a stream, text before a marker is content, text from it on is held until the end) and
    implement :meth:`parse`."""

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()
    #: Markers count only at the very start of the output (after whitespace).
    markers_at_start: ClassVar[bool] = False
    #: The markers are special tokens: the output must be decoded with ``skip_special_tokens=False``.
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedOutput:
        """The content (None when the output is only calls) and the calls in ``text``; text that is
        not a well-formed call of one of ``tools`` comes back whole as content."""

    def call_start(self, text: str) -> int | None:
        """Where the first call starts in ``text`` (None: no call yet)."""
        if self.markers_at_start:
            stripped = text.lstrip()
            offset = len(text) - len(stripped)
            return offset if any(stripped.startswith(m) for m in self.markers) else None
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def may_start(self, text: str) -> int:
        """Length of the suffix of ``text`` that could still grow into a marker (held back in streams)."""
        if self.markers_at_start:
            stripped = text.lstrip()
            return len(text) if any(m.startswith(stripped) for m in self.markers) else 0
        for k in range(min(len(text), max((len(m) for m in self.markers), default=0) - 1), 0, -1):
            if any(m.startswith(text[-k:]) for m in self.markers):
                return k
        return 0


def _tool_names(tools: Sequence[Mapping[str, Any]]) -> set[str]:
    return {t.get("function", {}).get("name") for t in tools if isinstance(t, Mapping)}


def _call_from(obj: Any, names: set[str], args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, Mapping) or obj.get("name") not in names:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, Mapping):
        return None
    return ToolCall(str(obj["name"]), json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> tuple[list[Any], bool]:
    """Consecutive JSON values at the start of ``text`` (separated by whitespace, commas or
    semicolons), and whether they are all of it (no prose after them)."""
    decoder = json.JSONDecoder()
    out: list[Any] = []
    i = 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i >= len(text):
            return out, True
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return out, False
        out.append(value)


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedOutput:
        names = _tool_names(tools)
        calls = []
        for body in self._BLOCK.findall(text):
            values, _ = _json_values(body)
            call = _call_from(values[0], names) if values else None
            if call is None:
                return ParsedOutput(text, [])  # not a well-formed call: the text is the answer
            calls.append(call)
        if not calls:
            return ParsedOutput(text, [])
        content = text[: text.find("<tool_call>")].strip()
        return ParsedOutput(content or None, calls)


class JsonParser(ToolParser):
    """A bare JSON object ``{"name": ..., "arguments": {...}}`` or a list of them (optionally in a
    ```json fence): what :func:`tool_system_prompt` asks for."""

    name = "json"
    markers = ("{", "[", "```")
    markers_at_start = True
    _FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedOutput:
        body = text
        m = self._FENCE.match(text)
        if m:
            body = m.group(1)
        values, whole = _json_values(body)
        if len(values) == 1 and isinstance(values[0], list):
            values = values[0]
        names = _tool_names(tools)
        calls = [_call_from(v, names) for v in values]
        if not whole or not calls or any(c is None for c in calls):
            return ParsedOutput(text, [])
        return ParsedOutput(None, [c for c in calls if c is not None])


class Llama3JsonParser(JsonParser):
    """Llama 3.x: ``<|python_tag|>`` (optional) then ``{"name": ..., "parameters": {...}}`` objects
    separated by ``;``."""

    name = "llama3_json"
    markers = ("<|python_tag|>", "{")

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedOutput:
        return super().parse(text.replace("<|python_tag|>", "", 1), tools)


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedOutput:
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return ParsedOutput(text, [])
        values, _ = _json_values(text[at + len("[TOOL_CALLS]") :])
        if len(values) == 1 and isinstance(values[0], list):
            values = values[0]
        names = _tool_names(tools)
        calls = [_call_from(v, names) for v in values]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text, [])
        content = text[:at].strip()
        return ParsedOutput(content or None, [c for c in calls if c is not None])


# -- gpt-oss's harmony format ---------------------------------------------------------------------
# An assistant turn is a run of messages, each ``<|start|>assistant`` (omitted on the first: the
# prompt ends with it), a header naming the channel (``<|channel|>analysis``: thinking; ``final``: the
# answer; ``commentary``: preambles and tool calls) and, for a call, the recipient
# (``to=functions.NAME``, in the channel part or the role part), then ``<|message|>`` and the body,
# closed by ``<|end|>``, ``<|return|>`` (the turn's end) or ``<|call|>`` (a call's end). These are
# special tokens: the text keeps them only when decoded with ``skip_special_tokens=False``.

HARMONY_START = "<|start|>"
HARMONY_CHANNEL = "<|channel|>"
HARMONY_MESSAGE = "<|message|>"
#: Tokens that close a message's body.
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
#: Text that closes a body: one of :data:`HARMONY_ENDS`, or the next header begun without one.
HARMONY_BODY_END = re.compile(r"<\|(?:end|return|call|start|channel)\|>")
#: The start of a message addressed to a recipient (a tool call): its ``<|start|>`` or
#: ``<|channel|>``, or (``_AT_START``) the output's start when the role part carries the recipient
#: (``to=functions.NAME<|channel|>commentary json<|message|>``: the prompt wrote ``<|start|>assistant``).
_HEAD = r"(?:(?!<\|(?:message|start|end|return|call)\|>).)*?(?<![^\s>|])to="
_HARMONY_CALL_HEAD = re.compile(rf"(?:<\|start\|>|<\|channel\|>){_HEAD}", re.S)
_HARMONY_CALL_HEAD_AT_START = re.compile(rf"(?:<\|start\|>|<\|channel\|>|^\s*(?=to=)){_HEAD}", re.S)


def harmony_header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a harmony message header (the text before ``<|message|>``)."""
    channel = re.search(r"<\|channel\|>\s*([^\s<]+)", header)
    recipient = re.search(r"(?<![^\s>|])to=([^\s<]+)", header)
    return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None)


class GptOssParser(ToolParser):
    """gpt-oss (harmony): a call is a message to ``functions.NAME``, its body the JSON arguments
    (``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``). The
    content is the text before the first call, as the ``gpt_oss`` reasoning parser leaves it (the
    answer's text, unwrapped) or raw harmony text without that parser."""

    name = "gpt_oss"
    markers = (HARMONY_START, HARMONY_CHANNEL)
    keeps_special_tokens = True

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedOutput:
        names = _tool_names(tools)
        calls, first = [], None
        for head in _HARMONY_CALL_HEAD_AT_START.finditer(text):
            at = text.find(HARMONY_MESSAGE, head.end())
            recipient = re.match(r"[^\s<]+", text[head.end() :])
            if at < 0 or recipient is None or not recipient.group().startswith("functions."):
                return ParsedOutput(text, [])  # cut short, or a built-in tool (browser, python): not ours
            body_start = at + len(HARMONY_MESSAGE)
            end = HARMONY_BODY_END.search(text, body_start)
            values, whole = _json_values(text[body_start : end.start() if end else len(text)])
            call = None
            if len(values) == 1 and whole:
                call = _call_from({"name": recipient.group()[len("functions.") :], "arguments": values[0]}, names)
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            first = head.start() if first is None else first
        if first is None:
            return ParsedOutput(text, [])
        return ParsedOutput(text[:first].strip() or None, calls)

    def call_start(self, text: str) -> int | None:
        # Not the role-part form: a stream's pending text starts anywhere, and the gpt_oss reasoning
        # parser writes that form's <|start|>assistant back in front of it.
        head = _HARMONY_CALL_HEAD.search(text)
        return head.start() if head else None

    def may_start(self, text: str) -> int:
        # A header not closed by <|message|> may still name a recipient: hold it whole.
        after = text.rfind(HARMONY_MESSAGE)
        after = 0 if after < 0 else after + len(HARMONY_MESSAGE)
        opens = [i for i in (text.find(HARMONY_START, after), text.find(HARMONY_CHANNEL, after)) if i >= 0]
        if opens:
            return len(text) - min(opens)
        return super().may_start(text)


BUILTIN_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, JsonParser, Llama3JsonParser, MistralParser, GptOssParser)
}


def tool_parsers(host: PluginHost | None = None) -> dict[str, type[ToolParser]]:
    """Built-in parsers plus those plugins register (``register_tool_parsers(register)`` where
    ``register(parser_class)``); a plugin's parser may replace a built-in one of the same name."""
    found = dict(BUILTIN_PARSERS)
    if host is not None:

        def register(cls: type[ToolParser]) -> None:
            if not (isinstance(cls, type) and issubclass(cls, ToolParser) and cls.name):
                raise TypeError(f"register_tool_parsers: {cls!r} is not a named ToolParser subclass")
            found[cls.name] = cls

        server_hooks(host).register_tool_parsers(register=register)
    return found


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's tool format calls for (``json`` when it has none)."""
    t = template or ""
    if HARMONY_CHANNEL in t:
        return "gpt_oss"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("ipython" in t and "<|start_header_id|>" in t):
        return "llama3_json"
    return "json"


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template or "") is not None


def tool_system_prompt(tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    """Instructions for a model whose chat template has no tool format (the ``json`` parser reads
    the answer)."""
    specs = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False, indent=1)
    many = " or a JSON list of such objects to call several" if parallel else ""
    return (
        "You can call these functions:\n"
        f"{specs}\n"
        'To call a function, reply with only a JSON object {"name": <function name>, "arguments": <arguments object>}'
        f"{many}. Otherwise answer normally."
    )


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    params = tool.get("function", {}).get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def named_schema(tools: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any]:
    """The output schema when ``tool_choice`` names ``name``: its arguments object itself."""
    for t in tools:
        if t.get("function", {}).get("name") == name:
            return _parameters(t)
    raise RequestError(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")


def _nested_parameters(tool: Mapping[str, Any], index: int, defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters for a schema that nests them: a ``$ref`` resolves against the root, so the
    parameters' own ``$defs`` / ``definitions`` (Pydantic writes them for nested models) move into
    ``defs`` under names of their own (``t<index>.<name>``: two tools may both define ``Place``), and
    their references follow."""
    params = _parameters(tool)
    moved = {
        f"#/{where}/{name}": f"#/$defs/t{index}.{name}"
        for where in ("$defs", "definitions")
        if isinstance(params.get(where), dict)
        for name in params[where]
    }
    if not moved:
        return params

    def follow(node: Any) -> Any:
        if isinstance(node, list):
            return [follow(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: follow(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str):
            for old, new in moved.items():
                if ref == old or ref.startswith(old + "/"):
                    out["$ref"] = new + ref[len(old) :]
        return out

    for where in ("$defs", "definitions"):
        for name, sub in (params.get(where) or {}).items():
            defs[f"t{index}.{name}"] = follow(sub)
    return follow({k: v for k, v in params.items() if k not in ("$defs", "definitions")})


def required_schema(tools: Sequence[Mapping[str, Any]], parallel: bool) -> dict[str, Any]:
    """The output schema under ``tool_choice: required``: a JSON list of ``{"name", "arguments"}``
    objects, one shape per tool (one call unless ``parallel``)."""
    defs: dict[str, Any] = {}
    shapes = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "arguments": _nested_parameters(t, i, defs)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, t in enumerate(tools)
    ]
    items = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def calls_from_required(text: str) -> list[ToolCall]:
    """The calls of an output made under :func:`required_schema`."""
    return [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in json.loads(text)]


#: The opening of a call under :func:`required_schema`: its name (the grammar writes it first), then
#: the key of its arguments.
_CALL_NAME = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_CALL_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*')


def calls_from_partial_required(text: str) -> list[ToolCall]:
    """The calls of an output under :func:`required_schema` that stopped early (max_tokens): every
    complete call, then the unfinished one with its arguments as far as they got (as a named forced
    call returns them), if its name was written."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    i = text.find("[") + 1
    if i == 0:
        return calls
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        if isinstance(obj, Mapping) and "name" in obj:
            calls.append(ToolCall(str(obj["name"]), json.dumps(obj.get("arguments", {}), ensure_ascii=False)))
    head = _CALL_NAME.match(text, i)
    if head is not None:
        args = _CALL_ARGUMENTS.match(text, head.end())
        calls.append(ToolCall(json.loads(head.group(1)), text[args.end() :].rstrip() if args else ""))
    return calls


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's ``tools``: a list of ``{"type": "function", "function": {"name", "parameters"?, ...}}``."""
    if not isinstance(tools, list) or not tools:
        raise RequestError("tools must be a non-empty list", param="tools")
    seen = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(fn, Mapping):
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise RequestError(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}", param=f"tools[{i}]")
        if name in seen:
            raise RequestError(f"tools[{i}]: function {name!r} is defined twice", param=f"tools[{i}]")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", param=f"tools[{i}]")
    return [dict(t) for t in tools]
