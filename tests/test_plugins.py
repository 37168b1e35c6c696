"""Plugins come in through the `ruvllm` entry-point group: found, restricted, reported when broken."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ruvllm.plugins import load_plugins


def _installed(dist: str) -> bool:
    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _installed("ruvllm-example-plugin"),
    reason="the test session installs tests/plugins/ruvllm-example-plugin (nox -s tests)",
)


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruvllm", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RUVLLM_LOG": "ERROR", **env},
    )


def test_third_party_plugin_is_found_with_its_hooks() -> None:
    host = load_plugins(allowed="")
    rec = {r.name: r for r in host.records}["example"]
    assert rec.error is None
    assert {"pre_inference", "post_inference", "register_commands"} <= set(rec.hooks)
    proc = run_cli("plugins")
    assert proc.returncode == 0
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("example "))
    assert "0.0.1" in line and "pre_inference" in line and "post_inference" in line


def test_builtin_backend_comes_through_the_same_door() -> None:
    host = load_plugins(allowed="")
    names = {r.name for r in host.records if r.error is None}
    assert "candle-compat" in names
    assert "candle-compat" in host.backends


def test_plugin_command_is_added() -> None:
    proc = run_cli("example-echo", "hello", "world")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "hello world"


def test_restricting_plugins_excludes_the_rest() -> None:
    host = load_plugins(allowed="candle-compat")
    assert [r.name for r in host.records] == ["candle-compat"]
    proc = run_cli("plugins", RUVLLM_PLUGINS="candle-compat")
    assert "example" not in proc.stdout
    proc = run_cli("example-echo", "x", RUVLLM_PLUGINS="candle-compat")
    assert proc.returncode != 0  # the command went away with its plugin


@pytest.mark.skipif(not _installed("ruvllm-broken-plugin"), reason="installed by the nox test session")
def test_broken_plugin_is_reported_not_fatal() -> None:
    host = load_plugins(allowed="")
    rec = {r.name: r for r in host.records}["broken"]
    assert rec.error is not None and "broken on purpose" in rec.error
    assert "example" in {r.name for r in host.records if r.error is None}
    proc = run_cli("plugins")
    assert proc.returncode == 0
    assert "broken 0.0.1  FAILED TO LOAD: RuntimeError: ruvllm-broken-plugin is broken on purpose" in proc.stdout


def test_pre_and_post_inference_hooks_run(tmp_path: Path, smollm2_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    proc = run_cli(
        "generate", "smollm2", "The capital of France is", "--max-tokens", "3", "--temperature", "0",
        "--backend", "candle-compat", RUVLLM_EXAMPLE_PLUGIN_LOG=str(log),
    )
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["hook"] for e in events] == ["pre_inference", "post_inference"]
    assert events[0]["request_id"] == events[1]["request_id"]
    assert events[0]["prompt_tokens"] > 0
    assert events[1]["completion_tokens"] == 3
    assert events[1]["text"].strip() and events[1]["text"] in proc.stdout

    # Excluded by RUVLLM_PLUGINS, the plugin never runs.
    log.unlink()
    proc = run_cli(
        "generate", "smollm2", "Hi", "--max-tokens", "2", "--temperature", "0",
        "--backend", "candle-compat", RUVLLM_PLUGINS="candle-compat", RUVLLM_EXAMPLE_PLUGIN_LOG=str(log),
    )
    assert proc.returncode == 0, proc.stderr
    assert not log.exists()
