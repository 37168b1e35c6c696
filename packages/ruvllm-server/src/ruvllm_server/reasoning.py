"""Reasoning models: split a chat answer into ``reasoning_content`` (the model's thinking) and
``content``, as vLLM's ``--reasoning-parser`` and DeepSeek's API do.

A :class:`ReasoningParser` names the tags around the thinking. ``think`` (Qwen3, QwQ):
``<think> ... </think>`` then the answer; ``deepseek_r1``: the chat template already opened
``<think>`` in the prompt, so the output starts inside it and everything before ``</think>`` is
thinking. Parsers are
found by name in :func:`reasoning_parsers`: the built-in ones plus those plugins register through
the ``register_reasoning_parsers`` hook (:mod:`ruvllm_server.hookspecs`). (This module was
``ruvllm.reasoning``; that name forwards here for one more release, with a DeprecationWarning.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ruvllm_server.hookspecs import server_hooks

if TYPE_CHECKING:
    from ruvllm.plugins import PluginHost


@dataclass
class ReasoningSplit:
    reasoning: str | None
    content: str


class ReasoningParser:
    """Tags around the thinking; :meth:`split` for a whole answer, :meth:`feed` for a stream."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = ""
    end: ClassVar[str] = ""
    #: The output may begin inside the thinking (the template opened it in the prompt).
    starts_inside: ClassVar[bool] = True

    def __init__(self) -> None:
        self._buf = ""
        self._state = "before"  # before (start tag not seen), inside, after

    def split(self, text: str) -> ReasoningSplit:
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start) :]
        elif self.starts_inside:
            body = text
        else:
            return ReasoningSplit(None, text)
        at = body.find(self.end)
        if at < 0:  # thinking that never ended: all of it is thinking
            return ReasoningSplit(body, "")
        return ReasoningSplit(body[:at], body[at + len(self.end) :])

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) text to emit now from the next streamed ``piece``; text that may be
        the start of a tag is held until the next piece (or ``final``). The pieces of a whole answer
        add up to :meth:`split` of it."""
        self._buf += piece
        reasoning, content = "", ""
        while True:
            if self._state == "after":
                content += self._buf
                self._buf = ""
                return reasoning, content
            if self._state == "before":
                stripped = self._buf.lstrip()
                if stripped.startswith(self.start):
                    self._buf = stripped[len(self.start) :]
                    self._state = "inside"
                elif self.start.startswith(stripped) and not final:
                    return reasoning, content  # may still become the start tag
                else:
                    self._state = "inside" if self.starts_inside else "after"
                continue
            at = self._buf.find(self.end)
            if at >= 0:
                reasoning += self._buf[:at]
                self._buf = self._buf[at + len(self.end) :]
                self._state = "after"
                continue
            keep = 0 if final else _partial_suffix(self._buf, self.end)
            reasoning += self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep :]
            return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ThinkParser(ReasoningParser):
    """Qwen3 / QwQ: thinking only when the output opens ``<think>``."""

    name = "think"
    start = "<think>"
    end = "</think>"
    starts_inside = False


class DeepSeekR1Parser(ThinkParser):
    """DeepSeek-R1: the template opens ``<think>`` in the prompt, so the output starts inside it
    (everything before ``</think>`` is thinking; no ``</think>``: all of it)."""

    name = "deepseek_r1"
    starts_inside = True


BUILTIN_REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (ThinkParser, DeepSeekR1Parser)}


def reasoning_parsers(host: PluginHost | None = None) -> dict[str, type[ReasoningParser]]:
    """Built-in parsers plus those plugins register (``register_reasoning_parsers(register)``)."""
    found = dict(BUILTIN_REASONING_PARSERS)
    if host is not None:

        def register(cls: type[ReasoningParser]) -> None:
            if not (isinstance(cls, type) and issubclass(cls, ReasoningParser) and cls.name and cls.end):
                raise TypeError(f"register_reasoning_parsers: {cls!r} is not a named ReasoningParser subclass")
            found[cls.name] = cls

        server_hooks(host).register_reasoning_parsers(register=register)
    return found
