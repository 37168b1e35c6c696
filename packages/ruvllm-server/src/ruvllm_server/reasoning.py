"""Reasoning models: split a chat answer into ``reasoning_content`` (the model's thinking) and
``content``, as vLLM's ``--reasoning-parser`` and DeepSeek's API do.

A :class:`ReasoningParser` names the tags around the thinking. ``think`` (Qwen3, QwQ):
``<think> ... </think>`` then the answer; ``deepseek_r1``: the chat template already opened
``<think>`` in the prompt, so the output starts inside it and everything before ``</think>`` is
thinking; ``gpt_oss``: OpenAI's harmony format, where the ``analysis`` channel is the thinking and
the ``final`` channel the answer (its markup is special tokens, kept in the text for it). Parsers are
found by name in :func:`reasoning_parsers`: the built-in ones plus those plugins register through
the ``register_reasoning_parsers`` hook (:mod:`ruvllm_server.hookspecs`). (This module was
``ruvllm.reasoning``; that name forwards here for one more release, with a DeprecationWarning.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ruvllm_server.hookspecs import server_hooks
from ruvllm_server.tools import (
    HARMONY_BODY_END,
    HARMONY_CHANNEL,
    HARMONY_ENDS,
    HARMONY_MESSAGE,
    HARMONY_START,
    harmony_header,
)

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
    #: The tags are special tokens: the output must be decoded with ``skip_special_tokens=False``.
    keeps_special_tokens: ClassVar[bool] = False

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


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss (OpenAI's harmony format, :mod:`ruvllm_server.tools` describes it): the ``analysis``
    channel's messages are the reasoning; the ``final`` channel's and commentary preambles' bodies
    are the content, without their markup; a message to a recipient (a tool call) stays in the
    content as written, whole, for the ``gpt_oss`` tool parser. Output that does not open with a
    harmony header is all content. The text must keep special tokens (``skip_special_tokens=False``)."""

    name = "gpt_oss"
    start = HARMONY_CHANNEL + "analysis" + HARMONY_MESSAGE
    keeps_special_tokens = True
    end = HARMONY_ENDS[0]
    #: What may open the output: the first message's header (the prompt wrote ``<|start|>assistant``).
    _OPENERS = (HARMONY_CHANNEL, HARMONY_START, " to=", "to=")
    _TOKENS = (HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE, *HARMONY_ENDS)

    def __init__(self) -> None:
        super().__init__()
        self._state = "open"  # open, plain, header, body, between
        self._kind = ""  # the body's: reasoning, content or call
        self._saw_reasoning = False

    def split(self, text: str) -> ReasoningSplit:
        # One reader for both, so a stream's pieces add up to the split of the whole.
        reader = type(self)()
        reasoning, content = reader.feed(text, final=True)
        return ReasoningSplit(reasoning if reader._saw_reasoning else None, content)

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self._buf += piece
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            buf = self._buf
            if self._state == "plain":
                content.append(buf)
                self._buf = ""
            elif self._state in ("open", "between"):
                opens = self._OPENERS if self._state == "open" else (HARMONY_START, HARMONY_CHANNEL)
                if buf.startswith(opens):
                    self._state = "header"
                elif not final and any(o.startswith(buf) for o in opens):
                    break  # may still become a header
                elif self._state == "open":
                    self._state = "plain"
                else:  # stray text between messages: content up to the next header
                    self._state, self._kind = "body", "content"
            elif self._state == "header":
                at = buf.find(HARMONY_MESSAGE)
                if at < 0:
                    if final:  # a header cut short says nothing
                        self._buf = ""
                    break
                header = buf[:at]
                channel, recipient = harmony_header(header)
                if recipient is not None:
                    self._kind = "call"
                    if not header.startswith(HARMONY_START) and not header.startswith(HARMONY_CHANNEL):
                        header = HARMONY_START + "assistant" + header  # the role part the prompt wrote
                    content.append(header + HARMONY_MESSAGE)
                elif channel == "analysis":
                    self._kind = "reasoning"
                    self._saw_reasoning = True
                else:
                    self._kind = "content"
                self._buf = buf[at + len(HARMONY_MESSAGE) :]
                self._state = "body"
            else:  # body
                out = reasoning if self._kind == "reasoning" else content
                end = HARMONY_BODY_END.search(buf)
                if end is None:
                    keep = 0 if final else max(_partial_suffix(buf, t) for t in self._TOKENS)
                    out.append(buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    break
                out.append(buf[: end.start()])
                closed = end.group() in HARMONY_ENDS
                if closed and self._kind == "call":
                    content.append(end.group())
                self._buf = buf[end.end() :] if closed else buf[end.start() :]
                self._state = "between"
        return "".join(reasoning), "".join(content)


BUILTIN_REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (ThinkParser, DeepSeekR1Parser, GptOssReasoningParser)
}


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
