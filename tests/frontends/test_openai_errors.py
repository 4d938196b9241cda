"""`frontends.openai_api.errors.api_error`: one mapping from what serving a request may raise
to the OpenAI-shaped answer and its status."""

from __future__ import annotations

import logging
from http import HTTPStatus

import pytest

from asyncengine.async_engine import EngineDeadError, RequestFailedError
from asyncengine.errors import ErrorCode, InvalidRequestError, OverloadedError
from frontends.openai_api.errors import ApiError, api_error


def test_typed_refusals_keep_their_code_status_and_field() -> None:
    err = api_error(InvalidRequestError("max_tokens must be at least 1", field="max_tokens"))
    assert err.status == HTTPStatus.BAD_REQUEST
    assert (err.code, err.param) == (ErrorCode.INVALID_REQUEST, "max_tokens")
    assert api_error(OverloadedError("queue full")).status == HTTPStatus.TOO_MANY_REQUESTS


def test_engine_failures_say_engine_error_dead_or_alive() -> None:
    dead = api_error(EngineDeadError("engine is not running"))
    failed = api_error(RequestFailedError("cmpl-1-0", "engine step failed: boom"))
    assert dead.code == failed.code == ErrorCode.ENGINE_ERROR
    assert dead.status == HTTPStatus.SERVICE_UNAVAILABLE  # nothing is served: retry elsewhere
    assert failed.status == HTTPStatus.INTERNAL_SERVER_ERROR  # this request only
    assert "boom" in failed.message


def test_an_api_error_passes_through() -> None:
    err = ApiError.of(ErrorCode.NOT_FOUND, "no such model")
    assert api_error(err) is err


def test_anything_else_is_a_logged_internal_error(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="frontends.openai_api.errors"):
        err = api_error(KeyError("oops"))
    assert (err.status, err.code) == (HTTPStatus.INTERNAL_SERVER_ERROR, ErrorCode.INTERNAL_ERROR)
    assert "oops" not in err.message  # a server bug's details stay in the log
    assert any(r.exc_info and isinstance(r.exc_info[1], KeyError) for r in caplog.records)
