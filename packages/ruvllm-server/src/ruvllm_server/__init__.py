"""ruvllm OpenAI-compatible server (Litestar): ``ruvllm serve MODEL`` or ``create_app(settings)``."""

__version__ = "0.1.0"
