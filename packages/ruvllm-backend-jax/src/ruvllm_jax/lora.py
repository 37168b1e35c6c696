"""Adapters on device: each adapter's LoRA factors are checked and uploaded once, then reused.

An adapter (``SequenceChunk.adapter``) hands its factors over through ``lora_params()``:
``{(layer, proj): (A [r, in], B [out, r], scale)}``; the step adds ``scale * (x @ A.T) @ B.T`` to
projection ``proj`` of ``layer`` (see :mod:`ruvllm_jax.model`). Adapters are immutable snapshots, so
what is uploaded is kept per adapter object (and its ``version``) in a small LRU; the cache holds a
reference to each adapter it keeps, so a recycled ``id()`` can never match a stale entry.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ruvllm.adapters import checked_lora_factors
from ruvllm.errors import BackendError
from ruvllm_jax.model import PROJECTIONS, LoraFactors, LoraPlan, ModelSpec, bucket

#: Adapters whose device factors are kept. One costs ``layers * r * (in + out)`` float32 per
#: projection it adapts (about 0.3 MB per projection for SmolLM2 at rank 2); a step with more distinct
#: adapters than this still runs, but re-uploads the ones that did not fit in the next step.
ADAPTER_CACHE_SIZE = 32
#: Slot lists whose gathered factors (for the native kernel) are kept between steps.
GATHERED_CACHE_SIZE = 2


@dataclass
class DeviceAdapter:
    """One adapter's factors on device, zero-padded to ``rank`` and to every layer."""

    adapter: Any
    version: Any
    rank: int
    #: proj -> (A [layers, rank, in], B [layers, out, rank] with the scale folded in); empty: no-op.
    factors: dict[str, tuple[jax.Array, jax.Array]]
    #: The factors zero-padded to larger ranks (steps mixing adapters of different ranks).
    padded: dict[int, dict[str, tuple[jax.Array, jax.Array]]] = field(default_factory=dict, repr=False)


def _describe(adapter: Any) -> str:
    scope = getattr(adapter, "scope", None)
    return type(adapter).__name__ + (f" (scope {scope!r})" if scope is not None else "")


class AdapterCache:
    """Validates adapters against the model's shapes and keeps their device factors (LRU)."""

    def __init__(self, spec: ModelSpec, put: Callable[[Any], jax.Array], capacity: int = ADAPTER_CACHE_SIZE) -> None:
        """``put`` places an array on the model's devices (replicated under tensor parallelism)."""
        self.spec = spec
        self.put = put
        self.capacity = capacity
        self._entries: OrderedDict[int, DeviceAdapter] = OrderedDict()
        self._zeros: dict[tuple[str, int], tuple[jax.Array, jax.Array]] = {}
        #: The gathered form of recent slot lists (see :meth:`gathered`), most recent last.
        self._gathered: OrderedDict[tuple, tuple[tuple[DeviceAdapter, ...], LoraFactors]] = OrderedDict()
        #: Adapters uploaded so far (cache misses), for tests and logs.
        self.uploads = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, adapter: Any) -> DeviceAdapter:
        version = getattr(adapter, "version", None)
        entry = self._entries.get(id(adapter))
        if entry is None or entry.adapter is not adapter or entry.version != version:
            entry = self._upload(adapter, version)
            self._entries[id(adapter)] = entry
            self.uploads += 1
        self._entries.move_to_end(id(adapter))
        return entry

    def trim(self) -> None:
        """Drop the least recently used entries beyond ``capacity`` (after a step took what it uses)."""
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def at_rank(self, entry: DeviceAdapter, rank: int) -> dict[str, tuple[jax.Array, jax.Array]]:
        """``entry``'s factors zero-padded to ``rank`` (at least its own)."""
        if rank == entry.rank:
            return entry.factors
        if rank not in entry.padded:
            extra = rank - entry.rank
            entry.padded[rank] = {
                p: (
                    self.put(jax.numpy.pad(a, ((0, 0), (0, extra), (0, 0)))),
                    self.put(jax.numpy.pad(b, ((0, 0), (0, 0), (0, extra)))),
                )
                for p, (a, b) in entry.factors.items()
            }
        return entry.padded[rank]

    def zeros(self, proj: str, rank: int) -> tuple[jax.Array, jax.Array]:
        """Factors that add nothing: padding slots, and adapters without ``proj``."""
        key = (proj, rank)
        if key not in self._zeros:
            out, inp = self.spec.projection_shape(proj)
            layers = self.spec.num_layers
            self._zeros[key] = (
                self.put(np.zeros((layers, rank, inp), np.float32)),
                self.put(np.zeros((layers, out, rank), np.float32)),
            )
        return self._zeros[key]

    def gathered(self, used: Sequence[DeviceAdapter], plan: LoraPlan) -> LoraFactors:
        """The slots' factors side by side along the rank, as the native kernel reads them:
        ``proj -> ((A [layers, slots * rank, in], Bt [layers, slots * rank, out]),)`` (B transposed).
        Steps that keep the same adapters in the same slots (a steady decode) reuse one copy."""
        key = (tuple(id(e) for e in used), plan)
        hit = self._gathered.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], used, strict=True)):
            self._gathered.move_to_end(key)
            return hit[1]
        out: LoraFactors = {}
        for proj in plan.projections:
            slots = []
            for entry in used:
                own = self.at_rank(entry, plan.rank)
                slots.append(own[proj] if proj in own else self.zeros(proj, plan.rank))
            slots += [self.zeros(proj, plan.rank)] * (plan.slots - len(used))
            a = jax.numpy.concatenate([a for a, _ in slots], axis=1)
            bt = jax.numpy.concatenate([b for _, b in slots], axis=2).transpose(0, 2, 1)
            out[proj] = ((self.put(a), self.put(bt)),)
        self._gathered[key] = (tuple(used), out)
        while len(self._gathered) > GATHERED_CACHE_SIZE:
            self._gathered.popitem(last=False)
        return out

    def padding(self, plan: LoraPlan, gathered: bool) -> LoraFactors:
        """Factors of ``plan`` with every slot empty (zeros): what precompiling its step needs."""
        if gathered:
            return self.gathered([], plan)
        return {proj: (self.zeros(proj, plan.rank),) * plan.slots for proj in plan.projections}

    def _upload(self, adapter: Any, version: Any) -> DeviceAdapter:
        params = getattr(adapter, "lora_params", None)
        if not callable(params):
            raise BackendError(f"the jax backend applies adapters through lora_params(); {_describe(adapter)} has none")
        spec = self.spec
        checked: dict[str, list[tuple[int, np.ndarray, np.ndarray]]] = {}
        for layer, proj, a, b in checked_lora_factors(
            params(), _describe(adapter), spec.num_layers, spec.projection_shape
        ):
            checked.setdefault(proj, []).append((layer, a, b))
        if not checked:
            return DeviceAdapter(adapter, version, 0, {})
        rank = bucket(max(a.shape[0] for items in checked.values() for _, a, _ in items))
        factors = {}
        for proj in PROJECTIONS:
            if proj not in checked:
                continue
            out, inp = spec.projection_shape(proj)
            a_all = np.zeros((spec.num_layers, rank, inp), np.float32)
            b_all = np.zeros((spec.num_layers, out, rank), np.float32)
            for layer, a, b in checked[proj]:
                a_all[layer, : a.shape[0]] = a
                b_all[layer, :, : b.shape[1]] = b
            factors[proj] = (self.put(a_all), self.put(b_all))
        return DeviceAdapter(adapter, version, rank, factors)


def fits(plan: LoraPlan, bound: LoraPlan) -> bool:
    """``plan``'s adapters run in ``bound``'s shape (no more slots, no larger rank, no other projection;
    ``bound.weighted`` is the finest weighting precompiled, see :func:`plan_adapters`)."""
    return plan.slots <= bound.slots and plan.rank <= bound.rank and set(plan.projections) <= set(bound.projections)


def _is_mix(adapter: Any) -> bool:
    """An :class:`ruvllm.adapters.AdapterMix`: several adapters weighted per token (X-LoRA)."""
    return hasattr(adapter, "components") and hasattr(adapter, "module_weights")


def plan_adapters(
    adapters: Sequence[Any],
    lens: Sequence[int],
    num_tokens: int,
    cache: AdapterCache,
    starts: Sequence[int] | None = None,
    gathered: bool = False,
    fixed: LoraPlan | None = None,
) -> tuple[LoraPlan | None, np.ndarray | None, LoraFactors | None, np.ndarray | None]:
    """Slots for the adapters of one step's chunks (``None`` entries: no adapter): the static plan,
    each token's slot (-1 for none), the factors per projection and slot (``gathered``: in the
    native kernel's form, see :meth:`AdapterCache.gathered`) and, for a step with an adapter mix,
    each token's weight per slot. All None when no chunk has an adapter that changes anything, so the
    step is the one without adapters. Chunk ``i``'s tokens sit at ``starts[i]`` (default: one after
    another). With ``fixed`` (the precompiled plan) every step whose adapters fit in it takes that
    plan's shape, padded (zero factors add nothing), and a step with mixes takes ``fixed``'s weighting
    where it is as fine.

    A mix (:class:`ruvllm.adapters.AdapterMix`) gives each of its components a slot; its tokens
    carry their weights in those slots (``[T, S]``, or ``[layers, projections, T, S]`` when the mix
    weights each module on its own), every other adapter's tokens weight 1 in their own slot. Such
    steps apply adapters through XLA's dense products (``LoraPlan.weighted``)."""
    if all(a is None for a in adapters):
        return None, None, None, None
    slot_of: dict[int, int] = {}
    used: list[DeviceAdapter] = []

    def slot(adapter: Any) -> int | None:
        entry = cache.get(adapter)
        if not entry.factors:
            return None
        if id(entry) not in slot_of:
            slot_of[id(entry)] = len(used)
            used.append(entry)
        return slot_of[id(entry)]

    if starts is None:
        starts = np.cumsum([0, *lens[:-1]])
    token_slot = np.full(num_tokens, -1, np.int32)
    mixes: list[tuple[Any, list[int | None], int, int]] = []  # (mix, its components' slots, start, n)
    for adapter, n, start in zip(adapters, lens, starts, strict=True):
        if adapter is None:
            continue
        if _is_mix(adapter):
            if np.asarray(adapter.weights).shape[0] != n:
                raise BackendError(f"an adapter mix has weights for {np.asarray(adapter.weights).shape[0]} tokens, "
                                   f"its chunk has {n}")  # fmt: skip
            mixes.append((adapter, [slot(c) for c in adapter.components], int(start), n))
            continue
        s = slot(adapter)
        if s is not None:
            token_slot[start : start + n] = s
    cache.trim()
    if not used:
        return None, None, None, None
    rank = max(e.rank for e in used)
    projections = tuple(p for p in PROJECTIONS if any(p in e.factors for e in used))
    layerwise = any(m.modules for m, *_ in mixes)
    weighted = 0 if not mixes else 2 if layerwise else 1
    plan = LoraPlan(slots=bucket(len(used)), rank=rank, projections=projections, weighted=weighted)
    if fixed is not None and fits(plan, fixed):
        # The precompiled weighting covers a coarser one (per-token weights repeat for every module).
        weighted = 0 if not weighted else max(weighted, fixed.weighted)
        plan = dataclasses.replace(fixed, weighted=weighted)
    weights = None
    if weighted:
        gathered = False
        spec = cache.spec
        shape = (spec.num_layers, len(plan.projections), num_tokens, plan.slots)
        weights = np.zeros(shape if weighted == 2 else shape[2:], np.float32)
        rows = np.nonzero(token_slot >= 0)[0]
        weights[..., rows, token_slot[rows]] = 1.0
        for mix, slots, start, n in mixes:
            for c, s in enumerate(slots):
                if s is None:
                    continue
                if weighted == 1:
                    weights[start : start + n, s] += mix.weights[:, c]
                    continue
                for layer in range(spec.num_layers):
                    for pi, proj in enumerate(plan.projections):
                        w = mix.module_weights(layer, proj)
                        if w is not None:
                            weights[layer, pi, start : start + n, s] += w[:, c]
    if gathered:
        return plan, token_slot, cache.gathered(used, plan), None
    factors: LoraFactors = {}
    for proj in plan.projections:
        slots_ = []
        for entry in used:
            own = cache.at_rank(entry, plan.rank)
            slots_.append(own[proj] if proj in own else cache.zeros(proj, plan.rank))
        slots_ += [cache.zeros(proj, plan.rank)] * (plan.slots - len(used))
        factors[proj] = tuple(slots_)
    return plan, token_slot, factors, weights


def padding_planner(plan: LoraPlan, adapters: AdapterCache, num_layers: int) -> Callable[..., Any]:
    """The adapter planner of a step precompiled for ``plan`` (a :data:`ruvllm_jax.step_inputs.AdapterPlanner`):
    every slot empty (zero factors), every row on no adapter."""

    def padding(
        _chunks: Sequence[Any], _lens: list[int], t: int, _starts: np.ndarray, gathered: bool
    ) -> tuple[LoraPlan, np.ndarray, LoraFactors, np.ndarray | None]:
        gathered = gathered and not plan.weighted
        weight = None
        if plan.weighted:
            layers = (num_layers, len(plan.projections)) if plan.weighted == 2 else ()
            weight = np.zeros((*layers, t, plan.slots), np.float32)
        return plan, np.full(t, -1, np.int32), adapters.padding(plan, gathered), weight

    return padding
