"""What SONA keeps about requests and reports about its loops: held trajectories, deep-loop samples,
feedback receipts and deep-run reports (plain data, no behaviour)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ruvllm_sona.capture import Capture
from ruvllm_sona.lora import SonaAdapter


@dataclass
class Trajectory:
    request_id: str
    scope: str
    prompt_ids: list[int]
    completion_ids: list[int]
    adapter: SonaAdapter
    created: float
    correction_of: str | None = None
    #: The latest feedback score (the bank keeps it as the trajectory's quality).
    score: float | None = None
    capture: Capture | None = None
    capture_error: str | None = None
    #: Per-token weight the instant loop applies once the capture exists (None: nothing pending).
    pending_weight: float | None = None
    #: The backend's final-norm hidden state at the prompt's last token (the gate's key), when the
    #: request went through SONA's router.
    key: np.ndarray | None = None


@dataclass
class Sample:
    """A stored deep-loop sample: tokens, per-token weight, the base residual once known."""

    request_id: str
    token_ids: list[int]
    num_prompt: int
    weight: float
    residual: np.ndarray | None = None


@dataclass(frozen=True)
class FeedbackReceipt:
    response_id: str
    scope: str
    #: ``applied``: the instant step ran; ``queued``: it runs once the trajectory is recomputed.
    status: str
    advantage: float
    adapter_version: int


@dataclass(frozen=True)
class DeepRunReport:
    scope: str
    samples: int
    steps: int
    seconds: float
    #: Mean weighted negative log-likelihood per token over the first and the last epoch.
    first_epoch_loss: float
    last_epoch_loss: float
    adapter_version: int
