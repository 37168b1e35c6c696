"""Adapters applied on MLX's device: LoRA factors uploaded once per adapter object, X-LoRA mixes
weighted per token there too, so a step with adapters stays one graph (no trip to the host per
projection).

An adapter hands its factors over through ``lora_params()``: ``{(layer, proj): (A [r, in], B [out,
r], scale)}``; the update of projection ``proj`` is ``scale * (x @ A.T) @ B.T`` (the scale folded into
B in float32 at upload). An :class:`ruvllm.adapters.AdapterMix` (X-LoRA) adds, per token ``t``,
``sum_c w[t, c] * update_c(x_t)`` with ``w`` its ``module_weights(layer, proj)``. Adapters are
immutable snapshots, so what is uploaded is kept per adapter object (and its ``version``) in a small
LRU that holds a reference to each, so a recycled ``id()`` never matches a stale entry. An adapter
with neither (only ``delta``) is applied through ``delta`` on the host.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ruvllm.adapters import checked_lora_factors
from ruvllm.errors import BackendError

#: Adapters whose factors are kept when ``LoadOptions.max_adapters`` does not say.
DEFAULT_CAPACITY = 32

Factors = dict[tuple[int, str], tuple[mx.array, mx.array]]


@dataclass
class _Entry:
    adapter: Any
    version: Any
    factors: Factors


def _describe(adapter: Any) -> str:
    scope = getattr(adapter, "scope", None)
    return type(adapter).__name__ + (f" (scope {scope!r})" if scope is not None else "")


def is_mix(adapter: Any) -> bool:
    """An X-LoRA style mix (components weighted per token), read through its components' factors."""
    return hasattr(adapter, "components") and callable(getattr(adapter, "module_weights", None))


def on_device(adapter: Any) -> bool:
    """Whether the adapter's factors can be applied on the device (else: ``delta`` on the host)."""
    if is_mix(adapter):
        return all(callable(getattr(c, "lora_params", None)) for c in adapter.components)
    return callable(getattr(adapter, "lora_params", None))


class AdapterFactors:
    """Checks adapters against the model's shapes and keeps their factors on the device (LRU)."""

    def __init__(
        self, num_layers: int, shape: Callable[[str], tuple[int, int]], dtype: Any, capacity: int | None = None
    ) -> None:
        self.num_layers, self.shape, self.dtype = num_layers, shape, dtype
        self.capacity = capacity or DEFAULT_CAPACITY
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        #: Adapters uploaded so far (cache misses), for tests.
        self.uploads = 0

    def get(self, adapter: Any) -> Factors:
        version = getattr(adapter, "version", None)
        entry = self._entries.get(id(adapter))
        if entry is None or entry.adapter is not adapter or entry.version != version:
            entry = _Entry(adapter, version, self._upload(adapter))
            self._entries[id(adapter)] = entry
            self.uploads += 1
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        self._entries.move_to_end(id(adapter))
        return entry.factors

    def _upload(self, adapter: Any) -> Factors:
        name = _describe(adapter)
        factors: Factors = {}
        for layer, proj, a, scaled in checked_lora_factors(adapter.lora_params(), name, self.num_layers, self.shape):
            # [in, r] and [r, out]: the products are x @ A^T @ (scale B)^T as two plain matmuls.
            factors[(layer, proj)] = (
                mx.array(np.ascontiguousarray(a.T), dtype=self.dtype),
                mx.array(np.ascontiguousarray(scaled.T), dtype=self.dtype),
            )
        return factors

    def update(self, adapter: Any, layer: int, proj: str, x: mx.array) -> mx.array | None:
        """The ``[n, out]`` update of ``adapter`` for input rows ``x``, or None for none."""
        if not is_mix(adapter):
            f = self.get(adapter).get((layer, proj))
            return None if f is None else (x @ f[0]) @ f[1]
        w = adapter.module_weights(layer, proj)
        if w is None:
            return None
        w = np.asarray(w, np.float32)
        if w.shape[0] != x.shape[0]:
            raise BackendError(f"adapter mix has weights for {w.shape[0]} tokens, the chunk has {x.shape[0]}")
        out = None
        for c, comp in enumerate(adapter.components):
            f = self.get(comp).get((layer, proj))
            if f is None or not w[:, c].any():
                continue
            # PEFT's X-LoRA layer: B(A(x * w)) * scale.
            d = ((x * mx.array(w[:, c : c + 1], dtype=x.dtype)) @ f[0]) @ f[1]
            out = d if out is None else out + d
        return out
