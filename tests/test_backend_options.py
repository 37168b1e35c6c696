"""``--backend-option KEY=VALUE``: a backend's load options (``LoadOptions.extra``) from the command
line, the server's flags, TOML and environment, reaching the backend, which checks them and refuses
an unknown key by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_errors import assert_one_line_error, run_cli

from ruvllm.backend import parse_backend_options
from ruvllm.errors import BackendError
from ruvllm_server.settings import ServerConfigError, load_settings


def test_parse_backend_options_forms() -> None:
    assert parse_backend_options(None) == {}
    assert parse_backend_options(["mmap_experts=true", "attention = pallas"]) == {
        "mmap_experts": "true",
        "attention": "pallas",
    }
    assert parse_backend_options("a=1, b=x=y") == {"a": "1", "b": "x=y"}  # the first '=' splits
    assert parse_backend_options({"unroll-layers": True}) == {"unroll_layers": "True"}
    with pytest.raises(BackendError, match="must look like key=value"):
        parse_backend_options(["mmap_experts"])
    with pytest.raises(BackendError, match="use --threads"):
        parse_backend_options(["threads=4"])  # one spelling per option
    with pytest.raises(BackendError, match="use --tensor-parallel"):
        parse_backend_options({"tensor-parallel": 2})


def test_server_settings_read_backend_options(tmp_path: Path) -> None:
    assert load_settings(environ={}).backend_options == {}
    env = {"RUVLLM_BACKEND_OPTIONS": "attention=xla,unroll_layers=false"}
    assert load_settings(environ=env).backend_options == {"attention": "xla", "unroll_layers": "false"}
    cfg = tmp_path / "server.toml"
    cfg.write_text('[backend_options]\nmmap_experts = "true"\n')
    assert load_settings(config_file=cfg, environ={}).backend_options == {"mmap_experts": "true"}
    # Flags replace the environment's table, as every other setting does.
    s = load_settings({"backend_options": ["native=false"]}, environ=env)
    assert s.backend_options == {"native": "false"}
    with pytest.raises(ServerConfigError, match="has a flag of its own"):
        load_settings({"backend_options": ["device=cpu"]}, environ={})
    with pytest.raises(ServerConfigError, match="key=value"):
        load_settings(environ={"RUVLLM_BACKEND_OPTIONS": "oops"})


def test_cli_backend_option_reaches_the_backend(smollm2_path: Path) -> None:
    # An unknown key: jax names it and its known options, in one line.
    proc = run_cli("generate", str(smollm2_path), "hi", "--backend", "jax", "--backend-option", "bogus=1")
    assert_one_line_error(proc, "unknown option", "bogus")
    # A known key with text jax cannot read: refused by name (bool("false") would have been true).
    proc = run_cli(
        "generate", str(smollm2_path), "hi", "--backend", "jax", "--backend-option", "keep_gguf_blocks=maybe"
    )
    assert_one_line_error(proc, "keep_gguf_blocks must be true or false")
    proc = run_cli("generate", str(smollm2_path), "hi", "--backend-option", "noequals")
    assert_one_line_error(proc, "key=value")


def test_cli_backend_option_is_applied(smollm2_path: Path) -> None:
    """A valid option loads and generates: keep_gguf_blocks=false through text, with quantization none."""
    proc = run_cli(
        "generate", str(smollm2_path), "The capital of France is", "--backend", "jax", "--quantization", "none",
        "--backend-option", "keep_gguf_blocks=false", "--backend-option", "unroll_layers=false",
        "--max-tokens", "3", "--temperature", "0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
