"""The engine's log probabilities in OpenAI's shapes (chat, legacy completions, echoed prompts) and
vLLM's ``prompt_logprobs``; ``-inf``, which JSON cannot carry, clamped to :data:`MIN_LOGPROB`."""

from __future__ import annotations

from collections.abc import Callable

from ruvllm.engine.types import TokenLogprob
from ruvllm_server.schemas import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, TopLogprob

#: Stand-in for ``-inf`` log probabilities, which JSON cannot carry.
MIN_LOGPROB = -9999.0


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
