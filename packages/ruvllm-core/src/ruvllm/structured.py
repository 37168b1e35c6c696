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
    from llguidance._lib import JsonCompileOptions

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
            if self.kind == "json_schema":
                return grammar_from("lark", json_lark(json.loads(self.value), strict=self.strict))
            if self.kind == "grammar":
                return grammar_from("grammar", self.value)
            return grammar_from(self.kind, self.value)
        except ValueError as exc:
            raise RequestError(f"{self.param}: {_one_line(str(exc))}", param=self.param) from None


#: Strict mode's numbers: at most 16 digits before and after the point and a 3-digit exponent, so a
#: small model cannot run a number to max_tokens (a float64 holds about 16 significant digits anyway).
STRICT_NUMBER = r"/-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,3})?/"
STRICT_INTEGER = r"/-?(0|[1-9][0-9]{0,15})/"
#: JSON whitespace between tokens: spaces or tabs, or one line break and an indent (at most 16
#: characters either way). Compact and pretty-printed JSON both fit; a sampled run of blank lines or
#: tabs does not, so one gap costs a token or two (at 32 free characters a gap, greedy SmolLM2 filled
#: every gap with line breaks and ran to max_tokens; the SDK's ``parse`` raises when ``max_tokens``
#: cuts the object). The same in strict mode and out of it.
STRICT_WHITESPACE = r"[\x20\x09]{1,16}|\x0D?\x0A[\x20\x09]{0,16}"
#: llguidance's JSON options: the whitespace above. A schema's ``x-guidance`` options override them.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": STRICT_WHITESPACE}

#: Keywords that only annotate a schema; they do not change what it matches.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated"})
#: A number's or integer's keywords that :func:`bounded_number_regex` writes itself.
_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
#: Digits a number may take each side of the point (more than a float64 tells apart), unless its bounds
#: need more before it.
MAX_DIGITS = 16


def strict_json_lark(schema: Any) -> str:
    """A Lark grammar (llguidance's dialect) for ``schema`` in OpenAI's strict form.

    Objects with ``additionalProperties: false`` write their required properties first, in the
    schema's order, then the optional ones in order, each optional; numbers and integers take at most
    16 digits each side of the point (bounded ones: :func:`bounded_number_regex`). Whatever else
    (strings, enums, open objects) is an embedded ``%json`` sub-grammar, so llguidance keeps its own
    semantics there. Whitespace between tokens: :data:`STRICT_WHITESPACE`, or the schema's
    ``x-guidance``."""
    return _JsonLark(schema, strict=True).grammar()


def json_lark(schema: Any, strict: bool = False) -> str:
    """A Lark grammar (llguidance's dialect) for ``schema``: :func:`strict_json_lark` when ``strict``,
    else llguidance's own JSON (properties in the schema's order, whitespace per :data:`JSON_OPTIONS`)
    except that numbers and integers take at most 16 digits each side of the point, bounded or not,
    so a greedy decode cannot run a fraction to max_tokens."""
    return _JsonLark(schema, strict=strict).grammar()


def bounded_number_regex(schema: dict[str, Any]) -> str | None:
    """A lexeme (llguidance's regex syntax, ``&`` intersecting) for the numbers ``schema`` allows
    within its ``minimum``/``maximum`` (JSON Schema's exclusive forms too, numeric or draft 4's
    booleans): no exponent, at most 16 fraction digits (none for ``integer``), at most 16 integer
    digits unless a bound has more. ``None`` when the bounds are not numbers, have more than 16
    fraction digits (for ``number``), or leave no such number: llguidance's own grammar decides then.
    """
    from decimal import Decimal, InvalidOperation

    def bound(plain: str, exclusive: str, pick: Any) -> tuple[Decimal | None, bool] | None:
        found: list[tuple[Decimal, bool]] = []
        for key, excl in ((plain, schema.get(exclusive) is True), (exclusive, True)):
            value = schema.get(key)
            if value is None or isinstance(value, bool):
                continue
            if not isinstance(value, (int, float)):
                return None
            try:
                found.append((Decimal(str(value)), excl))
            except InvalidOperation:
                return None
        if not found:
            return (None, False)
        # The tighter bound wins; at a tie the exclusive one is the tighter.
        return pick(found, key=lambda b: (b[0], b[1] if pick is max else not b[1]))

    lower, upper = bound("minimum", "exclusiveMinimum", max), bound("maximum", "exclusiveMaximum", min)
    if lower is None or upper is None or not all(d is None or d.is_finite() for d in (lower[0], upper[0])):
        return None
    (lo, lo_excl), (hi, hi_excl) = lower, upper
    integer = schema.get("type") == "integer"
    if not integer and any(d is not None and len(_digits(abs(d))[1]) > MAX_DIGITS for d in (lo, hi)):
        return None
    if lo is not None and hi is not None:
        if integer:
            first = lo.to_integral_value("ROUND_FLOOR") + 1 if lo_excl else lo.to_integral_value("ROUND_CEILING")
            last = hi.to_integral_value("ROUND_CEILING") - 1 if hi_excl else hi.to_integral_value("ROUND_FLOOR")
            if first > last:
                return None
        elif lo > hi or (lo == hi and (lo_excl or hi_excl)):
            return None
    width = max([MAX_DIGITS] + [len(_digits(abs(d))[0]) for d in (lo, hi) if d is not None])
    cap = f"(0|[1-9][0-9]{{0,{width - 1}}})" + ("" if integer else rf"(\.[0-9]{{1,{MAX_DIGITS}}})?")
    lexemes = []
    if hi is None or hi > 0 or (hi == 0 and not hi_excl):  # from max(lo, 0) up, written without a sign
        parts = [cap]
        if lo is not None and (lo > 0 or (lo == 0 and lo_excl)):
            parts.append(_at_least(lo, lo_excl))
        if hi is not None:
            parts.append(_at_most(hi, hi_excl))
        lexemes.append(" & ".join(f"/{p}/" for p in parts))
    if lo is None or lo < 0:  # the numbers below zero (and -0), a minus sign before their magnitude
        parts = [cap]
        if hi is not None and (hi < 0 or (hi == 0 and hi_excl)):  # an exclusive 0 leaves out -0 too
            parts.append(_at_least(-hi, hi_excl))
        if lo is not None:
            parts.append(_at_most(-lo, lo_excl))
        lexemes.append(" & ".join(f"/-({p})/" for p in parts))
    return " | ".join(f"({x})" for x in lexemes)


def _digits(value: Any) -> tuple[str, str]:
    """A non-negative decimal's integer digits (no leading zeros, ``"0"`` for none) and fraction
    digits (no trailing zeros)."""
    whole, _, fraction = format(value, "f").partition(".")
    return whole.lstrip("0") or "0", fraction.rstrip("0")


def _repeat(n: int) -> str:
    return f"[0-9]{{{n}}}" if n else ""


def _at_least(bound: Any, exclusive: bool) -> str:
    """Unsigned decimals (no leading zeros, no exponent) >= ``bound`` (> when ``exclusive``)."""
    whole, frac = _digits(bound)
    # A longer integer part, or as long and greater at its first differing digit.
    above = [f"[1-9][0-9]{{{len(whole)},}}"]
    above += [f"{whole[:i]}[{int(c) + 1}-9]{_repeat(len(whole) - i - 1)}" for i, c in enumerate(whole) if c != "9"]
    # The same integer part: a fraction greater at its first differing digit, or the bound's own
    # digits followed by any (by a non-zero digit somewhere, when exclusive).
    fractions = [f"{frac[:i]}[{int(c) + 1}-9][0-9]*" for i, c in enumerate(frac) if c != "9"]
    fractions.append(frac + ("[0-9]*[1-9][0-9]*" if exclusive else "[0-9]*" if frac else "[0-9]+"))
    same = rf"{whole}\.({'|'.join(fractions)})"
    if not frac and not exclusive:
        same = rf"{whole}(\.({'|'.join(fractions)}))?"
    return rf"({'|'.join(above)})(\.[0-9]+)?|{same}"


def _at_most(bound: Any, exclusive: bool) -> str:
    """Unsigned decimals (no leading zeros, no exponent) <= ``bound`` (< when ``exclusive``)."""
    whole, frac = _digits(bound)
    n = len(whole)
    # A shorter integer part, or as long and smaller at its first differing digit.
    below = ["0", f"[1-9][0-9]{{0,{n - 2}}}"] if n > 1 else []
    for i, c in enumerate(whole):
        first = 1 if i == 0 and n > 1 else 0
        if int(c) - 1 >= first:
            below.append(f"{whole[:i]}[{first}-{int(c) - 1}]{_repeat(n - i - 1)}")
    # The same integer part: a fraction smaller at its first differing digit, or a prefix of the
    # bound's digits followed by zeros (all of them only when not exclusive).
    fractions = [f"{frac[:i]}[0-{int(c) - 1}][0-9]*" for i, c in enumerate(frac) if c != "0"]
    fractions += [f"{frac[:k]}0*" for k in range(1, len(frac) + (0 if exclusive else 1))]
    if not frac and not exclusive:
        fractions.append("0+")
    alternatives = [rf"({'|'.join(below)})(\.[0-9]+)?"] if below else []
    point = rf"\.({'|'.join(fractions)})" if fractions else ""
    if frac or not exclusive:  # the integer part alone is below (or at) the bound
        alternatives.append(f"{whole}({point})?" if point else whole)
    # (An exclusive integer bound has no fraction below it with the same integer part; the bound is
    # never an exclusive 0 here, so something is always below it.)
    return "|".join(alternatives)


class _JsonLark:
    def __init__(self, schema: Any, strict: bool) -> None:
        self.root = schema
        self.strict = strict
        root = schema if isinstance(schema, dict) else {}
        self.defs: dict[str, Any] = {}
        for where in ("$defs", "definitions"):
            for name, sub in (root.get(where) or {}).items():
                self.defs[f"#/{where}/{name}"] = sub
        self.options = {**JSON_OPTIONS, **(root.get("x-guidance") or {})}
        pattern = self.options.get("whitespace_pattern")
        if pattern is None and self.options.get("whitespace_flexible", True):
            pattern = r"[\x20\x0A\x0D\x09]+"
        self.ws = "WS? " if pattern else ""
        self.ws_rule = f"WS: /{pattern}/" if pattern else ""
        self.rules: list[str] = []
        self.terminals: list[str] = []
        self.refs: dict[str, str] = {}

    def grammar(self) -> str:
        start = self.rule(self.root)
        lines = [f"start: {start}", *self.rules, *self.terminals]
        lines += [f"NUMBER: {STRICT_NUMBER}", f"INTEGER: {STRICT_INTEGER}"]
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
        if kind in ("number", "integer") and keys - {"type"} <= _BOUNDS:
            lexeme = bounded_number_regex(schema)
            if lexeme is not None:
                name = f"BOUNDED{len(self.terminals)}"
                self.terminals.append(f"{name}: {lexeme}")
                return self._new(name)
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
        # Strict mode writes the required members first; llguidance's own order is the schema's.
        order = [k for k in props if k in required] + [k for k in props if k not in required]
        body = self._members([(members[k], k in required) for k in (order if self.strict else props)])
        return self._new(f'"{{" {self.ws}{body} {self.ws}"}}"')

    def _members(self, members: list[tuple[str, bool]]) -> str:
        """``members`` in order, the optional ones optional, a comma between each two written."""
        comma = self._sep(",")
        later = ""  # the members from here on once one was written: each with its comma before it
        first = ""  # the members from here on when none was written yet
        for i in reversed(range(len(members))):
            member, needed = members[i]
            if needed:
                first = f"{member} {later}"
            else:
                first = f"({member} {later} | {first})" if first else f"({member} {later})?"
            if i:
                later = self._new(f"{comma}{member} {later}" if needed else f"({comma}{member})? {later}")
        return first

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
