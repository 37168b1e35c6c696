"""Per-request and per-choice state: tokens, sampling state, streamed text and stop conditions."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from ruvllm.adapters import XLoraAdapter
from ruvllm.engine.types import GenerationRequest, RequestMetrics, TokenLogprob
from ruvllm.inference import InferenceRequest
from ruvllm.sampling import Sampler, SamplingParams

_seq_ids = itertools.count()


class StopStringText:
    """Turns detokenized pieces into output text that never shows a stop string.

    Text that could be the start of a stop string is held back until the next piece shows whether
    it is; when a stop string appears (also across token boundaries) the text is cut just before it.
    """

    def __init__(self, stop: list[str]) -> None:
        self.stop = list(stop)
        self._longest = max((len(s) for s in stop), default=0)
        self.held = ""

    def feed(self, piece: str, check_stops: bool) -> tuple[str, str | None]:
        """Text now safe to emit, and the stop string found (None if none)."""
        buf = self.held + piece
        if check_stops and self.stop:
            found = self._first_stop(buf)
            if found is not None:
                self.held = ""
                return buf[: found[0]], found[1]
        keep = self._held_suffix_len(buf)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def finish(self, piece: str, check_stops: bool) -> tuple[str, str | None]:
        """The remaining text once no more tokens come."""
        buf = self.held + piece
        self.held = ""
        if check_stops and self.stop:
            found = self._first_stop(buf)
            if found is not None:
                return buf[: found[0]], found[1]
        return buf, None

    def _first_stop(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _held_suffix_len(self, buf: str) -> int:
        # Longest suffix of buf that is a proper prefix of some stop string.
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


@dataclass
class RequestState:
    """One request in the engine: its (possibly plugin-adjusted) parameters and its choices."""

    request: GenerationRequest
    inference: InferenceRequest
    sampling: SamplingParams
    prompt_token_ids: list[int]
    #: Admission order; FCFS order and the tie-breaker under the priority policy.
    order: int
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    first_scheduled: float | None = None
    last_token_time: float | None = None
    #: The adapter router (``inference.adapter_router``) has been asked.
    routed: bool = False
    #: Prompt logprobs by position, filled as prompt chunks run (``sampling.prompt_logprobs``).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def adapter(self) -> Any:
        return self.inference.adapter

    @property
    def finished(self) -> bool:
        return bool(self.seqs) and (self.forked or self.sampling.n == 1) and all(s.finished for s in self.seqs)


class Sequence:
    """One choice of a request: its tokens (prompt then output), KV progress and output stream."""

    def __init__(self, state: RequestState, index: int, sampler: Sampler, detokenizer: Any) -> None:
        self.seq_id = next(_seq_ids)
        self.state = state
        self.index = index
        self.token_ids: list[int] = list(state.prompt_token_ids)
        self.num_prompt_tokens = len(state.prompt_token_ids)
        #: Tokens whose keys/values are in the KV cache.
        self.num_computed = 0
        #: Prefix-cache hits when this sequence was first admitted (None until then).
        self.num_cached_tokens: int | None = None
        self.sampler = sampler
        self.detokenizer = detokenizer
        self.text = StopStringText(state.sampling.stop)
        self.output_text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # What the next output reports for this choice.
        self.new_token_ids: list[int] = []
        self.new_text = ""
        self.new_logprobs: list[TokenLogprob] = []
        self.finish_reported = False
        #: Draft tokens proposed for the next step (speculative decoding; the scheduler may cut them).
        self.draft: list[int] = []
        #: The proposer's index over this sequence and its draft length (speculative decoding).
        self.speculation: Any = None
        #: A draft model's probabilities at each drafted position (sampled requests), until verified.
        self.draft_q: Any = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cacheable(self) -> bool:
        # An adapter changes the keys/values a token produces: such sequences neither reuse nor
        # publish cached blocks.
        return self.state.adapter is None

    @property
    def shadow_id(self) -> tuple[str, int] | None:
        """An X-LoRA request's choice runs a shadow sequence (its scaling pass) beside it, with KV
        blocks of its own under this id; None for every other sequence."""
        return ("xlora-shadow", self.seq_id) if isinstance(self.state.adapter, XLoraAdapter) else None

    @property
    def reuses_prefix(self) -> bool:
        """Whether admission may take cached prefix blocks: not when the prompt's logprobs are
        asked for (cached positions are never recomputed, so they would have none)."""
        return self.cacheable and self.state.sampling.prompt_logprobs is None

    def emit_text(self, text: str) -> None:
        self.new_text += text
        self.output_text += text

    def __repr__(self) -> str:
        return f"Sequence({self.state.request.request_id}#{self.index}, {len(self.token_ids)} tokens)"
