"""Every error leaves the server in its dialect's shape: OpenAI's ``{"error": {"message", "type",
"param", "code"}}``, Anthropic's ``{"type": "error", "error": {"type", "message"}, "request_id"}``
under ``/v1/messages``, Ollama's ``{"error": "message"}`` under ``/api/``. Domain errors are mapped
to HTTP statuses here and nowhere else."""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
from litestar import MediaType, Response
from litestar.exceptions import HTTPException, ValidationException

from ruvllm.engine import EngineDeadError
from ruvllm.errors import RequestError, RuvllmError
from ruvllm_server.anthropic.wire import ErrorDetail, ErrorEvent
from ruvllm_server.schemas import ErrorBody, ErrorResponse, encode_json

if TYPE_CHECKING:
    from litestar import Request

log = structlog.get_logger("ruvllm.server")

#: OpenAI error ``type`` by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


#: Anthropic's error ``type`` by HTTP status (``invalid_request_error`` for other 4xx).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error response the server means to send."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def body(self) -> ErrorResponse:
        return ErrorResponse(
            ErrorBody(self.message, ERROR_TYPES.get(self.status, "invalid_request_error"), self.param, self.code)
        )

    def encode(self) -> bytes:
        return encode_json(self.body)

    def anthropic(self, request_id: str | None = None) -> ErrorEvent:
        """Anthropic's shape: no ``param`` field, so the message starts with the field it names."""
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        message = self.message.removesuffix(f" (at {self.param})")
        message = f"{self.param}: {message}" if self.param else message
        return ErrorEvent(ErrorDetail(kind, message), request_id)

    def ollama(self) -> dict[str, str]:
        """Ollama's shape: the message alone, with the field it is about (the status says the rest)."""
        named = self.param is None or self.status != 400 or self.message.endswith(f"(at {self.param})")
        return {"error": self.message if named else f"{self.message} (at {self.param})"}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model {name!r} does not exist", param="model", code="model_not_found")


#: Path prefixes of the dialects whose errors are not OpenAI's.
ANTHROPIC_PATHS = "/v1/messages"
OLLAMA_PATHS = "/api/"


def _response(err: APIError, request: Request | None = None) -> Response[bytes]:
    path = request.url.path if request is not None else ""
    if path.startswith(ANTHROPIC_PATHS):
        assert request is not None
        body = encode_json(err.anthropic(request.scope.get("state", {}).get("request_id")))
    elif path.startswith(OLLAMA_PATHS):
        body = encode_json(err.ollama())
    else:
        body = err.encode()
    return Response(body, status_code=err.status, media_type=MediaType.JSON, headers=err.headers)


def _from_validation(exc: ValidationException) -> APIError:
    details = exc.extra if isinstance(exc.extra, list) else []
    if details and isinstance(details[0], dict):
        first = details[0]
        key = first.get("key")
        param = None if key in (None, "data") else str(key)
        where = f" (at {param})" if param else ""
        return bad_request(f"{first.get('message', 'invalid request')}{where}", param=param)
    return bad_request(str(exc.detail))


def _from_http(exc: HTTPException) -> APIError:
    status = exc.status_code
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    message = exc.detail
    if status == 413:
        message = "request body is too large"
    return APIError(status, str(message), code=codes.get(status), headers=dict(exc.headers or {}))


def handle_exception(request: Request, exc: Exception) -> Response[bytes]:
    """The single exception handler of the app."""
    if isinstance(exc, APIError):
        err = exc
    elif isinstance(exc, ValidationException):
        err = _from_validation(exc)
    elif isinstance(exc, HTTPException):
        err = _from_http(exc)
    elif isinstance(exc, RequestError):
        err = bad_request(str(exc), param=exc.param)
    elif isinstance(exc, EngineDeadError):
        err = APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
    elif isinstance(exc, RuvllmError):
        # Raised on purpose by core or a backend, but not something the client did wrong.
        log.error("request failed", error=f"{type(exc).__name__}: {exc}")
        err = APIError(500, str(exc), code="internal_error")
    else:
        log.exception("unhandled error", path=request.url.path)
        err = APIError(500, "internal server error (logged)", code="internal_error")
    return _response(err, request)
