"""structlog set-up shared by the CLI and the server: level from ``RUVLLM_LOG`` (or --verbose)."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def _stderr_logger(*args: object) -> structlog.PrintLogger:
    return structlog.PrintLogger(sys.stderr)


def configure_logging(verbose: bool = False, color: bool | None = None, json: bool | None = None) -> None:
    level_name = "DEBUG" if verbose else os.environ.get("RUVLLM_LOG", "WARNING").upper()
    level = logging.getLevelName(level_name)
    if not isinstance(level, int):
        level = logging.WARNING
    tty = sys.stderr.isatty()
    if json is None:
        json = not tty
    if color is None:
        color = tty and "NO_COLOR" not in os.environ
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=color)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # sys.stderr as it is when a line is written, not when logging was set up: a stream replaced
        # since (and perhaps closed, as pytest's capture is after a test) must not take logging with it.
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
