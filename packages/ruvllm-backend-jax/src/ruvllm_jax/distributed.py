"""One model across several processes (hosts): JAX's distributed runtime, one SPMD program.

Every process runs :func:`initialize` first (``jax.distributed.initialize``; on CPUs the collectives
go over gloo), then loads the same checkpoint with the same options, ``tensor_parallel`` spanning
the devices of all of them. Process 0 runs the engine (and the server): the jax backend hands it a
:class:`Leader`, which sends every call that runs or compiles a program (``kv_cache``, ``precompile``,
``forward``) to the other processes before running it itself, so all of them run the same compiled
steps, in the same order, on the same inputs, each on its shards. The others run :func:`follow`,
which loads the model and obeys process 0 until it closes.

The channel is :mod:`multiprocessing.connection` (pickled calls over TCP, authenticated with a key
every process derives from the coordinator address, or ``RUVLLM_DISTRIBUTED_KEY``) at the
coordinator's host, port + 1. A process that is gone is an error on process 0's next call, naming it.

    from ruvllm_jax import distributed
    distributed.initialize("10.0.0.1:7700", num_processes=2, process_id=rank)
    options = LoadOptions(extra={"tensor_parallel": 2})
    if rank == 0:
        model = load_model(path, backend="jax", options=options)   # a Leader inside; run the engine on it
    else:
        distributed.follow(path, options)                          # returns when process 0 closes
"""

from __future__ import annotations

import atexit
import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import TYPE_CHECKING, Any

import structlog

from ruvllm.backend import ForwardBatch, ForwardOutput, LoadOptions, StepLimits
from ruvllm.errors import BackendError

if TYPE_CHECKING:
    from ruvllm_jax.runner import JaxKVCache, JaxModel

log = structlog.get_logger("ruvllm_jax.distributed")

_group: dict[str, Any] = {}
#: Seconds process 0 waits for the others to connect, and they for it.
CONNECT_TIMEOUT_S = 300.0


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join the group: ``coordinator`` is ``HOST:PORT`` of process 0 (the same on every process)."""
    import jax

    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise BackendError(f"coordinator must be HOST:PORT, got {coordinator!r}")
    if num_processes < 2 or not 0 <= process_id < num_processes:
        raise BackendError(
            f"a group needs num_processes >= 2 and 0 <= process_id < num_processes, got {num_processes}, {process_id}"
        )
    if _group:
        raise BackendError("this process already joined a group")
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    _group.update(coordinator=coordinator, host=host, port=int(port) + 1, size=num_processes, rank=process_id)
    log.info("joined the group", coordinator=coordinator, process_id=process_id, num_processes=num_processes,
             devices=len(jax.devices()), local_devices=len(jax.local_devices()))  # fmt: skip


def rank() -> int | None:
    """This process's id in the group; None outside one."""
    return _group.get("rank")


def _key() -> bytes:
    secret = os.environ.get("RUVLLM_DISTRIBUTED_KEY") or f"ruvllm:{_group['coordinator']}"
    return hashlib.sha256(secret.encode()).digest()


#: Adapters the followers keep between steps (each side drops the least recently used beyond it).
ADAPTERS_HELD = 64


@dataclass(frozen=True)
class _AdapterRef:
    """An adapter in a forwarded batch: process 0's key of one the followers hold."""

    key: int


class Leader:
    """Process 0's model: a :class:`~ruvllm_jax.runner.JaxModel` whose program-running calls are sent to
    the other processes first. Everything else is the model's own."""

    def __init__(self, model: JaxModel) -> None:
        self.model = model
        self.options = model.options
        self.capabilities = model.capabilities
        self._caches: dict[int, int] = {}
        #: Adapters the followers hold, by this process's ``id()``: (the object, its version), least
        #: recently used first. A new or changed one crosses the channel once, before the step using it.
        self._adapters: OrderedDict[int, tuple[Any, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._conns: list[Connection] = []
        atexit.register(self.close)  # the followers then exit 0 instead of reporting process 0 gone
        listener = Listener((_group["host"], _group["port"]), authkey=_key())

        def accept() -> None:
            for _ in range(_group["size"] - 1):
                try:
                    conn = listener.accept()
                    joined = conn.recv()
                except (OSError, EOFError):  # the listener was closed: too late
                    return
                self._conns.append(conn)
                log.info("process joined", process_id=joined)

        waiter = threading.Thread(target=accept, daemon=True)
        waiter.start()
        waiter.join(CONNECT_TIMEOUT_S)
        listener.close()
        if len(self._conns) < _group["size"] - 1:
            raise BackendError(
                f"only {len(self._conns) + 1} of {_group['size']} processes joined within {CONNECT_TIMEOUT_S:.0f} s"
            )
        self._lost: str | None = None
        threading.Thread(target=self._watch, name="ruvllm-group-watch", daemon=True).start()

    def _watch(self) -> None:
        """Followers never write after joining, so a connection that turns readable has ended: the
        process is gone (or closing). Recorded for :meth:`health` at once, not at the next step."""
        from multiprocessing.connection import wait

        conns = list(self._conns)
        while conns and self._conns:
            try:
                ready = wait(conns, timeout=1.0)
            except (OSError, ValueError):  # closed by close()
                return
            for conn in ready:
                if not self._conns:
                    return
                self._lost = f"process {conns.index(conn) + 1} of the group is gone"
                log.error("process of the group lost", reason=self._lost)
                return

    def health(self) -> str | None:
        """None while every process of the group is connected; else which one is gone."""
        return self._lost

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def prepare_step(self, batch: ForwardBatch, cache: JaxKVCache) -> None:
        """Every step of a group goes through :meth:`forward` (its followers run it too)."""
        return None

    def _send(self, *message: Any) -> None:
        for i, conn in enumerate(self._conns, start=1):
            try:
                conn.send(message)
            except (OSError, EOFError) as exc:
                raise BackendError(f"process {i} of the group is gone ({type(exc).__name__}: {exc})") from None

    def kv_cache(self, num_blocks: int, block_size: int, options: dict[str, Any]) -> JaxKVCache:
        return self.allocate_cache(num_blocks, block_size, options)

    def allocate_cache(
        self, num_blocks: int, block_size: int, options: dict[str, Any] | None = None
    ) -> JaxKVCache:
        with self._lock:
            cache = self.model.allocate_cache(num_blocks, block_size, options)
            self._caches[id(cache)] = len(self._caches)
            self._send("cache", num_blocks, block_size, options)
            return cache

    def precompile(self, cache: JaxKVCache, limits: StepLimits, progress=None) -> list[tuple[str, float]]:
        with self._lock:
            self._send("precompile", self._caches[id(cache)], limits)
            return self.model.precompile(cache, limits, progress)

    def forward(self, batch: ForwardBatch, cache: JaxKVCache) -> ForwardOutput:
        with self._lock:  # every process must see the steps in one order
            self._send("forward", self._sendable(batch), self._caches[id(cache)])
            return self.model.forward(batch, cache)

    def _sendable(self, batch: ForwardBatch) -> ForwardBatch:
        """``batch`` with each adapter replaced by an :class:`_AdapterRef`; adapters the followers do
        not hold yet (or hold at another version) are sent first, and the least recently used beyond
        :data:`ADAPTERS_HELD` are dropped on both sides."""
        import dataclasses

        if all(c.adapter is None for c in batch.chunks):
            return batch
        new: dict[int, Any] = {}
        chunks = []
        for c in batch.chunks:
            if c.adapter is None:
                chunks.append(c)
                continue
            key, version = id(c.adapter), getattr(c.adapter, "version", None)
            held = self._adapters.get(key)
            if held is None or held[0] is not c.adapter or held[1] != version:
                self._adapters[key] = (c.adapter, version)
                new[key] = c.adapter
            self._adapters.move_to_end(key)
            chunks.append(dataclasses.replace(c, adapter=_AdapterRef(key)))
        dropped = []
        # This batch's adapters are the most recent: never among those dropped, however many.
        used = {c.adapter.key for c in chunks if c.adapter is not None}
        while len(self._adapters) > max(ADAPTERS_HELD, len(used)):
            key, _ = self._adapters.popitem(last=False)
            new.pop(key, None)
            dropped.append(key)
        if new or dropped:
            self._send("adapters", new, dropped)
        return dataclasses.replace(batch, chunks=chunks)

    def close(self) -> None:
        conns, self._conns = self._conns, []  # first: the watcher then knows the ends are ours
        for conn in conns:
            try:
                conn.send(("close",))
                conn.close()
            except (OSError, EOFError):
                pass


def follow(checkpoint: str, options: LoadOptions) -> None:
    """Load ``checkpoint`` as process 0 does and run what it sends until it closes; raises
    :class:`BackendError` when process 0 is gone without closing."""
    import dataclasses
    import time

    from ruvllm.checkpoint import open_checkpoint
    from ruvllm_jax.runner import JaxModel

    if not _group or _group["rank"] == 0:
        raise BackendError("follow() is for processes 1.. of a group (call initialize() first)")
    model = JaxModel.load(open_checkpoint(checkpoint), options)
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            conn = Client((_group["host"], _group["port"]), authkey=_key())
            break
        except OSError:
            if time.monotonic() > deadline:
                raise BackendError(f"process 0 did not open {_group['host']}:{_group['port']}") from None
            time.sleep(0.2)
    conn.send(_group["rank"])
    caches: list[JaxKVCache] = []
    adapters: dict[int, Any] = {}
    while True:
        try:
            message = conn.recv()
        except (OSError, EOFError):
            raise BackendError("process 0 of the group is gone") from None
        kind = message[0]
        if kind == "close":
            return
        if kind == "cache":
            caches.append(model.allocate_cache(*message[1:]))
        elif kind == "precompile":
            model.precompile(caches[message[1]], message[2])
        elif kind == "adapters":
            adapters.update(message[1])
            for key in message[2]:
                adapters.pop(key, None)
        elif kind == "forward":
            batch = message[1]
            if any(isinstance(c.adapter, _AdapterRef) for c in batch.chunks):
                chunks = [
                    dataclasses.replace(c, adapter=adapters[c.adapter.key]) if isinstance(c.adapter, _AdapterRef) else c
                    for c in batch.chunks
                ]
                batch = dataclasses.replace(batch, chunks=chunks)
            try:
                model.forward(batch, caches[message[2]])
            except Exception as exc:  # process 0 ran the same step and met the same error
                log.warning("step failed", error=repr(exc))
        else:
            raise BackendError(f"unknown message {kind!r} from process 0")
