"""Where a batch-1 decode step's time goes, part by part, for one greedy stream on the JAX backend
(SmolLM2 w4a8 by default), and what the server adds when the tokens are streamed over HTTP.

The parts are timed by wrapping the engine's and the backend's functions in this process (self
time: a part's time less that of the parts it calls); nothing in the library changes:

    scheduling      Scheduler.schedule and update_after_forward
    step inputs     the engine's batch (StepExecutor.sampling_rows, run less the forward) and the
                    backend's _prepare (step_inputs: positions, block tables, the plan)
    dispatch        the backend's forward less _prepare and the wait (jit call, device sampling call)
    compute         waiting for the step's result on the host (_to_host): the model itself
    sampling        LLMEngine._sample less appending the token
    detokenization  IncrementalDetokenizer.push / flush
    outputs         appending the token (stop strings, finish checks) and building RequestOutputs
    other           the rest of LLMEngine.step

``--server`` then serves the same model in this process (uvicorn in a thread, as ``ruvllm serve``
runs it) and streams the same request as SSE: the stream's time per token against the engine's
step, and the CPU time the event-loop thread spends per token (queue hand-off, chunk building,
JSON and SSE encoding, the HTTP write; the thread's CPU clock, POSIX only).

    python benchmarks/profile_decode_step.py --tokens 256 --runs 5 --server

Medians over runs; the first run of each kind is a warm-up and not counted. Nothing here is run by
the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import socket
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

PROMPT = "Write a long story about a lighthouse keeper and the sea."
PARTS = ("scheduling", "step inputs", "dispatch", "compute", "sampling", "detokenization", "outputs", "other")


class PartTimer:
    """Self time per part: nested timed calls are subtracted from their caller's part."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._children: list[float] = []

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._children.append(0.0)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                children = self._children.pop()
                self.seconds[part] += elapsed - children
                if self._children:
                    self._children[-1] += elapsed

        return timed

    def reset(self) -> None:
        self.seconds.clear()


def instrument(engine: Any, timer: PartTimer) -> None:
    import ruvllm_jax.runner as runner
    from ruvllm.tokenizer import IncrementalDetokenizer

    sched, executor = engine.scheduler, engine.executor
    model = getattr(executor.model, "model", executor.model)  # the backend model under a LoadedModel
    sched.schedule = timer.wrap("scheduling", sched.schedule)
    sched.update_after_forward = timer.wrap("scheduling", sched.update_after_forward)
    executor.sampling_rows = timer.wrap("step inputs", executor.sampling_rows)
    executor.run = timer.wrap("step inputs", executor.run)
    model._prepare = timer.wrap("step inputs", model._prepare)
    model.forward = timer.wrap("dispatch", model.forward)
    runner._to_host = timer.wrap("compute", runner._to_host)
    engine._sample = timer.wrap("sampling", engine._sample)
    engine.outputs.append_token = timer.wrap("outputs", engine.outputs.append_token)
    engine._emit = timer.wrap("outputs", engine._emit)
    IncrementalDetokenizer.push = timer.wrap("detokenization", IncrementalDetokenizer.push)
    IncrementalDetokenizer.flush = timer.wrap("detokenization", IncrementalDetokenizer.flush)
    engine.step = timer.wrap("other", engine.step)


def engine_run(engine: Any, timer: PartTimer, tokens: int) -> tuple[float, dict[str, float]]:
    """Per decode step: mean wall seconds and each part's mean self seconds."""
    from ruvllm.engine import GenerationRequest
    from ruvllm.sampling import SamplingParams

    prompt = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerationRequest(list(prompt), params, request_id=f"profile-{time.time_ns()}"))
    engine.step()  # the prefill
    timer.reset()
    steps = []
    while engine.has_unfinished():
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    return statistics.fmean(steps), {p: timer.seconds[p] / len(steps) for p in PARTS}


@contextlib.contextmanager
def serving(model: Any) -> Iterator[tuple[str, int]]:
    """Serve ``model`` from this process (uvicorn in a thread); yields the base URL and the CPU clock
    of the event-loop thread."""
    import httpx
    import uvicorn

    from ruvllm_server.app import create_app
    from ruvllm_server.settings import ServerSettings

    app = create_app(ServerSettings(model="smollm2", num_kv_blocks=512), model)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="server-loop", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not get ready in 300 s")
            time.sleep(0.25)
        assert thread.ident is not None
        yield url, time.pthread_getcpuclockid(thread.ident)
    finally:
        server.should_exit = True
        thread.join(30)


def stream_once(url: str, loop_clock: int, tokens: int) -> tuple[float, float]:
    """One streamed chat completion: seconds per token (first to last content chunk) and the
    event-loop thread's CPU seconds per chunk."""
    import httpx

    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    cpu0 = time.clock_gettime(loop_clock)
    stamps = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith('data: {"id"') and '"content":"' in line:
                stamps.append(time.perf_counter())
    cpu = time.clock_gettime(loop_clock) - cpu0
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1), cpu / len(stamps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quantization", default="w4a8")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--server", action="store_true", help="also stream over HTTP from a server in this process")
    args = ap.parse_args()

    from ruvllm.backend import LoadOptions
    from ruvllm.engine import LLMEngine
    from ruvllm.resolve import resolve
    from ruvllm.runtime import load_model

    model = load_model(str(resolve(args.model)), backend="jax", options=LoadOptions(quantization=args.quantization))
    engine = LLMEngine(model)
    timer = PartTimer()
    instrument(engine, timer)
    engine_run(engine, timer, 16)  # warm-up
    with serving(model) if args.server else contextlib.nullcontext() as srv:
        if srv is not None:
            stream_once(*srv, 16)  # warm-up
        rows, streamed = [], []
        for _ in range(args.runs):  # the engine and the server take turns, in the same conditions
            rows.append(engine_run(engine, timer, args.tokens))
            if srv is not None:
                streamed.append(stream_once(*srv, args.tokens))
    step = statistics.median(r[0] for r in rows)
    parts = {p: statistics.median(r[1][p] for r in rows) for p in PARTS}
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"{args.model} {args.quantization}, batch 1, {args.tokens} greedy tokens, {os.cpu_count()} CPUs: {cpu}")
    print(f"decode step {step * 1e3:.3f} ms; parts (self time); means per step, medians of {args.runs} runs:")
    for p in PARTS:
        print(f"  {p:<15} {parts[p] * 1e3:8.3f} ms")
    engine_own = sum(parts[p] for p in PARTS if p != "compute")
    print(f"  engine's own work (all but compute) {engine_own * 1e3:.3f} ms")
    if streamed:
        wall = statistics.median(s[0] for s in streamed)
        loop_cpu = statistics.median(s[1] for s in streamed)
        print(f"server SSE stream {wall * 1e3:.3f} ms per token (median of {args.runs} runs)")
        print(f"  over the engine's step {(wall - step) * 1e3:.3f} ms per token")
        print(f"  event-loop thread CPU {loop_cpu * 1e3:.3f} ms per token")


if __name__ == "__main__":
    main()
