"""On CI (the environment variable CI is "true") a skip whose reason is not in tests/_allowed_skips.py
turns the session red: a test that silently stopped running is otherwise a green run that proves less.

tests/conftest.py turns it on; ``pytest -p _skip_check`` (with tests/ on the path) does too.
"""

from __future__ import annotations

import os
import re

import pytest
from _allowed_skips import ALLOWED_SKIPS

_ALLOWED = [re.compile(pattern) for pattern in ALLOWED_SKIPS]


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str | None:
    """The reason of a skip as pytest reports it, without its "Skipped: " prefix; None when the report
    is not a skip (an expected failure is reported as skipped too, with ``wasxfail``: not a skip)."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)  # (path, line, reason)
    return reason.removeprefix("Skipped: ")


def is_allowed(reason: str) -> bool:
    return any(pattern.search(reason) for pattern in _ALLOWED)


class UnexpectedSkips:
    """Records every skip not allowed, then fails the session and lists them."""

    def __init__(self) -> None:
        self.found: list[tuple[str, str]] = []

    def _record(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        reason = skip_reason(report)
        if reason is not None and not is_allowed(reason):
            self.found.append((report.nodeid, reason))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)  # a module-level importorskip skips at collection

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # Interrupted or already failing sessions keep their own status.
        ok = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if self.found and session.exitstatus in ok:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.found:
            return
        terminalreporter.write_sep("=", f"{len(self.found)} unexpected skip(s) on CI", red=True, bold=True)
        for nodeid, reason in self.found:
            terminalreporter.write_line(f"{nodeid}: {reason}")
        terminalreporter.write_line(
            "CI fails on a skip not in tests/_allowed_skips.py: install what the test needs in the nox "
            "session, or add the reason there with why CI cannot avoid it."
        )


def register(config: pytest.Config) -> None:
    """Turn the check on where CI is "true" (the variable GitHub Actions, GitLab and most CIs set)."""
    if os.environ.get("CI") == "true" and not config.pluginmanager.has_plugin("unexpected-skips"):
        config.pluginmanager.register(UnexpectedSkips(), "unexpected-skips")


def pytest_configure(config: pytest.Config) -> None:
    register(config)
