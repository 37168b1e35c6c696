"""Hook specifications the server adds to core's plugin manager: HTTP routes, tool-call parsers and
reasoning parsers. Only the server calls them, so core's :mod:`ruvllm.hookspecs` does not hold them;
plugins implement them with the same marker (``from ruvllm import hookimpl``), and the server adds
these specifications to the plugin host before it calls them (:func:`server_hooks`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from litestar import Request
    from litestar.types import ControllerRouterHandler

    from ruvllm.plugins import PluginHost
    from ruvllm.runtime import LoadedModel
    from ruvllm_server.reasoning import ReasoningParser
    from ruvllm_server.tools import ToolParser

hookspec = pluggy.HookspecMarker("ruvllm")


def _no_model() -> LoadedModel | None:
    return None


@dataclass(frozen=True)
class RouteContext:
    """What the server tells plugins that add HTTP routes."""

    #: Options given to plugins, by plugin name: ``--plugin-option sona.scope=user`` gives
    #: ``{"sona": {"scope": "user"}}``.
    options: Mapping[str, Mapping[str, str]]
    #: ``api_key_id(request)``: the authenticated caller's non-secret key id (None without keys).
    api_key_id: Callable[[Request], str | None]
    #: ``model()``: the model this server serves, once loaded (None before: routes are registered
    #: when the app is built, and the model may load after startup). A plugin that keeps state per
    #: model (SONA's learner) finds the served model's through it.
    model: Callable[[], LoadedModel | None] = _no_model


@hookspec
def register_routes(register: Callable[[ControllerRouterHandler], None], context: RouteContext) -> None:
    """Add HTTP routes to the server: call ``register(handler_or_router)`` with Litestar route
    handlers or routers (mounted at the server's root; use paths under ``/v1``). Only plugins whose
    options ask for it should add anything."""


@hookspec
def register_tool_parsers(register: Callable[[type[ToolParser]], None]) -> None:
    """Register tool-call parsers by calling ``register(cls)`` with subclasses of
    :class:`ruvllm_server.tools.ToolParser` (a ``name`` and a ``parse`` method); the server picks one
    by name (``--tool-call-parser``) or from the chat template's tool format."""


@hookspec
def register_reasoning_parsers(register: Callable[[type[ReasoningParser]], None]) -> None:
    """Register reasoning parsers by calling ``register(cls)`` with subclasses of
    :class:`ruvllm_server.reasoning.ReasoningParser`; the server picks one with ``--reasoning-parser``."""


def server_hooks(host: PluginHost) -> pluggy.HookRelay:
    """``host``'s hooks with the server's specifications added (once; a host built by core's
    :func:`ruvllm.plugins.load_plugins` knows only core's)."""
    host.add_hookspecs(sys.modules[__name__])
    return host.hook
