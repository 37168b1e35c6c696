"""Errors users can act on. The CLI prints their message on one line and exits non-zero."""


class RuvllmError(Exception):
    """Base of every error ruvllm raises on purpose."""


class ModelNotFoundError(RuvllmError):
    """The model reference resolves to nothing usable here (missing file, offline and not cached)."""


class ModelFormatError(RuvllmError):
    """A model file is truncated, corrupt or not in the format it claims."""


class UnsupportedArchitectureError(RuvllmError):
    """The checkpoint's architecture is one no installed backend implements."""


class UnsupportedQuantizationError(RuvllmError):
    """A tensor uses a quantization type ruvllm cannot decode."""


class BackendError(RuvllmError):
    """No backend is installed, the requested one is unknown, or it failed to load."""


class PluginError(RuvllmError):
    """A plugin could not be loaded."""


class RequestError(RuvllmError):
    """A request is invalid (bad sampling values, prompt longer than the context, ...). ``param``
    names the request field at fault when there is one (the server reports it)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestFailedError(RuvllmError):
    """One request failed while it ran (non-finite logits, a backend error that stayed with it); the
    engine and the other requests go on."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id} failed: {reason}")
        self.request_id = request_id
        self.reason = reason
