"""Generation: from OpenAI requests to engine requests, and from engine outputs to OpenAI responses
and SSE streams.

One job a module. :mod:`~ruvllm_server.generation.requests` turns a request's fields into engine
requests (the adapter, the rendered prompt, checked sampling parameters, the output constraint);
:mod:`~ruvllm_server.generation.run` runs them as one stream, aborting what is left when the client
goes; :mod:`~ruvllm_server.generation.chat` and :mod:`~ruvllm_server.generation.completions` build
the two endpoints' responses and streams, with :mod:`~ruvllm_server.generation.chat_tools` for what
tools do to a chat, :mod:`~ruvllm_server.generation.logprobs` for log probabilities in OpenAI's
shapes and :mod:`~ruvllm_server.generation.sse` for the events themselves.
"""

from ruvllm_server.generation.chat import ChatJob
from ruvllm_server.generation.chat_tools import ChoiceTools, ToolSetup, tool_setup
from ruvllm_server.generation.completions import COMPLETIONS_DEFAULT_MAX_TOKENS, MAX_CHOICES, CompletionJob
from ruvllm_server.generation.logprobs import (
    MIN_LOGPROB,
    chat_logprobs,
    completion_logprobs,
    echoed_prompt_logprobs,
    prompt_logprobs_vllm,
)
from ruvllm_server.generation.requests import (
    MAX_STOP_STRINGS,
    build_sampling,
    check_model,
    completion_prompts,
    encode_chat,
    engine_request,
    message_dicts,
    structured_output,
)
from ruvllm_server.generation.run import ChoiceAccumulator, Run, cancel_on_disconnect
from ruvllm_server.generation.sse import SSE_DONE, sse

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "MAX_CHOICES",
    "MAX_STOP_STRINGS",
    "MIN_LOGPROB",
    "SSE_DONE",
    "ChatJob",
    "ChoiceAccumulator",
    "ChoiceTools",
    "CompletionJob",
    "Run",
    "ToolSetup",
    "build_sampling",
    "cancel_on_disconnect",
    "chat_logprobs",
    "check_model",
    "completion_logprobs",
    "completion_prompts",
    "echoed_prompt_logprobs",
    "encode_chat",
    "engine_request",
    "message_dicts",
    "prompt_logprobs_vllm",
    "sse",
    "structured_output",
    "tool_setup",
]
