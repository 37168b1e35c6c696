"""Deprecated: reasoning parsers moved to :mod:`ruvllm_server.reasoning` (only the server uses them).
This module forwards their names for one release."""

import warnings

warnings.warn(
    "ruvllm.reasoning moved to ruvllm_server.reasoning; the old module goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)

try:
    from ruvllm_server.reasoning import (
        BUILTIN_REASONING_PARSERS,
        DeepSeekR1Parser,
        ReasoningParser,
        ReasoningSplit,
        ThinkParser,
        reasoning_parsers,
    )
except ImportError as exc:  # the server package is not installed
    raise ImportError(f"ruvllm.reasoning moved to ruvllm_server.reasoning: pip install ruvllm-server ({exc})") from exc

__all__ = [
    "BUILTIN_REASONING_PARSERS",
    "DeepSeekR1Parser",
    "ReasoningParser",
    "ReasoningSplit",
    "ThinkParser",
    "reasoning_parsers",
]
