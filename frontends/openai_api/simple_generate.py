"""`POST /generate`: vLLM's simple `api_server` endpoint, on the OpenAI port beside `/v1`.

The body is a JSON object: `prompt` (text), `stream` (default false) and any
`SamplingParams` field by its name (`n`, `temperature`, `max_tokens`, `stop`, ...). The
answer is `{"text": [prompt + output, ...]}`, one string per sample; streamed, it is the same
object after every step, each holding the whole text so far, every object followed by a NUL
byte, as vLLM's simple server streams it (its example client splits the body on b"\\0").
A bad body is a 400 naming the field, in OpenAI's error shape like the rest of the port; a
client that leaves aborts its request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from asyncengine.async_engine import EngineDeadError, RequestFailedError
from asyncengine.errors import InvalidRequestError, RequestError
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams
from frontends.openai_api.app import (
    EventStreamResponse,
    OpenAIApp,
    _Submitted,
    json_response,
)
from frontends.openai_api.errors import ApiError, api_error
from frontends.openai_api.responses import new_id

# SamplingParams fields a body may set (`output_kind` is this endpoint's to choose).
_PARAM_FIELDS = frozenset(
    f.name for f in dataclasses.fields(SamplingParams) if f.init and f.name != "output_kind"
)
_SEPARATOR = b"\0"
_encoder = msgspec.json.Encoder()


def parse_body(body: bytes) -> tuple[str, bool, SamplingParams]:
    """The prompt, the stream flag and the sampling params of a `/generate` body; a bad one
    raises `InvalidRequestError` naming the field."""
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequestError("the body is not valid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError("the body must be a JSON object")
    prompt = obj.pop("prompt", None)
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequestError("prompt must be a non-empty string", field="prompt")
    stream = obj.pop("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequestError("stream must be a boolean", field="stream")
    # vLLM's older example client sends it; false (or absent) is what this engine does.
    if obj.pop("use_beam_search", False) is not False:
        raise InvalidRequestError("beam search is not supported", field="use_beam_search")
    unknown = sorted(set(obj) - _PARAM_FIELDS)
    if unknown:
        raise InvalidRequestError(f"{unknown[0][:64]!r} is not a sampling parameter",
                                  field=unknown[0][:64])
    params: dict[str, Any] = {k: v for k, v in obj.items() if v is not None}
    return prompt, stream, SamplingParams(**params, output_kind=RequestOutputKind.CUMULATIVE)


def _texts(prompt: str, out: RequestOutput, n: int) -> dict[str, list[str]]:
    texts = [prompt] * n
    for comp in out.outputs:
        texts[comp.index] = prompt + comp.text
    return {"text": texts}


async def generate(api: OpenAIApp, request: Request) -> Response:
    """Serve one `/generate` request (see the module's docstring)."""
    body = await api._body(request)
    try:
        prompt, stream, params = parse_body(body)
        api._check_serving()
        ids = await api._tokenize(prompt)
        submitted = api._submit(new_id("generate"), [ids], params)
    except RequestError as exc:
        raise ApiError.from_request_error(exc) from None
    if stream:
        return NulDelimitedResponse(_stream(api, prompt, submitted))
    last: list[RequestOutput] = []

    async def collect() -> None:
        try:
            async for _, out in api._outputs(submitted):
                last[:] = [out]
        finally:
            api._release(submitted)

    try:
        await api._until_disconnect(request, collect())
    except (RequestError, RequestFailedError, EngineDeadError) as exc:
        raise api_error(exc) from None
    texts = _texts(prompt, last[0], params.n) if last else {"text": [prompt] * params.n}
    return json_response(texts)


async def _stream(api: OpenAIApp, prompt: str, submitted: _Submitted) -> AsyncIterator[bytes]:
    try:
        async for _, out in api._outputs(submitted):
            yield _encoder.encode(_texts(prompt, out, submitted.n)) + _SEPARATOR
    except Exception as exc:  # the stream began: the error is its last object
        err = api_error(exc)
        api.count_refusal(err)
        yield _encoder.encode(err.body()) + _SEPARATOR
    finally:
        api._release(submitted)


class NulDelimitedResponse(EventStreamResponse):
    """A streamed `/generate` answer: JSON objects each followed by a NUL byte. Its generator
    is closed however the response ends, which aborts the request."""

    media_type = "application/json"
