"""A SONA learner on a tiny random-weight Llama checkpoint (milliseconds per capture) and helpers to
feed it requests through its hooks, for the tests of its bookkeeping: scopes, persistence, HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from _candle_compat_fixtures import write_tiny_hf_checkpoint

from ruvllm.checkpoint import open_checkpoint
from ruvllm.inference import InferenceRequest, InferenceResult
from ruvllm.sampling import SamplingParams
from ruvllm_sona import Sona, SonaConfig


def tiny_checkpoint(path: Path) -> Any:
    return open_checkpoint(write_tiny_hf_checkpoint(path, layers=2, hidden=48, vocab=97, max_positions=128))


def tiny_sona(path: Path, config: SonaConfig | None = None, **kw: Any) -> Sona:
    kw.setdefault("start", False)
    return Sona(tiny_checkpoint(path), config or SonaConfig(), **kw)


def serve(sona: Sona, request_id: str, prompt: list[int], output: list[int], user: str | None = None,
          metadata: dict | None = None) -> InferenceRequest:
    """What the engine does around one request: pre_inference, then post_inference with ``output``."""
    request = InferenceRequest(request_id, list(prompt), SamplingParams(), user=user, metadata=dict(metadata or {}))
    sona.pre_inference(request)
    sona.post_inference(request, InferenceResult(request_id, list(output), "", "stop", len(prompt)))
    return request


def random_tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 97, n).tolist()


def drain(sona: Sona) -> None:
    while sona.run_cycle()["captured"]:
        pass
