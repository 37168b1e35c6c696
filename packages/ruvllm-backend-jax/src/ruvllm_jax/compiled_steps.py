"""Compiled programs kept by what they were compiled for: the forward steps (by :class:`StepPlan` and
the cache's geometry), the device samplers and the block copies. Each cache counts its hits, misses
and compile seconds, and :attr:`CompiledCache.stats` reports them with the plans compiled, so logs
and tests see what compiled without reaching into the model."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax

from ruvllm_jax import step_cache
from ruvllm_jax.kv_state import KVState
from ruvllm_jax.model import LoraFactors, ModelSpec, StepInputs, StepPlan, Weights, forward_step


@dataclass(frozen=True)
class CompileStats:
    """What one :class:`CompiledCache` holds and how it was used."""

    #: Programs compiled (one per key).
    count: int
    #: Seconds spent compiling them (or loading them from the persistent compilation cache).
    seconds: float
    #: Lookups that found a program, and lookups that did not (each followed by a compile).
    hits: int
    misses: int
    #: What each program was compiled for, in compile order (a step's :class:`StepPlan`; a sampler's
    #: ``(rows, width, sort, sharding)``; a block copy's pair count).
    plans: tuple[Any, ...]


class CompiledCache:
    """Compiled programs by key. :meth:`get` is the hot path: one dict lookup and a count."""

    def __init__(self) -> None:
        self._programs: dict[Hashable, Any] = {}
        self._plans: list[Any] = []
        self._seconds = 0.0
        self._hits = 0
        self._misses = 0

    def __len__(self) -> int:
        return len(self._programs)

    def get(self, key: Hashable) -> Any | None:
        program = self._programs.get(key)
        if program is None:
            self._misses += 1
        else:
            self._hits += 1
        return program

    def compile(self, key: Hashable, build: Callable[[], Any], plan: Any = None) -> tuple[Any, float]:
        """Compile with ``build`` and keep the program under ``key``; returns it and the seconds it
        took. ``plan``: what the stats report it as (default ``key``)."""
        t0 = time.perf_counter()
        program = build()
        seconds = time.perf_counter() - t0
        self._programs[key] = program
        self._plans.append(key if plan is None else plan)
        self._seconds += seconds
        return program, seconds

    def programs(self) -> list[Any]:
        """The compiled programs (``jax.stages.Compiled``), in compile order: their HLO for tests."""
        return list(self._programs.values())

    @property
    def stats(self) -> CompileStats:
        return CompileStats(len(self._programs), self._seconds, self._hits, self._misses, tuple(self._plans))


def compile_step(
    spec: ModelSpec,
    plan: StepPlan,
    weights: Weights,
    state: KVState,
    inputs: StepInputs,
    lora: LoraFactors | None,
) -> Any:
    """:func:`ruvllm_jax.model.forward_step` compiled for ``plan`` and these arguments' shapes, the
    cache donated (the step updates it in place); loaded instead from :mod:`ruvllm_jax.step_cache`
    when an earlier start kept it."""
    args = (weights, state, inputs, lora)
    key = step_cache.step_key(spec, plan, args)
    if key is not None and (kept := step_cache.load(key)) is not None:
        return kept
    fn = jax.jit(partial(forward_step, spec=spec, plan=plan), donate_argnums=(1,))
    lowered = fn.lower(*args)
    if key is None:
        return lowered.compile()
    with step_cache.fresh_compile() as fresh:
        compiled = lowered.compile()
    if fresh:
        step_cache.store(key, compiled)
    return compiled
