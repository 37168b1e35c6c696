"""Per-key rate limiting (token buckets) and admission control (concurrency plus a bounded queue)."""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class TokenBucketLimiter:
    """``rate`` requests per second per key, bursts up to ``burst``. Idle keys are forgotten
    least-recently-used first once more than ``max_keys`` are tracked."""

    def __init__(
        self,
        rate: float,
        burst: int | None = None,
        *,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.burst = float(burst if burst is not None else max(1, math.ceil(rate)))
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, last refill)

    def acquire(self, key: str) -> float:
        """Take one token for ``key``: 0.0 when allowed, else the seconds until one is available."""
        now = self._clock()
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return wait


class Overloaded(Exception):
    """Every slot is taken and the queue is full."""


class AdmissionController:
    """At most ``max_concurrent`` requests run; up to ``max_queue`` more wait (FIFO) for a slot."""

    def __init__(self, max_concurrent: int, max_queue: int) -> None:
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.running = 0
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the body of the ``async with``; raises :class:`Overloaded` when full."""
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if self.running < self.max_concurrent and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_queue:
            raise Overloaded
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                # The slot was handed over just as we were cancelled: pass it on.
                self._release()
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise

    def _release(self) -> None:
        # A released slot goes straight to the oldest waiter, so ``running`` stays the same.
        while self._waiters:
            fut = self._waiters.pop(0)
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1
