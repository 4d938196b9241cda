"""The typed request errors: stable codes on the wire, ValueError where the content is wrong."""

from __future__ import annotations

import msgspec

from asyncengine.errors import (
    DuplicateRequestIdError,
    ErrorCode,
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
    RequestError,
)


def test_each_error_has_its_code() -> None:
    assert {cls: cls.code for cls in (InvalidRequestError, PromptTooLongError,
                                      DuplicateRequestIdError, OverloadedError)} == {
        InvalidRequestError: "invalid_request",
        PromptTooLongError: "prompt_too_long",
        DuplicateRequestIdError: "duplicate_request_id",
        OverloadedError: "overloaded",
    }


def test_content_errors_are_value_errors_and_overload_is_not() -> None:
    for cls in (InvalidRequestError, PromptTooLongError, DuplicateRequestIdError):
        assert issubclass(cls, ValueError) and issubclass(cls, RequestError)
    assert issubclass(OverloadedError, RequestError) and not issubclass(OverloadedError, ValueError)


def test_message_and_field() -> None:
    err = PromptTooLongError("too long", field="max_tokens")
    assert (str(err), err.message, err.field) == ("too long", "too long", "max_tokens")
    assert InvalidRequestError("bad").field is None


def test_codes_are_plain_strings_on_the_wire() -> None:
    assert msgspec.json.encode({"code": ErrorCode.PROMPT_TOO_LONG}) == b'{"code":"prompt_too_long"}'
    assert ErrorCode("not_found") is ErrorCode.NOT_FOUND
    assert len(set(ErrorCode)) == len(list(ErrorCode))
