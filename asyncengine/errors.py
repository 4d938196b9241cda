"""Typed request errors: each carries a stable `code` and the `field` it concerns.

Frontends map `code` to their own wire format (the WebSocket `error` event, an HTTP status)
without reading the message; `field` names the offending parameter (`max_tokens`,
`prompt_token_ids`, ...) or is None when the request as a whole is at fault. Errors about the
request's content subclass `ValueError`, as the engine raised before they were typed.
"""

from __future__ import annotations

import enum
from typing import ClassVar


class ErrorCode(enum.StrEnum):
    """Every error code a frontend reports; the WebSocket protocol sends these strings."""

    INVALID_REQUEST = "invalid_request"
    UNKNOWN_TYPE = "unknown_type"
    DUPLICATE_REQUEST_ID = "duplicate_request_id"
    PROMPT_TOO_LONG = "prompt_too_long"
    OVERLOADED = "overloaded"
    UNAUTHORIZED = "unauthorized"
    ENGINE_ERROR = "engine_error"
    NOT_FOUND = "not_found"
    INTERNAL_ERROR = "internal_error"  # a server bug; the connection goes on


class RequestError(Exception):
    """A request the engine (or a frontend) refuses; nothing of it was queued."""

    code: ClassVar[ErrorCode] = ErrorCode.INVALID_REQUEST

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidRequestError(RequestError, ValueError):
    """A parameter or the prompt is not acceptable."""


class PromptTooLongError(InvalidRequestError):
    """The prompt plus its output cannot fit `max_model_len` or the KV pool."""

    code = ErrorCode.PROMPT_TOO_LONG


class DuplicateRequestIdError(InvalidRequestError):
    """The request id is already used by a request still in flight."""

    code = ErrorCode.DUPLICATE_REQUEST_ID


class OverloadedError(RequestError):
    """The waiting queue is full: the same request may succeed later."""

    code = ErrorCode.OVERLOADED
