"""The engine's public request and output types (the server and the CLI speak only these)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ruvllm.sampling import SamplingParams


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    prompt: str | None = None
    #: OpenAI ``user`` or the API key id; plugins (SONA) may scope adapters by it.
    user: str | None = None
    #: Lower runs first under the priority policy; ignored under FCFS.
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    #: Opaque values for plugins (e.g. the server's ``api_key_id``); the engine hands a shallow copy
    #: to the hooks as ``InferenceRequest.metadata``.
    metadata: dict[str, Any] = field(default_factory=dict)
    #: A LoRA adapter (:class:`ruvllm.backend.LoraAdapter`, e.g. a loaded PEFT adapter) to run this
    #: request with; plugins see it in ``pre_inference``.
    adapter: Any = None
    #: False: this request never drafts, even on an engine with speculative decoding on.
    speculative: bool = True


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)
    #: 1 + how many tokens the model found likelier (prompt logprobs; None for sampled tokens).
    rank: int | None = None


@dataclass
class ChoiceDelta:
    """What one choice (of ``n``) produced since the previous output."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    #: ``stop`` (eos, stop string or stop token), ``length``, ``abort``; None while running.
    finish_reason: str | None = None
    #: The stop string or stop token id that ended this choice, when one did.
    stop_reason: str | int | None = None


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time: float = 0.0
    ttft: float = 0.0
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e: float = 0.0


@dataclass
class RequestOutput:
    request_id: str
    deltas: list[ChoiceDelta]
    finished: bool
    #: Filled on every output; final figures once ``finished``.
    metrics: RequestMetrics
    #: With ``SamplingParams.prompt_logprobs``: one entry per prompt token (None for the first), on
    #: the first output after the prompt is computed; None on every other output.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EngineStats:
    #: Sequences (choices) running and waiting.
    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    preemptions: int
    prefix_cache_hit_tokens: int
    prefix_cache_queried_tokens: int
    #: Requests with a sequence running, and requests with none running yet.
    running_requests: int = 0
    waiting_requests: int = 0
    block_size: int = 16
    #: Names of the adapters of running / waiting requests (adapters without a name are not listed).
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    #: A hybrid KV cache's windowed-layer pool (``blocks_*`` count the global layers' pool); 0 without.
    local_blocks_used: int = 0
    local_blocks_total: int = 0
    #: Speculative decoding: draft tokens verified, those kept, and verification chunks run.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    #: Steps that ran a forward, the seconds they took in all, and the seconds of those spent in the
    #: model's forward (the backend's step; a launched step's from its launch to its logits, the work
    #: the engine did beside it included). The difference is the engine's own work outside the
    #: forward: scheduling, step inputs, sampling, detokenizing, drafting (with the pipelined decode
    #: step, only what the next step waits for).
    steps: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    #: Steps launched while the step before them still ran (the pipelined decode step: their
    #: schedule and inputs were built, and the step before's outputs made, while the model ran).
    pipelined_steps: int = 0

    @property
    def engine_seconds(self) -> float:
        """The steps' time outside the model's forward."""
        return self.step_seconds - self.forward_seconds

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Kept draft tokens per verified one (None before any draft)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None
