"""A request as plugins see it in pre_inference / post_inference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ruvllm.sampling import SamplingParams


@dataclass
class InferenceRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    prompt: str | None = None
    #: Who asked (OpenAI ``user`` field, or the API key's id): plugins may scope state by it.
    user: str | None = None
    #: Set by a plugin (e.g. SONA) to run this request with an adapter inside the forward pass.
    adapter: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Set by a plugin to choose an adapter from the prompt itself: called once, when the prompt has
    #: run without an adapter, with the final-norm hidden state (float32 ``[hidden]``) at its last
    #: token, before the first token is sampled. Returning an adapter reruns the prompt with it (the
    #: request's first token then comes from the adapted model); None keeps the base model's run.
    #: Ignored when ``adapter`` is set. Requires a backend whose capabilities include hidden states.
    adapter_router: Callable[[np.ndarray], Any] | None = None
    #: The :class:`ruvllm.runtime.LoadedModel` that serves it (set by the engine): plugins that keep
    #: state per model (SONA) find theirs by it.
    model: Any = None


@dataclass
class ChoiceResult:
    """One choice of a finished request."""

    index: int
    output_token_ids: list[int]
    text: str
    finish_reason: str


@dataclass
class InferenceResult:
    """A finished request. ``output_token_ids``, ``text`` and ``finish_reason`` are choice 0's;
    ``choices`` holds every choice of an ``n > 1`` request (choice 0 first)."""

    request_id: str
    output_token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int = 0
    #: Seconds: time queued, time to first token, end to end.
    queue_time: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    choices: list[ChoiceResult] = field(default_factory=list)
