"""Sampling parameters: what a request asks of the sampler, and their validation.

The engine validates them when a request is added (:meth:`SamplingParams.validate`); the host
samplers (:mod:`ruvllm.sampling.reference`, :mod:`ruvllm.sampling.batch`) apply them, and so do
backends that sample on their device, from the rows :func:`ruvllm.sampling.device_sampling` builds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ruvllm.errors import RequestError

if TYPE_CHECKING:
    from ruvllm.structured import StructuredOutput


@dataclass
class SamplingParams:
    """How one request's tokens are chosen (OpenAI's and vLLM's parameters); the order in which they
    apply is :class:`~ruvllm.sampling.reference.Sampler`'s."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # number of top logprobs to return per token (0 = chosen token only)
    #: Log-probabilities of the prompt's tokens under the model (the first has none), with this many
    #: top alternatives each; None: not computed. Such a request recomputes its whole prompt (no
    #: prefix-cache hits: cached positions have no logits).
    prompt_logprobs: int | None = None
    #: Leave special tokens (``<|im_start|>``...) out of the output text; token ids keep them.
    skip_special_tokens: bool = True
    #: Output must match this (JSON schema, regex, choice, grammar); see :mod:`ruvllm.structured`.
    structured: StructuredOutput | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(msg: str) -> None:
            raise RequestError(msg)

        if self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            bad(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad(f"stop strings must be non-empty strings, got {s!r}")
        for tok in self.stop_token_ids:
            if vocab_size is not None and not 0 <= int(tok) < vocab_size:
                bad(f"stop token id {tok} is outside the vocabulary (0..{vocab_size - 1})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        for tok, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= int(tok) < vocab_size:
                bad(f"logit_bias token id {tok} is outside the vocabulary (0..{vocab_size - 1})")
            if not -100.0 <= bias <= 100.0:
                bad(f"logit_bias values must be in [-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
