"""Refusals in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

The HTTP status follows the typed error's stable `code` (`asyncengine.errors.ErrorCode`),
which is also the body's `code`, as on the WebSocket: 400 for a bad body or parameter (the
parameter in `param`), 401 for a missing or wrong key, 404 for an unknown model or path,
429 with `Retry-After` when the waiting queue is full, 503 when the engine cannot serve.
`api_error` is the one mapping from what serving a request may raise to the answer.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import msgspec

from asyncengine.async_engine import EngineDeadError, RequestFailedError
from asyncengine.errors import ErrorCode, RequestError

logger = logging.getLogger(__name__)

# Seconds a client is asked to wait before retrying a request refused for a full queue.
RETRY_AFTER_S = 1

_STATUS = {
    ErrorCode.OVERLOADED: HTTPStatus.TOO_MANY_REQUESTS,
    ErrorCode.UNAUTHORIZED: HTTPStatus.UNAUTHORIZED,
    ErrorCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    ErrorCode.ENGINE_ERROR: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.INTERNAL_ERROR: HTTPStatus.INTERNAL_SERVER_ERROR,
}
_TYPE = {
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "service_unavailable_error",
    HTTPStatus.INTERNAL_SERVER_ERROR: "server_error",
}


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(msgspec.Struct, kw_only=True):
    error: ErrorDetail


class ApiError(Exception):
    """A refusal to answer with an OpenAI-shaped error body."""

    def __init__(self, status: int, code: ErrorCode, message: str, *,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.code = code
        self.message = message
        self.param = param

    @classmethod
    def of(cls, code: ErrorCode, message: str, *, param: str | None = None) -> ApiError:
        """The error for `code`, with the status that code maps to."""
        return cls(_STATUS.get(code, HTTPStatus.BAD_REQUEST), code, message, param=param)

    @classmethod
    def from_request_error(cls, exc: RequestError, param: str | None = None) -> ApiError:
        """A typed engine refusal; `param` is the body's name for its field."""
        return cls.of(exc.code, exc.message, param=param if param is not None else exc.field)

    @property
    def headers(self) -> dict[str, str]:
        if self.status == HTTPStatus.TOO_MANY_REQUESTS:
            return {"Retry-After": str(RETRY_AFTER_S)}
        if self.status == HTTPStatus.UNAUTHORIZED:
            return {"WWW-Authenticate": "Bearer"}
        return {}

    def body(self) -> ErrorBody:
        kind = _TYPE.get(HTTPStatus(self.status), "invalid_request_error")
        return ErrorBody(error=ErrorDetail(message=self.message, type=kind, param=self.param,
                                           code=str(self.code)))


def api_error(exc: BaseException) -> ApiError:
    """The answer to an error raised while serving a request: an `ApiError` as it is; a
    typed refusal with its code's status; `engine_error` (the WebSocket protocol's code too)
    with 503 when the engine is dead and 500 when it failed this request alone and serves on;
    anything else is a server bug, logged, and answered 500 `internal_error`."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestError):
        return ApiError.from_request_error(exc)
    if isinstance(exc, EngineDeadError):
        return ApiError.of(ErrorCode.ENGINE_ERROR, str(exc))
    if isinstance(exc, RequestFailedError):
        return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, ErrorCode.ENGINE_ERROR, str(exc))
    logger.error("unexpected error serving a request", exc_info=exc)
    return ApiError.of(ErrorCode.INTERNAL_ERROR, "internal server error")
