"""LoRA parameter sets as plain dicts ``(layer, proj) -> (A, B)`` and the few operations on them."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import numpy as np

Key = tuple[int, str]
#: (layer, proj) -> (A [r, in], B [out, r]), float32.
Params = dict[Key, tuple[np.ndarray, np.ndarray]]


def copy_params(p: Mapping[Key, tuple[np.ndarray, np.ndarray]]) -> Params:
    return {k: (a.copy(), b.copy()) for k, (a, b) in p.items()}


def zeros_like(p: Mapping[Key, tuple[np.ndarray, np.ndarray]]) -> Params:
    return {k: (np.zeros_like(a), np.zeros_like(b)) for k, (a, b) in p.items()}


def map2(
    f: Callable[[np.ndarray, np.ndarray], np.ndarray],
    x: Mapping[Key, tuple[np.ndarray, np.ndarray]],
    y: Mapping[Key, tuple[np.ndarray, np.ndarray]],
    keys: Collection[Key] | None = None,
) -> Params:
    return {k: (f(x[k][0], y[k][0]), f(x[k][1], y[k][1])) for k in (keys if keys is not None else x)}


def sq_norm(p: Mapping[Key, tuple[np.ndarray, np.ndarray]]) -> float:
    return float(sum(np.vdot(a, a) + np.vdot(b, b) for a, b in p.values()))


def flat(p: Mapping[Key, tuple[np.ndarray, np.ndarray]], keys: Collection[Key]) -> np.ndarray:
    return np.concatenate([np.concatenate([p[k][0].ravel(), p[k][1].ravel()]) for k in keys]) if keys else np.zeros(0)
