"""The ``sona`` entry point: hooks that forward to the SONA instance attached to the served model.

SONA needs the model's weights, which hooks do not receive, so whoever loads the model attaches it::

    from ruvllm_sona.plugin import attach
    sona = attach(loaded_model, SonaConfig(scope="user"), state_dir="~/.ruvllm/sona")

Until then the hooks do nothing (``GET /v1/sona/stats`` says so). Several models in one process may
each have their own learner: the hooks find a request's by the model the engine names on it
(``InferenceRequest.model``).

In the server SONA is a plugin like any other: with the plugin option ``sona.enabled=true``
(``ruvllm serve --sona`` sets it; ``sona.scope``, ``sona.state_dir`` too) its ``model_loaded`` hook
attaches it, ``register_routes`` adds ``POST /v1/feedback`` and ``GET /v1/sona/stats``, and
``model_unloading`` saves and detaches it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from ruvllm.backend import AdapterLimits
from ruvllm.hookspecs import hookimpl
from ruvllm_sona import attached
from ruvllm_sona.config import SonaConfig
from ruvllm_sona.errors import SonaError
from ruvllm_sona.http import sona_router
from ruvllm_sona.sona import Sona

if TYPE_CHECKING:
    from ruvllm.inference import InferenceRequest, InferenceResult
    from ruvllm.runtime import LoadedModel

log = structlog.get_logger("ruvllm_sona")

def attach(model: LoadedModel, config: SonaConfig | None = None, *, state_dir: str | Path | None = None) -> Sona:
    """Create the SONA learner for ``model`` (kept on the model, ``model.plugin_state["sona"]``),
    start its background loop and make this module's hooks (registered with ``model.host`` if the
    entry point was filtered out) forward that model's requests to it. Several models may each have
    one; a model has at most one."""
    where = Path(state_dir).expanduser() if state_dir else None
    sona = attached.add(model, lambda: Sona.for_model(model, config, state_dir=where))
    if sona.config.gate:
        model.step_needs.add("hidden_states")  # the gate routes on them: the engine precompiles those steps
    # Steps carry the scopes' adapter snapshots: up to one per sequence (in-flight requests keep the
    # snapshot they started with, so even the global scope can have several in one step).
    model.expect_adapters("sona", AdapterLimits(sona.config.rank, tuple(sona.config.projections)))
    module = sys.modules[__name__]
    if not model.host.pm.is_registered(module):
        model.host.register(module, name="sona")
    return sona


def detach(model: LoadedModel | None = None, save: bool = True) -> None:
    """Stop the learner attached to ``model`` (None: every attached one), saving its state when it has
    a directory."""
    for m, sona in attached.remove(model):
        m.expect_adapters("sona", None)
        sona.close(save=save)


def active(model: LoadedModel | None = None) -> Sona | None:
    """The learner attached to ``model``; without one, the only attached learner in this process
    (None when there is none, or several)."""
    return attached.learner_of(model) if model is not None else attached.only()


def attached_models() -> int:
    """How many models have a learner attached in this process."""
    return attached.count()


def _for(request: InferenceRequest) -> Sona | None:
    # A request an engine built names its model; one built by hand goes to the only learner.
    return active(request.model) if request.model is not None else active()


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
#: SonaConfig fields a plugin option may set (scalars; ``sona.<field>=value``).
_SETTABLE = {f.name: f for f in dataclasses.fields(SonaConfig) if f.name not in ("projections", "layers")}


def _enabled(options: Mapping[str, Mapping[str, str]]) -> Mapping[str, str] | None:
    mine = options.get("sona") or {}
    flag = str(mine.get("enabled", "false")).lower()
    if flag not in _TRUE + _FALSE:
        raise SonaError(f"plugin option sona.enabled must be true or false, got {mine.get('enabled')!r}")
    unknown = set(mine) - {"enabled", "state_dir"} - set(_SETTABLE)
    if unknown:
        raise SonaError(f"unknown plugin option(s) {', '.join(sorted('sona.' + k for k in unknown))} "
                        "(known: sona.enabled, sona.state_dir and SonaConfig's scalar fields, e.g. sona.scope, "
                        "sona.gate, sona.gate_threshold, sona.ewc_lambda, sona.deep_trigger)")  # fmt: skip
    return mine if flag in _TRUE else None


def config_from_options(mine: Mapping[str, str]) -> SonaConfig:
    """A SonaConfig from ``sona.<field>=value`` options, each parsed as its field's default's type."""
    values: dict[str, object] = {}
    for name, raw in mine.items():
        if name in ("enabled", "state_dir"):
            continue
        field = _SETTABLE[name]
        default = field.default
        text = str(raw).strip()
        try:
            if isinstance(default, bool) or str(field.type).startswith("bool"):  # (also ``bool | None``)
                if text.lower() not in _TRUE + _FALSE:
                    raise ValueError("expected true or false")
                values[name] = text.lower() in _TRUE
            elif isinstance(default, int):
                values[name] = int(text)
            elif isinstance(default, float):
                values[name] = float(text)
            else:
                values[name] = text
        except ValueError as exc:
            raise SonaError(f"plugin option sona.{name}={raw!r}: {exc}") from None
    return SonaConfig(**values)  # type: ignore[arg-type]


@hookimpl
def model_loaded(model: LoadedModel, options: Mapping[str, Mapping[str, str]]) -> None:
    mine = _enabled(options)
    if mine is None:
        return
    config = config_from_options(mine)
    attach(model, config, state_dir=mine.get("state_dir") or None)
    log.info("sona attached", scope=config.scope, gate=config.gate, state_dir=mine.get("state_dir"))


class _RouteContext(Protocol):
    """What SONA reads of the server's ``ruvllm_server.hookspecs.RouteContext`` (this package does not
    depend on the server)."""

    options: Mapping[str, Mapping[str, str]]

    def api_key_id(self, request: Any) -> str | None: ...

    def model(self) -> LoadedModel | None: ...


@hookimpl
def register_routes(register: Callable[[object], None], context: _RouteContext) -> None:
    if _enabled(context.options) is None:
        return
    # The served model's learner, looked up per request (the model may load after startup).
    register(sona_router(lambda: attached.learner_of(context.model()), api_key_id=context.api_key_id))


@hookimpl
def model_unloading(model: LoadedModel) -> None:
    detach(model)


@hookimpl
def pre_inference(request: InferenceRequest) -> None:
    sona = _for(request)
    if sona is not None:
        sona.pre_inference(request)


@hookimpl
def post_inference(request: InferenceRequest, result: InferenceResult) -> None:
    sona = _for(request)
    if sona is not None:
        sona.post_inference(request, result)
