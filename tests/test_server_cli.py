"""``ruvllm serve`` as a real process: settings printed with secrets masked, JSON access logs with
request ids, ``curl -N`` streaming, graceful drain on SIGTERM; bad settings fail with one line; the
``uvicorn --factory`` entry reports a model that cannot load through /ready."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from _server_fixtures import free_port, wait_until_ready

SECRET = "sk-cli-secret-123"
AUTH = {"Authorization": f"Bearer {SECRET}"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUVLLM_")}
    env["RUVLLM_LOG"] = "INFO"
    return env


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_path):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ruvllm", "serve", str(smollm2_path), "--served-model-name", "smollm2",
             "--backend", "candle-compat", "--port", str(port), "--num-kv-blocks", "128", "--api-key", SECRET],
            stdout=subprocess.DEVNULL, stderr=err, env=_env(),
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    wait_until_ready(base, proc, log, 180)
    yield proc, base, log
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def test_settings_printed_with_secret_masked(served) -> None:
    _, _, log = served
    text = log.read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("ruvllm serve {"))
    shown = json.loads(line[len("ruvllm serve ") :])
    assert shown["api_keys"] == ["***"] and shown["num_kv_blocks"] == 128 and shown["backend"] == "candle-compat"
    assert SECRET not in text


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_sse_until_done(served) -> None:
    _, base, log = served
    body = json.dumps(
        {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    )
    out = subprocess.run(
        ["curl", "-sS", "-N", "--max-time", "120", "-H", f"Authorization: Bearer {SECRET}",
         "-H", "Content-Type: application/json", "-H", "X-Request-ID: curl-check-1", "-d", body,
         f"{base}/v1/chat/completions"],
        capture_output=True, text=True, timeout=150, check=True,
    )  # fmt: skip
    events = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert all(ln.startswith("data: ") for ln in events), out.stdout
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in events[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    # The access log is JSON (stderr is a file) and carries the request id we sent.
    deadline = time.monotonic() + 10
    while True:
        records = [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith("{")]
        mine = [r for r in records if r.get("request_id") == "curl-check-1" and r.get("event") == "request"]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert mine and mine[0]["status"] == 200 and mine[0]["path"] == "/v1/chat/completions"
    assert mine[0]["user"].startswith("key-") and SECRET not in json.dumps(records)


def test_sigterm_drains_the_stream_in_flight(served) -> None:
    proc, base, log = served
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 12, "stream": True, "ignore_eos": True}
    events: list[str] = []
    started = threading.Event()

    def consume() -> None:
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    started.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert started.wait(120)
    proc.send_signal(signal.SIGTERM)
    reader.join(timeout=150)
    assert events[-1] == "data: [DONE]"
    finishes = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes[-1] == "length"
    # uvicorn re-raises the signal once it has shut down cleanly, so the exit status says SIGTERM.
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    assert "Traceback" not in log.read_text()


def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**_env(), "RUVLLM_LOG": "ERROR", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ruvllm", *args], capture_output=True, text=True, timeout=120, env=full
    )


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["serve", "smollm2", "--port", "99999"], {}, "port"),
        (["serve", "smollm2"], {"RUVLLM_MAX_CONCURRENT": "zero"}, "max_concurrent"),
        (["serve", "/nonexistent/model.gguf"], {}, "not found"),
        (["serve"], {}, "no model"),
    ],
)
def test_bad_settings_fail_with_one_line(args: list[str], env: dict[str, str], needle: str) -> None:
    proc = _run_cli(*args, env=env)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0].lower(), proc.stderr


def test_config_file_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "server.toml"
    cfg.write_text("max_queue = -4\n")
    proc = _run_cli("serve", "smollm2", "--config", str(cfg))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "max_queue" in lines[0]


def test_factory_reports_a_model_that_cannot_load(monkeypatch, tmp_path: Path) -> None:
    from litestar.testing import TestClient

    from ruvllm_server.app import app_factory

    monkeypatch.setenv("RUVLLM_MODEL", str(tmp_path / "missing.gguf"))
    monkeypatch.setenv("RUVLLM_LOG", "CRITICAL")
    with TestClient(app_factory()) as client:
        assert client.get("/health").status_code == 200
        deadline = time.monotonic() + 30
        while (ready := client.get("/ready")).json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
        assert "not found" in ready.json()["detail"]
        r = client.get("/v1/models")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert r.headers["retry-after"] == "5"


def test_any_load_exception_is_reported_and_serve_exits_non_zero(monkeypatch, capsys) -> None:
    """A loader that fails with an arbitrary exception (not one of ruvllm's): /ready turns 503 with the
    reason instead of staying at "loading", and ``ruvllm serve`` exits non-zero with one line."""
    from litestar.testing import TestClient

    import ruvllm_server.state
    from ruvllm.cli import main
    from ruvllm_server.app import app_factory

    def broken_loader(settings):
        raise ZeroDivisionError("the weights divide by zero")

    monkeypatch.setattr(ruvllm_server.state, "load_model", broken_loader)
    monkeypatch.setenv("RUVLLM_MODEL", "smollm2")
    monkeypatch.setenv("RUVLLM_LOG", "CRITICAL")
    with TestClient(app_factory()) as client:
        deadline = time.monotonic() + 30
        while (ready := client.get("/ready")).json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
        assert "ZeroDivisionError: the weights divide by zero" in ready.json()["detail"]
    capsys.readouterr()
    assert main(["serve", "smollm2"]) != 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and '"level"' not in ln]
    assert len(err) == 1 and "ZeroDivisionError" in err[0], err
