"""A live ruvllm server for tests: uvicorn on 127.0.0.1 (a free port) in a background thread.

The loaded SmolLM2 model is shared by every server of the session; each server gets its own engine,
KV cache and settings.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

#: Every wait in these tests is bounded by this many seconds.
STARTUP_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ready(base: str, proc: Any, log: Any, timeout: float) -> None:
    """Poll ``base``/ready until it answers 200; fail with the server's log (a path) if the process
    ``proc`` exits or ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.25)


@dataclass
class LiveServer:
    base_url: str
    app: Any
    server: Any

    @property
    def state(self) -> Any:
        return self.app.server

    def url(self, path: str) -> str:
        return self.base_url + path


@contextlib.contextmanager
def live_server(model: Any, /, **settings: Any) -> Iterator[LiveServer]:
    """Serve ``model`` with ``settings`` (ServerSettings fields) until the block exits."""
    import uvicorn

    from ruvllm_server.app import create_app
    from ruvllm_server.settings import ServerSettings

    settings.setdefault("model", "smollm2")
    settings.setdefault("num_kv_blocks", 512)
    settings.setdefault("drain_timeout", 10.0)
    app = create_app(ServerSettings(**settings), model)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    while httpx.get(base + "/ready", timeout=5).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the test server did not become ready")
        time.sleep(0.1)
    try:
        yield LiveServer(base, app, server)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path: Any) -> Any:
    """SmolLM2 loaded on the NumPy (candle-compat) backend, once per session."""
    from ruvllm.errors import BackendError
    from ruvllm.runtime import load_model

    try:
        return load_model(str(smollm2_path), backend="candle-compat")
    except BackendError as exc:
        pytest.skip(f"candle-compat backend not usable: {exc}")


#: Function tools the tool-call tests ask SmolLM2 to call (its chat template reads tools).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
