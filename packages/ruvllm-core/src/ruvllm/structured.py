"""Constrained decoding: output that always parses, enforced token by token with llguidance.

A request's constraint is a :class:`StructuredOutput` (a JSON schema, any JSON object, a regex, a
choice of strings or a Lark/GBNF grammar, as OpenAI's ``response_format`` and vLLM's
``structured_outputs`` / ``guided_*`` fields ask). :class:`GrammarCompiler` turns it into an
llguidance grammar once per distinct text (an LRU cache) and checks it against the model's
tokenizer, so a schema or grammar llguidance cannot compile is a :class:`~ruvllm.errors.RequestError`
that names the request parameter. Each choice of a request then gets a :class:`Constraint`: an
``LLMatcher`` that computes the set of allowed next tokens (a bitmask) and advances with every
sampled token.

The mask for the next token is computed on a worker thread as soon as the previous token is
consumed, so it is ready (llguidance releases the GIL) while the model runs its next forward step;
the sampler only waits for it when the step was faster. Backends see nothing of this: the sampler
masks the logits row on the host.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ruvllm.errors import RequestError

if TYPE_CHECKING:
    from ruvllm.tokenizer import Tokenizer

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. ``value``: the JSON schema (text), the regex, the JSON list of
    choices, or the grammar (Lark, or llama.cpp's GBNF); unused for ``json_object``. ``param`` names
    the request field it came from, for errors."""

    kind: Kind
    value: str = ""
    param: str = "response_format"
    #: OpenAI's strict mode (``json_schema`` only): required properties first, each object's keys in
    #: the schema's order, and numbers with a bounded count of digits (see :func:`strict_json_lark`).
    strict: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(
                f"{self.param}: unknown constraint {self.kind!r} (known: {', '.join(KINDS)})", param=self.param
            )

    @classmethod
    def json_schema(
        cls, schema: Any, param: str = "response_format.json_schema.schema", strict: bool = False
    ) -> StructuredOutput:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise RequestError(f"{param}: not valid JSON ({exc.msg} at {exc.pos})", param=param) from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param=param)
        # Key order is kept: llguidance writes an object's properties in the schema's order.
        return cls("json_schema", json.dumps(schema), param, strict)

    @classmethod
    def choice(cls, options: Any, param: str = "structured_outputs.choice") -> StructuredOutput:
        if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
            raise RequestError(f"{param}: must be a non-empty list of strings", param=param)
        return cls("choice", json.dumps(options), param)

    def llguidance_grammar(self) -> str:
        """The llguidance grammar text (not yet checked against a tokenizer)."""
        from llguidance import LLMatcher, grammar_from

        try:
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if self.kind == "json_schema" and self.strict:
                return grammar_from("lark", strict_json_lark(json.loads(self.value)))
            if self.kind == "json_schema":
                return LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_OPTIONS)
            if self.kind == "grammar":
                return grammar_from("grammar", self.value)
            return grammar_from(self.kind, self.value)
        except ValueError as exc:
            raise RequestError(f"{self.param}: {_one_line(str(exc))}", param=self.param) from None


#: JSON whitespace between tokens: free, as models like to pretty-print, but at most 32 characters per
#: gap, so whitespace alone cannot run a greedy decode to max_tokens. A schema's ``x-guidance``
#: options override it.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,32}"}


#: Strict mode's numbers: at most 16 digits before and after the point and a 3-digit exponent, so a
#: small model cannot run a number to max_tokens (a float64 holds about 16 significant digits anyway).
STRICT_NUMBER = r"/-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,3})?/"
STRICT_INTEGER = r"/-?(0|[1-9][0-9]{0,15})/"
#: Strict mode's whitespace between tokens: spaces or tabs, or one line break and an indent (at most 16
#: characters either way). Compact and pretty-printed JSON both fit; a sampled run of blank lines or
#: tabs does not, so one gap costs a token or two, not up to 32 (the SDK's ``parse`` raises when
#: ``max_tokens`` cuts the object).
STRICT_WHITESPACE = r"[\x20\x09]{1,16}|\x0D?\x0A[\x20\x09]{0,16}"

#: Keywords that only annotate a schema; they do not change what it matches.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated"})


def strict_json_lark(schema: Any) -> str:
    """A Lark grammar (llguidance's dialect) for ``schema`` in OpenAI's strict form.

    Objects with ``additionalProperties: false`` write their required properties first, in the
    schema's order, then the optional ones in order, each optional; unbounded numbers and integers
    take at most 16 digits each side of the point. Whatever else (strings, enums, bounded numbers,
    open objects) is an embedded ``%json`` sub-grammar, so llguidance keeps its own semantics there.
    Whitespace between tokens is bounded more tightly than outside strict mode (:data:`STRICT_WHITESPACE`,
    or the schema's ``x-guidance``)."""
    return _StrictLark(schema).grammar()


class _StrictLark:
    def __init__(self, schema: Any) -> None:
        self.root = schema
        root = schema if isinstance(schema, dict) else {}
        self.defs: dict[str, Any] = {}
        for where in ("$defs", "definitions"):
            for name, sub in (root.get(where) or {}).items():
                self.defs[f"#/{where}/{name}"] = sub
        self.options = {**JSON_OPTIONS, "whitespace_pattern": STRICT_WHITESPACE, **(root.get("x-guidance") or {})}
        pattern = self.options.get("whitespace_pattern")
        if pattern is None and self.options.get("whitespace_flexible", True):
            pattern = r"[\x20\x0A\x0D\x09]+"
        self.ws = "WS? " if pattern else ""
        self.ws_rule = f"WS: /{pattern}/" if pattern else ""
        self.rules: list[str] = []
        self.refs: dict[str, str] = {}

    def grammar(self) -> str:
        start = self.rule(self.root)
        lines = [f"start: {start}", *self.rules, f"NUMBER: {STRICT_NUMBER}", f"INTEGER: {STRICT_INTEGER}"]
        if self.ws_rule:
            lines.append(self.ws_rule)
        return "\n".join(lines) + "\n"

    def _new(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def _sep(self, text: str) -> str:
        return f" {self.ws}{json.dumps(text)} {self.ws}"

    def embed(self, schema: Any) -> str:
        """llguidance's own JSON grammar for ``schema`` (with the root's definitions)."""
        sub = dict(schema) if isinstance(schema, dict) else {"anyOf": [schema]} if schema is False else {}
        if self.defs and "$ref" in json.dumps(sub):
            for where in ("$defs", "definitions"):
                if where in self.root:
                    sub.setdefault(where, self.root[where])
        sub["x-guidance"] = self.options
        return self._new(f"%json {json.dumps(sub)}")

    def rule(self, schema: Any) -> str:
        if not isinstance(schema, dict):
            return self.embed(schema)
        keys = set(schema) - _ANNOTATIONS - {"$defs", "definitions", "x-guidance", "$schema", "$id"}
        if keys == {"$ref"} and schema["$ref"] in self.defs:
            ref = schema["$ref"]
            if ref not in self.refs:
                # The name exists before its body, so a recursive definition refers to itself.
                self.refs[ref] = name = f"r{len(self.rules)}"
                self.rules.append("")
                self.rules[int(name[1:])] = f"{name}: {self.rule(self.defs[ref])}"
            return self.refs[ref]
        if keys == {"anyOf"} and isinstance(schema["anyOf"], list) and schema["anyOf"]:
            return self._new(" | ".join(self.rule(s) for s in schema["anyOf"]))
        kind = schema.get("type")
        if (
            isinstance(kind, list)
            and kind
            and keys <= {"type", "properties", "required", "additionalProperties", "items"}
        ):
            return self._new(" | ".join(self.rule({**schema, "type": k}) for k in kind))
        if kind == "number" and keys == {"type"}:
            return self._new("NUMBER")
        if kind == "integer" and keys == {"type"}:
            return self._new("INTEGER")
        if kind == "object" and keys <= {"type", "properties", "required", "additionalProperties"}:
            return self._object(schema)
        if (
            kind == "array"
            and keys <= {"type", "items", "minItems", "maxItems"}
            and isinstance(schema.get("items"), dict)
        ):
            return self._array(schema)
        return self.embed(schema)

    def _object(self, schema: dict[str, Any]) -> str:
        props = schema.get("properties") or {}
        required = schema.get("required") or []
        if schema.get("additionalProperties", True) is not False or not set(required) <= set(props):
            return self.embed(schema)
        members = {
            k: f"{json.dumps(json.dumps(k, ensure_ascii=False), ensure_ascii=False)} {self._sep(':')}{self.rule(v)}"
            for k, v in props.items()
        }
        must = [members[k] for k in props if k in required]
        may = [members[k] for k in props if k not in required]
        comma = self._sep(",")
        if must:
            body = comma.join(must) + "".join(f" ({comma}{m})?" for m in may)
        elif may:
            # The first optional member written carries no comma before it.
            body = (
                "("
                + " | ".join(may[i] + "".join(f" ({comma}{m})?" for m in may[i + 1 :]) for i in range(len(may)))
                + ")?"
            )
        else:
            body = ""
        return self._new(f'"{{" {self.ws}{body} {self.ws}"}}"')

    def _array(self, schema: dict[str, Any]) -> str:
        item = self.rule(schema["items"])
        lo, hi = int(schema.get("minItems", 0)), schema.get("maxItems")
        comma = self._sep(",")
        if hi is not None and int(hi) == 0:
            inner = ""
        elif hi is not None and int(hi) == 1:
            inner = item if lo else f"({item})?"
        else:
            more_lo = max(lo - 1, 0)
            more = f"({comma}{item})" + ("*" if hi is None else f"{{{more_lo},{int(hi) - 1}}}")
            if hi is None and more_lo:
                more = f"({comma}{item}){{{more_lo},}}"
            inner = f"{item} {more}"
            if lo == 0:
                inner = f"({inner})?"
        return self._new(f'"[" {self.ws}{inner} {self.ws}"]"')


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class GrammarCompiler:
    """llguidance's view of one tokenizer plus a cache of checked grammars (by constraint text).

    ``vocab_size`` is the width of the model's logits rows (at least the tokenizer's vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int = 256):
        from llguidance import LLTokenizer

        eos = [int(t) for t in eos_token_ids] or None
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.ll_tokenizer = LLTokenizer(tokenizer.inner.to_str(), n_vocab=self.vocab_size, eos_token=eos)
        self._cache: OrderedDict[tuple[str, str, bool], str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def grammar(self, spec: StructuredOutput) -> str:
        """The checked llguidance grammar of ``spec``; a grammar llguidance rejects raises
        :class:`RequestError` naming ``spec.param``."""
        from llguidance import LLMatcher

        key = (spec.kind, spec.value, spec.strict)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return self._cache[key]
        grammar = spec.llguidance_grammar()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise RequestError(
                f"{spec.param}: cannot be compiled: {_one_line(messages[0] if messages else '')}", param=spec.param
            )
        with self._lock:
            self.misses += 1
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def constraint(self, spec: StructuredOutput) -> Constraint:
        return Constraint(self, self.grammar(spec), spec)


#: Mask computations run here, off the engine thread (llguidance drops the GIL while it computes).
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ruvllm-grammar")


class Constraint:
    """One choice's matcher: the allowed next tokens, advanced by every sampled token."""

    def __init__(self, compiler: GrammarCompiler, grammar: str, spec: StructuredOutput) -> None:
        from llguidance import LLMatcher

        self.spec = spec
        self._vocab = compiler.vocab_size
        self._matcher = LLMatcher(compiler.ll_tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise RequestError(
                f"{spec.param}: cannot be compiled: {_one_line(self._matcher.get_error())}", param=spec.param
            )
        self._words = (self._vocab + 31) // 32
        self._future: Future[np.ndarray] | None = None
        self.mask_wait_seconds = 0.0
        # The matcher is touched by one thread at a time: the worker while a mask is computed, the
        # engine thread otherwise (llguidance's objects refuse concurrent borrows). Its state is
        # read once per token, here and in consume().
        self._finished = False
        self._schedule()

    def _compute(self) -> np.ndarray:
        from llguidance.numpy import fill_next_token_bitmask

        bits = np.zeros((1, self._words), np.int32)
        fill_next_token_bitmask(self._matcher, bits, 0)
        return np.unpackbits(bits.view(np.uint8), bitorder="little")[: self._vocab].astype(bool)

    def _schedule(self) -> None:
        self._future = None if self.finished else _POOL.submit(self._compute)

    def allowed(self) -> np.ndarray:
        """bool ``[vocab]``: the tokens the grammar allows next (EOS once the output is complete)."""
        if self._future is None:
            self._future = _POOL.submit(self._compute)
        if not self._future.done():
            t0 = time.perf_counter()
            out = self._future.result()
            self.mask_wait_seconds += time.perf_counter() - t0
            return out
        return self._future.result()

    def consume(self, token: int) -> None:
        """Advance past the sampled ``token`` and start computing the next mask."""
        if self._future is not None:
            self._future.result()  # the matcher is not shared with a running computation
            self._future = None
        self._matcher.consume_token(int(token))
        self._finished = self._matcher.is_stopped() or self._matcher.is_error()
        self._schedule()

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (the output should stop here)."""
        return self._finished
