"""Hook specifications of ruvllm: one function per hook; backends and plugins implement them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from ruvllm.backend import Backend
    from ruvllm.inference import InferenceRequest, InferenceResult

hookspec = pluggy.HookspecMarker("ruvllm")
hookimpl = pluggy.HookimplMarker("ruvllm")


@hookspec
def register_backends(register: Callable[[Backend], None]) -> None:
    """Register the backends this plugin provides by calling ``register(backend)`` with objects
    implementing :class:`ruvllm.backend.Backend` (core then calls the chosen one's ``load`` and the
    loaded :class:`ruvllm.backend.BackendModel`'s methods directly; no per-step hook)."""


@hookspec
def register_commands(subparsers: Any) -> None:
    """Add ``ruvllm`` sub-commands: ``subparsers`` is the CLI's argparse sub-parser action; set
    ``func`` with ``set_defaults``: the CLI calls ``func(args, host)`` with the parsed args and the
    :class:`ruvllm.plugins.PluginHost`, and exits with what it returns (an int, None meaning 0)."""


@hookspec
def pre_inference(request: InferenceRequest) -> None:
    """Inspect or adjust a request (sampling, adapter choice) before it is scheduled."""


@hookspec
def post_inference(request: InferenceRequest, result: InferenceResult) -> None:
    """Observe a finished request and its result (tokens, text, timings)."""


@hookspec
def register_tool_parsers(register: Callable[[type], None]) -> None:
    """Register tool-call parsers by calling ``register(cls)`` with subclasses of
    :class:`ruvllm.tools.ToolParser` (a ``name`` and a ``parse`` method); the server picks one by
    name (``--tool-call-parser``) or from the chat template's tool format."""


@hookspec
def register_reasoning_parsers(register: Callable[[type], None]) -> None:
    """Register reasoning parsers by calling ``register(cls)`` with subclasses of
    :class:`ruvllm.reasoning.ReasoningParser`; the server picks one with ``--reasoning-parser``."""


@dataclass(frozen=True)
class RouteContext:
    """What a host (the server) tells plugins that add HTTP routes."""

    #: Options given to plugins, by plugin name: ``--plugin-option sona.scope=user`` gives
    #: ``{"sona": {"scope": "user"}}``.
    options: Mapping[str, Mapping[str, str]]
    #: ``api_key_id(request)``: the authenticated caller's non-secret key id (None without keys).
    api_key_id: Callable[[Any], str | None]


@hookspec
def register_routes(register: Callable[[Any], None], context: RouteContext) -> None:
    """Add HTTP routes to the server: call ``register(handler_or_router)`` with Litestar route
    handlers or routers (mounted at the server's root; use paths under ``/v1``). Only plugins whose
    options ask for it should add anything."""


@hookspec
def model_loaded(model: Any, options: Mapping[str, Mapping[str, str]]) -> None:
    """The served model (a ``ruvllm.runtime.LoadedModel``) is loaded, before its engine starts;
    ``options`` are the plugin options by plugin name (a plugin attaches what it needs here)."""


@hookspec
def model_unloading(model: Any) -> None:
    """The server is stopping and its engine has drained: save and release what ``model_loaded`` set
    up. Called from a worker thread; may block."""
