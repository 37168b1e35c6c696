"""The asyncio face of the engine: a background thread runs steps; callers await outputs.

Only the step thread touches the :class:`LLMEngine`. Callers send it commands (add, abort, stop)
through a queue and are answered through futures; each request's outputs come back through its own
:class:`_OutputStream`, which wakes the caller's event loop only while the caller waits, and hands it
everything that arrived in one go. Commands are handled between steps, so an abort frees
the request's blocks at the latest when the step in flight ends, and before ``abort`` returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import structlog

from ruvllm.engine.config import EngineConfig
from ruvllm.engine.llm_engine import LLMEngine
from ruvllm.engine.types import EngineStats, GenerationRequest, RequestOutput
from ruvllm.errors import RuvllmError

if TYPE_CHECKING:
    from ruvllm.runtime import LoadedModel
    from ruvllm.tokenizer import Tokenizer

log = structlog.get_logger("ruvllm.engine")


class EngineDeadError(RuvllmError):
    """The engine was shut down; it takes no more requests."""


class _OutputStream:
    """One request's outputs from the step thread to its caller's event loop.

    The step thread appends; the loop is woken (``call_soon_threadsafe``: a pipe write and a loop
    turn) only when the caller waits, so a caller that is behind takes every output that arrived in
    one wakeup, with no per-output ``asyncio.Queue`` bookkeeping. Appends and attribute reads are
    atomic under the GIL; the caller publishes its waiter before it looks at ``items`` again, so an
    output appended in between is either seen or wakes it. A step's outputs for callers on one loop
    wake them all with one ``call_soon_threadsafe`` (:class:`_Wakeups`)."""

    __slots__ = ("items", "loop", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque[RequestOutput | BaseException] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, rid: str, item: RequestOutput | BaseException, wakeups: _Wakeups | None = None) -> None:
        """Step thread: add ``item``; wake the caller now, or with ``wakeups`` when they are sent.
        Raises RuntimeError if the caller's loop is closed."""
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and wakeups is None:
            self.loop.call_soon_threadsafe(_wake, [waiter])
            return
        if self.loop.is_closed():  # as call_soon_threadsafe would say: nobody will read these
            raise RuntimeError("the caller's event loop is closed")
        if waiter is not None and wakeups is not None:
            wakeups.add(self.loop, rid, waiter)

    async def wait(self) -> None:
        """Caller's loop: return once ``items`` is not empty."""
        while not self.items:
            waiter = self.loop.create_future()
            self.waiter = waiter
            try:
                if self.items:  # appended before the waiter was published
                    return
                await waiter
            finally:
                self.waiter = None


class _Wakeups:
    """The callers a step's outputs wake, by event loop: one ``call_soon_threadsafe`` a loop."""

    __slots__ = ("by_loop",)

    def __init__(self) -> None:
        self.by_loop: dict[asyncio.AbstractEventLoop, tuple[list[str], list[asyncio.Future[None]]]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, rid: str, waiter: asyncio.Future[None]) -> None:
        entry = self.by_loop.get(loop)
        if entry is None:
            entry = self.by_loop[loop] = ([], [])
        entry[0].append(rid)
        entry[1].append(waiter)

    def send(self) -> list[str]:
        """Wake them; returns the requests whose loop closed meanwhile (nobody reads them)."""
        lost = []
        for loop, (rids, waiters) in self.by_loop.items():
            try:
                loop.call_soon_threadsafe(_wake, waiters)
            except RuntimeError:
                lost += rids
        return lost


def _wake(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)


class AsyncEngine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, *, tokenizer: Tokenizer | None = None):
        self.engine = LLMEngine(model, config, tokenizer=tokenizer)
        self._commands: queue.SimpleQueue[tuple[str, tuple[Any, ...], concurrent.futures.Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._start_lock = threading.Lock()
        # Touched by the step thread only.
        self._streams: dict[str, _OutputStream] = {}
        self._stopping: bool | None = None  # None: running; else: drain before stopping?
        self._stats = self.engine.stats()

    # ---------------------------------------------------------------------------- public API

    def start(self) -> None:
        """Start the step thread (``generate`` does it on first use)."""
        with self._start_lock:
            if self._closed:
                raise EngineDeadError("the engine has been shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ruvllm-engine", daemon=True)
                self._thread.start()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Yield ``request``'s output deltas until it finishes. Leaving the loop early (break,
        cancellation) aborts the request and frees its blocks."""
        async for batch in self.generate_batches(request):
            for item in batch:
                yield item

    async def generate_batches(self, request: GenerationRequest) -> AsyncIterator[list[RequestOutput]]:
        """As :meth:`generate`, but every output that arrived while the caller was busy comes in one
        list (in order), so a caller that is behind (a server writing many streams) handles them at
        once: one write, not one a token. Leaving early aborts the request as ``generate`` does."""
        self.start()
        outputs = _OutputStream(asyncio.get_running_loop())
        await self._call("add", request, outputs)
        items = outputs.items
        done = False
        try:
            while True:
                if not items:
                    await outputs.wait()
                batch = []
                while items:
                    item = items[0]
                    if isinstance(item, BaseException):
                        if batch:  # what came before the failure is delivered first
                            break
                        items.popleft()
                        done = True
                        raise item
                    items.popleft()
                    batch.append(item)
                    if item.finished:
                        done = True
                        break
                yield batch
                if done:
                    return
        finally:
            if not done:
                with contextlib.suppress(EngineDeadError):
                    await self._call("abort", request.request_id)

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Abort ``request_id``; returns once its blocks are free (its stream ends with ``abort``)."""
        return await self._call("abort", request_id)

    @property
    def broken(self) -> str | None:
        """Why the engine stopped working (steps kept failing), or None."""
        return self.engine.broken

    def stats(self) -> EngineStats:
        """Engine statistics as of the last step or command."""
        return self._stats

    async def shutdown(self, drain: bool = True) -> None:
        """Stop the step thread: after the unfinished requests complete (``drain``), or aborting them."""
        with self._start_lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        await self._call("stop", drain)
        await asyncio.to_thread(thread.join)

    # ---------------------------------------------------------------------------- internals

    async def _call(self, kind: str, *args: Any) -> Any:
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("the engine is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((kind, args, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    def _run(self) -> None:
        try:
            while True:
                self._handle_commands()
                if self._stopping is not None and not (self._stopping and self.engine.has_unfinished()):
                    break
                if not self.engine.has_unfinished():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    self._fail_all(exc)
                    continue
                # Stats first: a caller woken by its final output must not read older figures.
                self._stats = self.engine.stats()
                wakeups = _Wakeups()
                for failure in self.engine.take_failures():  # requests that failed alone
                    self._deliver(failure.request_id, failure, True, wakeups)
                for out in outputs:
                    self._deliver(out.request_id, out, out.finished, wakeups)
                for rid in wakeups.send():
                    self._streams.pop(rid, None)
                    self.engine.abort(rid)
                if self.engine.broken is not None:
                    self._fail_all(EngineDeadError(f"the engine stopped: {self.engine.broken}"))
                    break
        finally:
            finals = [self.engine.abort(rid) for rid in self.engine.unfinished_request_ids()]
            self._stats = self.engine.stats()
            for final in finals:
                if final is not None:
                    self._deliver(final.request_id, final, True)
            with self._start_lock:
                self._closed = True
            self._fail_commands(EngineDeadError("the engine has been shut down"))

    def _handle_commands(self) -> None:
        while True:
            try:
                kind, args, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = self._command(kind, args)
            except BaseException as exc:
                self._stats = self.engine.stats()
                fut.set_exception(exc)
            else:
                self._stats = self.engine.stats()
                fut.set_result(result)

    def _command(self, kind: str, args: tuple[Any, ...]) -> Any:
        if kind == "add":
            request, outputs = args
            if self._stopping is not None:
                raise EngineDeadError("the engine is shutting down")
            self.engine.add_request(request)
            self._streams[request.request_id] = outputs
            return None
        if kind == "abort":
            (rid,) = args
            out = self.engine.abort(rid)
            if out is not None:
                self._stats = self.engine.stats()
                self._deliver(rid, out, True)
            return out
        if kind == "stop":
            (drain,) = args
            self._stopping = bool(drain)
            if not drain:
                for rid in self.engine.unfinished_request_ids():
                    self._command("abort", (rid,))
            return None
        raise ValueError(f"unknown engine command {kind!r}")

    def _deliver(
        self, rid: str, item: RequestOutput | BaseException, last: bool, wakeups: _Wakeups | None = None
    ) -> None:
        target = self._streams.pop(rid, None) if last else self._streams.get(rid)
        if target is None:
            return
        try:
            target.put(rid, item, wakeups)
        except RuntimeError:  # the caller's event loop is closed: nobody listens any more
            self._streams.pop(rid, None)
            self.engine.abort(rid)

    def _fail_all(self, exc: Exception) -> None:
        log.error("engine step failed", error=repr(exc))
        for rid in self.engine.unfinished_request_ids():
            self.engine.abort(rid)
        self._stats = self.engine.stats()
        for rid in list(self._streams):
            self._deliver(rid, exc, True)

    def _fail_commands(self, exc: Exception) -> None:
        while True:
            try:
                _, _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)
