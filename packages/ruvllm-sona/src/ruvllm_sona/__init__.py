"""ruvllm SONA plugin: MicroLoRA adapters applied inside the forward pass, an instant loop that
learns from feedback with exact gradients, EWC++ background consolidation, a deep fine-tuning loop
and a ReasoningBank. See docs/sona.md."""

from ruvllm_sona.config import SonaConfig
from ruvllm_sona.errors import FeedbackError, SonaError, SonaStateError, UnknownResponseError
from ruvllm_sona.lora import SonaAdapter
from ruvllm_sona.sona import DeepRunReport, FeedbackReceipt, Sona

__version__ = "0.1.0"

__all__ = [
    "DeepRunReport",
    "FeedbackError",
    "FeedbackReceipt",
    "Sona",
    "SonaAdapter",
    "SonaConfig",
    "SonaError",
    "SonaStateError",
    "UnknownResponseError",
]
