"""Errors SONA raises on purpose; all are :class:`ruvllm.errors.RuvllmError` with a one-line message."""

from ruvllm.errors import RuvllmError


class SonaError(RuvllmError):
    """SONA cannot do what was asked (bad configuration, model it cannot differentiate, ...)."""


class FeedbackError(SonaError):
    """Feedback names an unknown or expired response, or carries a bad score or correction."""


class UnknownResponseError(FeedbackError):
    """No trajectory is held for that response id (never seen, or expired)."""


class SonaStateError(SonaError):
    """A saved SONA state directory is missing, corrupt, or was saved for another model."""
