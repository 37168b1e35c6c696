"""One model across two processes (issue 19, part 1): ``jax.distributed`` over gloo on this machine,
tensor parallelism over both processes' devices (one CPU device each), process 0 running the engine
and the other following it (``ruvllm_jax.distributed``). The greedy tokens of three prompts are those
of one process, for a tiny Llama and for SmolLM2; killing the follower fails the leader's next step
with an error naming the lost process, within seconds, not a hang."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "_distributed_check.py"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the coordinator and the step channel)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def spawn(role: str, path: str, coordinator: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), role, path, coordinator],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )


def tokens_of(out: str) -> list[list[int]]:
    (line,) = [ln for ln in out.splitlines() if ln.startswith("TOKENS ")]
    return json.loads(line[len("TOKENS ") :])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from _jax_fixtures import write_tiny_hf_model
    from _tiny_served_fixtures import write_word_tokenizer

    path = write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")
    write_word_tokenizer(path)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny", "smollm2", "tiny-lora", "tiny-device"])
def test_two_processes_give_the_tokens_of_one(which, tiny, smollm2_path):
    """``tiny-lora``: two LoRA adapters and the base model in one batch (the adapters cross the
    channel to the follower once, then are referred to by key). ``tiny-device``: seeded sampling on
    the device, every process running the sampler on the vocabulary-sharded logits."""
    path = str(smollm2_path) if which == "smollm2" else tiny
    suffix = which[len("tiny") :] if which.startswith("tiny-") else ""
    alone = subprocess.run(
        [sys.executable, str(SCRIPT), f"alone{suffix}", path, "-"], capture_output=True, text=True, env=ENV, timeout=600
    )
    assert alone.returncode == 0, alone.stderr[-2000:]
    coordinator = f"127.0.0.1:{free_port_pair()}"
    follower = spawn("follower", path, coordinator)
    leader = spawn(f"leader{suffix}", path, coordinator)
    try:
        out, _ = leader.communicate(timeout=600)
        fout, _ = follower.communicate(timeout=120)
    finally:
        for p in (leader, follower):
            p.kill()
    assert leader.returncode == 0, out[-3000:]
    assert follower.returncode == 0 and "FOLLOWER DONE" in fout, fout[-3000:]
    assert "devices=2 local_devices=1" in fout  # the mesh spans both processes
    assert tokens_of(out) == tokens_of(alone.stdout)
    if suffix == "-lora":  # the adapters change what the first two prompts generate; the third has none
        plain = subprocess.run(
            [sys.executable, str(SCRIPT), "alone", path, "-"], capture_output=True, text=True, env=ENV, timeout=600
        )
        with_lora, without = tokens_of(out), tokens_of(plain.stdout)
        assert with_lora[0] != without[0] and with_lora[1] != without[1]
        assert with_lora[2] == without[2]


def test_a_dead_follower_fails_the_leaders_next_step_quickly(tiny):
    coordinator = f"127.0.0.1:{free_port_pair()}"
    follower = spawn("follower", tiny, coordinator)
    leader = spawn("leader-rounds", tiny, coordinator)
    lines: list[str] = []
    try:
        assert leader.stdout is not None
        for line in leader.stdout:
            lines.append(line)
            if line.startswith("ROUND 2"):
                break
        else:
            pytest.fail("".join(lines)[-3000:])
        t0 = time.monotonic()
        follower.kill()
        rest, _ = leader.communicate(timeout=120)
        seconds = time.monotonic() - t0
    finally:
        for p in (leader, follower):
            p.kill()
    (error,) = [ln for ln in rest.splitlines() if ln.startswith("ERROR ")]
    assert leader.returncode == 1
    assert "gone" in error or "Gloo" in error or "Connection reset" in error, error
    assert seconds < 30, f"the leader took {seconds:.1f} s to fail"


def test_ruvllm_serve_as_process_0_and_ruvllm_follow(tiny, tmp_path):
    """The commands of docs/scaling.md: ``ruvllm serve --coordinator --num-processes --tensor-parallel``
    serves through a group whose other process runs ``ruvllm follow``; its greedy completion is that
    of a plain ``ruvllm serve``; when process 0 stops, the follower exits 0."""
    import httpx
    from _server_fixtures import free_port, wait_until_ready

    def serve(port: int, *extra: str) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"serve-{port}.log"
        cmd = [sys.executable, "-m", "ruvllm", "serve", tiny, "--backend", "jax", "--port", str(port),
               "--no-precompile", "--quantization", "none", "--served-model-name", "tiny", *extra]  # fmt: skip
        return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV), log

    def complete(port: int) -> str:
        body = {"model": "tiny", "prompt": "w5 w6 w7 w8", "max_tokens": 6, "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    coordinator = f"127.0.0.1:{free_port_pair()}"
    group = ["--coordinator", coordinator, "--num-processes", "2", "--tensor-parallel", "2"]
    port, alone_port = free_port(), free_port()
    leader, llog = serve(port, *group)
    follower = subprocess.Popen(
        [sys.executable, "-m", "ruvllm", "follow", tiny, "--coordinator", coordinator, "--num-processes", "2",
         "--process-id", "1", "--tensor-parallel", "2", "--quantization", "none"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
    )  # fmt: skip
    alone, alog = serve(alone_port)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", leader, llog, 180)
        wait_until_ready(f"http://127.0.0.1:{alone_port}", alone, alog, 180)
        assert complete(port) == complete(alone_port)
        leader.terminate()
        leader.wait(timeout=60)
        out, _ = follower.communicate(timeout=60)
        assert follower.returncode == 0, out[-3000:]
    finally:
        for p in (leader, follower, alone):
            p.kill()


def test_ready_turns_503_when_a_follower_dies_without_traffic(tiny, tmp_path):
    """Process 0 watches its followers' connections: when one dies, ``/ready`` answers 503 naming the
    lost process (and ``/health`` says why) before any request meets the failure."""
    import httpx
    from _server_fixtures import free_port, wait_until_ready

    coordinator = f"127.0.0.1:{free_port_pair()}"
    port = free_port()
    log = tmp_path / "serve.log"
    leader = subprocess.Popen(
        [sys.executable, "-m", "ruvllm", "serve", tiny, "--backend", "jax", "--port", str(port), "--no-precompile",
         "--quantization", "none", "--coordinator", coordinator, "--num-processes", "2", "--tensor-parallel", "2"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV,
    )  # fmt: skip
    follower = subprocess.Popen(
        [sys.executable, "-m", "ruvllm", "follow", tiny, "--coordinator", coordinator, "--num-processes", "2",
         "--process-id", "1", "--tensor-parallel", "2", "--quantization", "none"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_ready(base, leader, log, 180)
        follower.kill()
        follower.wait(timeout=30)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            r = httpx.get(f"{base}/ready", timeout=10)
            if r.status_code == 503:
                break
            time.sleep(0.1)
        seconds = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert r.json()["status"] == "failed" and "process 1 of the group is gone" in r.json()["detail"], r.text
        assert seconds < 5, f"/ready took {seconds:.1f} s to turn unready"
        health = httpx.get(f"{base}/health", timeout=10)
        assert "process 1 of the group is gone" in health.text, health.text
    finally:
        for p in (leader, follower):  # kill: a clean exit would wait on the runtime's shutdown barrier
            p.kill()


def test_leader_sends_each_adapter_once_and_drops_the_least_recently_used(monkeypatch):
    """Process 0's bookkeeping of the adapters its followers hold (no group needed): an adapter
    crosses once, again when its version changes; beyond ADAPTERS_HELD the least recently used are
    dropped on both sides, never one the batch being sent uses."""
    import threading
    from collections import OrderedDict

    import numpy as np

    from ruvllm.backend import ForwardBatch, SequenceChunk
    from ruvllm_jax import distributed

    class Adapter:
        def __init__(self, version: int = 1) -> None:
            self.version = version

    leader = distributed.Leader.__new__(distributed.Leader)
    leader._adapters, leader._lock, sent = OrderedDict(), threading.Lock(), []
    leader._send = lambda *message: sent.append(message)
    monkeypatch.setattr(distributed, "ADAPTERS_HELD", 2)

    def batch(*adapters):
        one = np.array([1], dtype=np.int32)
        return ForwardBatch([SequenceChunk(one, 0, one, adapter=a) for a in adapters], 16)

    a, b, c = Adapter(), Adapter(), Adapter()
    out = leader._sendable(batch(a, None, b, c))  # three in one step: all held, none dropped
    assert [type(ch.adapter).__name__ if ch.adapter else None for ch in out.chunks] == [
        "_AdapterRef", None, "_AdapterRef", "_AdapterRef",
    ]  # fmt: skip
    assert sent == [("adapters", {id(a): a, id(b): b, id(c): c}, [])]
    sent.clear()
    leader._sendable(batch(c))  # held already: nothing crosses; a, the least recent, is dropped
    assert sent == [("adapters", {}, [id(a)])]
    sent.clear()
    c.version = 2  # changed in place: crosses again
    leader._sendable(batch(c))
    assert sent == [("adapters", {id(c): c}, [])]
    sent.clear()
    leader._sendable(batch(c))
    assert sent == []
