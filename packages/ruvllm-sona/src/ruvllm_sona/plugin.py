"""The ``sona`` entry point: hooks that forward to the SONA instance attached to the served model.

SONA needs the model's weights, which hooks do not receive, so whoever loads the model attaches it::

    from ruvllm_sona.plugin import attach
    sona = attach(loaded_model, SonaConfig(scope="user"), state_dir="~/.ruvllm/sona")

Until then the hooks do nothing (``GET /v1/sona/stats`` says so). One model per process is attached;
embedding code that serves several models registers a :class:`~ruvllm_sona.sona.Sona` per host
instead (``host.register(sona)``).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ruvllm.hookspecs import hookimpl
from ruvllm_sona.config import SonaConfig
from ruvllm_sona.errors import SonaError
from ruvllm_sona.sona import Sona

if TYPE_CHECKING:
    from ruvllm.inference import InferenceRequest, InferenceResult
    from ruvllm.runtime import LoadedModel

_active: Sona | None = None
_attach_lock = threading.Lock()


def attach(model: LoadedModel, config: SonaConfig | None = None, *, state_dir: str | Path | None = None) -> Sona:
    """Create the SONA learner for ``model``, start its background loop and make this module's hooks
    (registered with ``model.host`` if the entry point was filtered out) forward to it."""
    global _active
    with _attach_lock:
        if _active is not None:
            raise SonaError("SONA is already attached to a model in this process; call detach() first")
        sona = Sona.for_model(model, config, state_dir=Path(state_dir).expanduser() if state_dir else None)
        _active = sona
    module = sys.modules[__name__]
    if not model.host.pm.is_registered(module):
        model.host.register(module, name="sona")
    return sona


def detach(save: bool = True) -> None:
    """Stop the attached learner (saving its state when it has a directory)."""
    global _active
    with _attach_lock:
        sona, _active = _active, None
    if sona is not None:
        sona.close(save=save)


def active() -> Sona | None:
    return _active


@hookimpl
def pre_inference(request: InferenceRequest) -> None:
    sona = _active
    if sona is not None:
        sona.pre_inference(request)


@hookimpl
def post_inference(request: InferenceRequest, result: InferenceResult) -> None:
    sona = _active
    if sona is not None:
        sona.post_inference(request, result)
