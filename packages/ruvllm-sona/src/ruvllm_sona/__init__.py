"""ruvllm SONA plugin: MicroLoRA instant loop, EWC++ background consolidation, deep loop, ReasoningBank."""

__version__ = "0.1.0"
