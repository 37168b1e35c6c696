"""Where a model's SONA learner lives, and which models have one in this process.

The learner lives on its model (``model.plugin_state["sona"]``): the hooks find a request's by the
model the engine names on it, and the server's routes by the model it serves. This module's index of
models answers only process-wide questions (detach every learner; the one learner, when there is
exactly one). A leaf, so the plugin's hooks and the HTTP router both read it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ruvllm_sona.errors import SonaError

if TYPE_CHECKING:
    from ruvllm.runtime import LoadedModel
    from ruvllm_sona.sona import Sona

#: The key of a model's ``plugin_state`` that holds its learner.
KEY = "sona"

_models: dict[int, LoadedModel] = {}
_lock = threading.Lock()


def learner_of(model: LoadedModel | None) -> Sona | None:
    """The learner attached to ``model``, or None."""
    return model.plugin_state.get(KEY) if model is not None else None


def add(model: LoadedModel, make: Callable[[], Sona]) -> Sona:
    """Attach ``make()``'s learner to ``model``; refuse a second one."""
    with _lock:
        if learner_of(model) is not None:
            raise SonaError("SONA is already attached to this model; call detach(model) first")
        sona = make()
        model.plugin_state[KEY] = sona
        _models[id(model)] = model
    return sona


def remove(model: LoadedModel | None) -> list[tuple[LoadedModel, Sona]]:
    """Take the learner off ``model`` (None: off every model that has one); the pairs taken."""
    with _lock:
        models = list(_models.values()) if model is None else [model]
        gone = []
        for m in models:
            sona = m.plugin_state.pop(KEY, None)
            _models.pop(id(m), None)
            if sona is not None:
                gone.append((m, sona))
    return gone


def only() -> Sona | None:
    """The learner when exactly one model in this process has one, else None."""
    with _lock:
        learners = [learner_of(m) for m in _models.values()]
    return learners[0] if len(learners) == 1 else None


def count() -> int:
    """How many models in this process have a learner attached."""
    return len(_models)
