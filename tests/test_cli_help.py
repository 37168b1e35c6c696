"""Every command's ``--help`` prints its usage and exits 0, including those plugins add (``serve``):
a help string argparse cannot expand (a bare ``%`` in a default's description once crashed
``ruvllm serve --help`` with a TypeError) fails here instead of in a user's terminal."""

from __future__ import annotations

import argparse

import pytest

from ruvllm.cli import build_parser
from ruvllm.plugins import load_plugins


def _commands() -> list[str]:
    parser = build_parser(load_plugins())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_the_server_plugin_adds_serve():
    assert "serve" in _commands() and "generate" in _commands()


@pytest.mark.parametrize("command", _commands())
def test_help_of_every_command_prints_and_exits_zero(command, capsys):
    parser = build_parser(load_plugins())
    with pytest.raises(SystemExit) as done:
        parser.parse_args([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: ruvllm {command}" in out  # after any plugin warning the load logged


def test_logging_writes_to_stderr_as_it_is_when_a_line_is_written(monkeypatch):
    # The CLI sets logging up once; a stream replaced (and closed) since, as pytest's capture is after
    # a test that ran the CLI in-process, must not break every later log line ("I/O operation on
    # closed file" failed the setup of 39 tests that ran after one such test).
    import io
    import sys

    import structlog

    from ruvllm.log_setup import configure_logging

    saved = structlog.get_config()
    try:
        first = io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        configure_logging()
        first.close()
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        structlog.get_logger("t").warning("after the stream changed", n=1)
        assert "after the stream changed" in second.getvalue()
    finally:
        structlog.configure(**saved)
