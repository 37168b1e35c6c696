"""ruvllm: a plugin-based LLM inference framework."""

from ruvllm.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["__version__", "hookimpl"]
