"""A request as plugins see it in pre_inference / post_inference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


@dataclass
class InferenceResult:
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
