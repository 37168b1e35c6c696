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

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(
                f"{self.param}: unknown constraint {self.kind!r} (known: {', '.join(KINDS)})", param=self.param
            )

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format.json_schema.schema") -> StructuredOutput:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise RequestError(f"{param}: not valid JSON ({exc.msg} at {exc.pos})", param=param) from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param=param)
        return cls("json_schema", json.dumps(schema, sort_keys=True), param)

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
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def grammar(self, spec: StructuredOutput) -> str:
        """The checked llguidance grammar of ``spec``; a grammar llguidance rejects raises
        :class:`RequestError` naming ``spec.param``."""
        from llguidance import LLMatcher

        key = (spec.kind, spec.value)
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
