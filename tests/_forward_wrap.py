"""Tests that watch or break a loaded model's steps: core calls the backend model's ``forward``
directly (no hook), so a test swaps ``LoadedModel.model`` for a delegating wrapper for a while."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ruvllm.backend import ForwardBatch, ForwardOutput
from ruvllm.runtime import LoadedModel

#: ``fn(inner_forward, batch, cache)``: the wrapper's forward.
ForwardFn = Callable[[Callable[[ForwardBatch, Any], ForwardOutput], ForwardBatch, Any], ForwardOutput]


class ForwardWrapper:
    """The wrapped model in every respect but ``forward``."""

    def __init__(self, inner: Any, fn: ForwardFn) -> None:
        self._inner, self._fn = inner, fn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def forward(self, batch: ForwardBatch, cache: Any) -> ForwardOutput:
        return self._fn(self._inner.forward, batch, cache)


@contextmanager
def wrapped_forward(loaded: LoadedModel, fn: ForwardFn) -> Iterator[None]:
    inner = loaded.model
    loaded.model = ForwardWrapper(inner, fn)
    try:
        yield
    finally:
        loaded.model = inner
