"""Deprecated: tool calling moved to :mod:`ruvllm_server.tools` (only the server uses it). This module
forwards its names for one release."""

import warnings

warnings.warn(
    "ruvllm.tools moved to ruvllm_server.tools; the old module goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)

try:
    from ruvllm_server.tools import (
        BUILTIN_PARSERS,
        HermesParser,
        JsonParser,
        Llama3JsonParser,
        MistralParser,
        ParsedOutput,
        ToolCall,
        ToolParser,
        calls_from_required,
        check_tools,
        named_schema,
        parser_for_template,
        required_schema,
        template_knows_tools,
        tool_parsers,
        tool_system_prompt,
    )
except ImportError as exc:  # the server package is not installed
    raise ImportError(f"ruvllm.tools moved to ruvllm_server.tools: pip install ruvllm-server ({exc})") from exc

__all__ = [
    "BUILTIN_PARSERS",
    "HermesParser",
    "JsonParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedOutput",
    "ToolCall",
    "ToolParser",
    "calls_from_required",
    "check_tools",
    "named_schema",
    "parser_for_template",
    "required_schema",
    "template_knows_tools",
    "tool_parsers",
    "tool_system_prompt",
]
