"""Hook specifications of ruvllm: one function per hook; backends and plugins implement them.

Hooks only the server calls (HTTP routes, tool-call and reasoning parsers) are specified in
``ruvllm_server.hookspecs``, which the server adds to the plugin host; plugins implement both kinds
with the one marker, :data:`hookimpl`."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from ruvllm.backend import Backend
    from ruvllm.inference import InferenceRequest, InferenceResult
    from ruvllm.runtime import LoadedModel

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
def model_loaded(model: LoadedModel, options: Mapping[str, Mapping[str, str]]) -> None:
    """A host (the server) loaded the model it serves, before its engine starts; ``options`` are the
    plugin options by plugin name (a plugin attaches what it needs here)."""


@hookspec
def model_unloading(model: LoadedModel) -> None:
    """The host is stopping and the model's engine has drained: save and release what
    ``model_loaded`` set up (a backend releases what it holds beside the model). Called from a worker
    thread; may block."""


def __getattr__(name: str) -> Any:
    # RouteContext moved with the server's hooks; kept importable from here for one release.
    if name == "RouteContext":
        warnings.warn(
            "ruvllm.hookspecs.RouteContext moved to ruvllm_server.hookspecs.RouteContext; the old name goes "
            "away in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        from ruvllm_server.hookspecs import RouteContext

        return RouteContext
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
