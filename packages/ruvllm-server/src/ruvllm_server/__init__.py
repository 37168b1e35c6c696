"""ruvllm OpenAI-compatible server (Litestar)."""

__version__ = "0.1.0"
