"""The plugin door: what packages may import (grep-level, over the sources), a third-party plugin
that adds an HTTP route and observes model load through hooks, and a server that works with the
SONA package gone from the environment."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "ruvllm": ROOT / "packages/ruvllm-core/src/ruvllm",
    "ruvllm_candle_compat": ROOT / "packages/ruvllm-backend-candle-compat/src/ruvllm_candle_compat",
    "ruvllm_jax": ROOT / "packages/ruvllm-backend-jax/src/ruvllm_jax",
    "ruvllm_mlx": ROOT / "packages/ruvllm-backend-mlx/src/ruvllm_mlx",
    "ruvllm_sona": ROOT / "packages/ruvllm-sona/src/ruvllm_sona",
    "ruvllm_server": ROOT / "packages/ruvllm-server/src/ruvllm_server",
}
FORBIDDEN = {
    "ruvllm": {"ruvllm_candle_compat", "ruvllm_jax", "ruvllm_mlx", "ruvllm_sona", "ruvllm_server"},
    "ruvllm_candle_compat": {"ruvllm_jax", "ruvllm_mlx", "ruvllm_sona", "ruvllm_server"},
    "ruvllm_jax": {"ruvllm_candle_compat", "ruvllm_mlx", "ruvllm_sona", "ruvllm_server"},
    "ruvllm_mlx": {"ruvllm_candle_compat", "ruvllm_jax", "ruvllm_sona", "ruvllm_server"},
    "ruvllm_sona": {"ruvllm_server", "ruvllm_mlx"},
    "ruvllm_server": {"ruvllm_candle_compat", "ruvllm_jax", "ruvllm_mlx", "ruvllm_sona"},
}
#: Deprecated forwarders core keeps for one release after their code moved to the server; each may
#: import only the server module that replaced it. Drop an entry when its module goes.
MOVED_TO_SERVER = {
    "packages/ruvllm-core/src/ruvllm/tools.py": "ruvllm_server.tools",
    "packages/ruvllm-core/src/ruvllm/reasoning.py": "ruvllm_server.reasoning",
    "packages/ruvllm-core/src/ruvllm/hookspecs.py": "ruvllm_server.hookspecs",  # RouteContext
}
IMPORT = re.compile(r"^\s*(?:from|import)\s+([a-zA-Z_][\w]*)((?:\.\w+)*)", re.M)


@pytest.mark.parametrize("package", list(PACKAGES))
def test_package_imports_stay_inside_their_boundaries(package):
    bad = []
    for path in PACKAGES[package].rglob("*.py"):
        where = path.relative_to(ROOT).as_posix()
        for top, rest in IMPORT.findall(path.read_text(encoding="utf-8")):
            if top in FORBIDDEN[package] and MOVED_TO_SERVER.get(where) != top + rest:
                bad.append(f"{where} imports {top + rest}")
    assert not bad, bad


def test_core_knows_only_its_own_hooks():
    """Hooks only the server calls are specified by the server, which adds them to the host; core's
    plugin manager alone knows none of them, and a plugin implementing them still registers."""
    from ruvllm import hookspecs
    from ruvllm.plugins import load_plugins
    from ruvllm_server.hookspecs import server_hooks

    for name in ("register_routes", "register_tool_parsers", "register_reasoning_parsers"):
        assert not hasattr(hookspecs, name)
    host = load_plugins()
    assert not host.hook.register_routes.has_spec()  # the example plugin implements it, unverified
    relay = server_hooks(host)
    server_hooks(host)  # adding them twice is harmless
    assert relay.register_routes.has_spec() and relay.register_tool_parsers.has_spec()


def test_the_moved_modules_still_import_with_a_warning():
    import importlib
    import sys

    for old, new in (("ruvllm.tools", "ruvllm_server.tools"), ("ruvllm.reasoning", "ruvllm_server.reasoning")):
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
            forwarded = importlib.import_module(old)
        moved = importlib.import_module(new)
        assert all(getattr(forwarded, n) is getattr(moved, n) for n in forwarded.__all__)
    from ruvllm import hookspecs
    from ruvllm_server.hookspecs import RouteContext

    with pytest.warns(DeprecationWarning, match="RouteContext moved"):
        assert hookspecs.RouteContext is RouteContext


def test_optional_backend_features_are_declared_not_probed():
    """Core and the server check a backend model's optional methods through the protocols backend.py
    declares; a third-party model without them (the float64 test plugin) gets their defaults."""
    from ruvllm.backend import OPTIONAL_MODEL_FEATURES

    probes = re.compile(r"(?:getattr|hasattr)\(\s*(?:self\.)?model(?:\.model)?\s*,\s*\"(\w+)\"")
    declared = {m for f in OPTIONAL_MODEL_FEATURES for m in f.__dict__ if not m.startswith("_")}
    assert {"kv_reserve", "health", "device_memory", "weight_bytes"} <= declared
    found = []
    for package in ("ruvllm", "ruvllm_server"):
        for path in PACKAGES[package].rglob("*.py"):
            found += [f"{path.name}: {n}" for n in probes.findall(path.read_text(encoding="utf-8")) if n in declared]
    assert not found, found


def test_a_plugin_adds_a_route_and_observes_model_load(smollm2_model, tmp_path, monkeypatch):  # noqa: F811
    log = tmp_path / "events.jsonl"
    monkeypatch.setenv("RUVLLM_EXAMPLE_PLUGIN_LOG", str(log))
    with live_server(smollm2_model, plugin_options={"example": {"route": "on", "name": "ruvllm"}}) as srv:
        r = httpx.get(srv.url("/v1/example/hello"), timeout=30)
    assert r.status_code == 200 and r.json() == {"hello": "ruvllm", "key_id": None}
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert {"hook": "model_loaded", "model": smollm2_model.name, "options": {"route": "on", "name": "ruvllm"}} in events
    with live_server(smollm2_model) as srv:  # without its option the plugin adds nothing
        assert httpx.get(srv.url("/v1/example/hello"), timeout=30).status_code == 404


def test_options_for_a_plugin_that_is_not_installed_are_refused(smollm2_model):  # noqa: F811
    from ruvllm_server.settings import ServerConfigError

    with (
        pytest.raises(ServerConfigError, match="'nonesuch', which is not installed"),
        live_server(smollm2_model, plugin_options={"nonesuch": {"x": "1"}}),
    ):
        pass


def test_plugin_options_parse_from_flags_env_and_toml(tmp_path):
    from ruvllm_server.settings import ServerConfigError, load_settings

    s = load_settings({"model": "m", "plugin_options": ["sona.scope=user", "example.route=on"]})
    assert s.plugin_options == {"sona": {"scope": "user"}, "example": {"route": "on"}}
    s = load_settings({"model": "m", "sona": True}, environ={"RUVLLM_PLUGIN_OPTIONS": "sona.state_dir=/tmp/x"})
    assert s.effective_plugin_options == {"sona": {"state_dir": "/tmp/x", "enabled": "true"}}
    cfg = tmp_path / "c.toml"
    cfg.write_text('model = "m"\n[plugin_options.example]\nroute = "on"\n')
    assert load_settings(config_file=cfg, environ={}).plugin_options == {"example": {"route": "on"}}
    with pytest.raises(ServerConfigError, match=r"name\.key=value"):
        load_settings({"model": "m", "plugin_options": ["nodot=1"]})


def test_the_server_works_without_the_sona_package(smollm2_path):
    """ruvllm-sona blocked from import: the server imports, serves a chat completion, and refuses
    --sona with one line."""
    code = f"""
import sys
sys.modules["ruvllm_sona"] = None  # as if the package were not installed
from litestar.testing import TestClient
from ruvllm.runtime import load_model
from ruvllm_server.app import create_app
from ruvllm_server.settings import ServerConfigError, ServerSettings
model = load_model({str(smollm2_path)!r}, backend="candle-compat")
with TestClient(create_app(ServerSettings(model="smollm2", num_kv_blocks=64), model)) as c:
    r = c.post("/v1/chat/completions", json={{"model": "smollm2", "max_tokens": 3,
               "messages": [{{"role": "user", "content": "hi"}}]}})
    assert r.status_code == 200, r.text
    print("chat ok", r.json()["usage"]["completion_tokens"])
try:
    create_app(ServerSettings(model="smollm2", num_kv_blocks=64, sona=True), model)
except ServerConfigError as exc:
    print("refused:", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "chat ok 3" in out.stdout
    assert "refused: options given for plugin 'sona', which is not installed (pip install ruvllm-sona)" in out.stdout
