"""The asyncio client library for the WebSocket server.

    async with AsyncClient("ws://127.0.0.1:8765") as client:
        async for chunk in client.generate(prompt="Hello", max_tokens=32):
            print(chunk.text, end="")
        # the last chunk carries finish_reason and usage

With `n=k` (k > 1) one generation streams k samples: each chunk has the `index` of its
sample, the last one every sample's finish reason, and `complete` returns them in `samples`.

Many generations can run at once over one connection: a reader task dispatches incoming
events by `request_id` to per-request queues. Leaving a `generate` loop early sends
`cancel`. Server errors raise typed exceptions (`ServerError` and its subclasses).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from asyncengine.errors import ErrorCode
from asyncengine.stats_schema import EngineStats
from asyncengine_kernels import envs
from frontends import protocol as p


class ServerError(Exception):
    """An `error` event from the server (or the connection failing under a request)."""

    code: str = ""

    def __init__(self, message: str, *, code: str | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.request_id = request_id


class InvalidRequestError(ServerError):
    code = ErrorCode.INVALID_REQUEST


class UnknownTypeError(InvalidRequestError):
    code = ErrorCode.UNKNOWN_TYPE


class DuplicateRequestIdError(InvalidRequestError):
    code = ErrorCode.DUPLICATE_REQUEST_ID


class PromptTooLongError(InvalidRequestError):
    code = ErrorCode.PROMPT_TOO_LONG


class NotFoundError(ServerError):
    code = ErrorCode.NOT_FOUND


class OverloadedError(ServerError):
    code = ErrorCode.OVERLOADED


class UnauthorizedError(ServerError):
    code = ErrorCode.UNAUTHORIZED


class EngineError(ServerError):
    code = ErrorCode.ENGINE_ERROR


class ConnectionLostError(ServerError):
    code = "connection_lost"


_ERRORS: dict[str, type[ServerError]] = {
    cls.code: cls for cls in (InvalidRequestError, UnknownTypeError, DuplicateRequestIdError,
                              PromptTooLongError, NotFoundError, OverloadedError,
                              UnauthorizedError, EngineError)
}


def error_from_event(event: p.Error) -> ServerError:
    cls = _ERRORS.get(event.code, ServerError)
    return cls(event.message, code=event.code, request_id=event.request_id)


@dataclasses.dataclass(slots=True)
class GenerationChunk:
    """One streamed piece of a generation; the last one has `finish_reason` and `usage`."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: p.Usage | None = None
    index: int = 0  # which sample, for a request with n > 1
    finish_reasons: list[str] | None = None  # on the last chunk of a request with n > 1
    # On the last chunk of a request with `prompt_logprobs` (see `protocol`).
    prompt_logprobs: p.WirePromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class Completion:
    """A whole generation, as `AsyncClient.complete` returns it."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: p.Usage
    # With n > 1: every sample, by index (sample 0 is also text/token_ids/finish_reason).
    samples: list[Sample] | None = None


@dataclasses.dataclass(slots=True)
class Sample:
    """One of the n samples of a `Completion`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str


_STATS_KEY = object()  # queue key of the stats stream


class AsyncClient:
    """A connection to an asyncengine server; use it as an async context manager."""

    def __init__(
        self,
        url: str = "ws://127.0.0.1:8765",
        api_key: str | None = None,
        *,
        open_timeout: float | None = 10.0,
        max_size: int | None = 16 << 20,
    ) -> None:
        self.url = url
        self.api_key = api_key if api_key is not None else envs.api_key()
        self._open_timeout = open_timeout
        self._max_size = max_size
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._queues: dict[Any, asyncio.Queue[Any]] = {}
        self._ids = itertools.count()
        self._closed_error: ServerError | None = None
        # Errors that name no request (e.g. a malformed frame), newest last.
        self.unrouted_errors: list[ServerError] = []

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            self._ws = await connect(self.url, additional_headers=headers,
                                     open_timeout=self._open_timeout, max_size=self._max_size,
                                     compression=None)
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status == 401:
                raise UnauthorizedError("the server rejected the API key (HTTP 401)") from exc
            raise ServerError(f"the server refused the connection (HTTP {status})",
                              code=str(status)) from exc
        self._reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    @property
    def connection(self) -> ClientConnection:
        if self._ws is None:
            raise RuntimeError("AsyncClient is not connected; use `async with AsyncClient(...)`")
        return self._ws

    async def _read(self) -> None:
        ws = self.connection
        try:
            async for raw in ws:
                event = p.decode_server_message(raw)
                if isinstance(event, p.Stats):
                    key: Any = _STATS_KEY
                elif isinstance(event, p.Error) and event.request_id is None:
                    self.unrouted_errors.append(error_from_event(event))
                    continue
                else:
                    key = event.request_id
                q = self._queues.get(key)
                if q is not None:
                    q.put_nowait(event)
        except ConnectionClosed:
            pass
        finally:
            reason = f": {ws.close_reason}" if ws.close_reason else ""
            self._closed_error = ConnectionLostError(
                f"connection closed (code {ws.close_code}{reason})")
            for q in self._queues.values():
                q.put_nowait(self._closed_error)

    async def _send(self, event: p.ClientEvent) -> None:
        if self._closed_error is not None:
            raise self._closed_error
        try:
            await self.connection.send(p.encode(event), text=True)
        except ConnectionClosed as exc:
            raise ConnectionLostError(f"connection closed: {exc}") from exc

    def _open_queue(self, key: Any) -> asyncio.Queue[Any]:
        if key in self._queues:
            raise DuplicateRequestIdError(f"request_id {key!r} is already in use here",
                                          request_id=key)
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[key] = q
        return q

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        **params: Any,
    ) -> AsyncIterator[GenerationChunk]:
        """Stream one generation; sampling `params` use vLLM's names (max_tokens, ...,
        `structured_outputs={"json": schema}`).

        Yields a chunk per delta and a final chunk (empty text) with `finish_reason` and
        `usage`. Raises a `ServerError` subclass when the server rejects or fails it.
        """
        rid = request_id if request_id is not None else f"r{next(self._ids)}"
        if isinstance(params.get("structured_outputs"), dict):  # e.g. {"json": schema}
            params["structured_outputs"] = p.StructuredOutputs(**params["structured_outputs"])
        msg = p.Generate(
            request_id=rid, prompt=prompt,
            messages=[p.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
            if messages is not None else None,
            prompt_token_ids=prompt_token_ids,
            params=p.GenerateParams(**params),
        )
        q = self._open_queue(rid)
        finished = False
        try:
            await self._send(msg)
            while True:
                event = await q.get()
                if isinstance(event, p.Delta):
                    yield GenerationChunk(rid, event.text, event.token_ids,
                                          index=event.index or 0)
                elif isinstance(event, p.Done):
                    finished = True
                    yield GenerationChunk(rid, "", [], event.finish_reason, event.usage,
                                          finish_reasons=event.finish_reasons,
                                          prompt_logprobs=event.prompt_logprobs)
                    return
                elif isinstance(event, p.Error):
                    finished = True
                    raise error_from_event(event)
                elif isinstance(event, BaseException):
                    finished = True
                    raise event
        finally:
            del self._queues[rid]
            if not finished and self._closed_error is None:
                with contextlib.suppress(ServerError):
                    await self._send(p.Cancel(request_id=rid))

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Run one generation to its end and return it whole (with `n` > 1, every sample
        in `samples`)."""
        text: dict[int, list[str]] = {0: []}
        ids: dict[int, list[int]] = {0: []}
        async for chunk in self.generate(prompt, **kwargs):
            text.setdefault(chunk.index, []).append(chunk.text)
            ids.setdefault(chunk.index, []).extend(chunk.token_ids)
            if chunk.finished:
                assert chunk.usage is not None and chunk.finish_reason is not None
                samples = None
                if chunk.finish_reasons is not None:
                    samples = [Sample(i, "".join(text.get(i, [])), ids.get(i, []), reason)
                               for i, reason in enumerate(chunk.finish_reasons)]
                return Completion(chunk.request_id, "".join(text[0]), ids[0],
                                  chunk.finish_reason, chunk.usage, samples)
        raise ConnectionLostError("the generation ended without a `done` event")

    async def cancel(self, request_id: str) -> None:
        """Ask the server to abort a request (its stream then ends with finish_reason abort)."""
        await self._send(p.Cancel(request_id=request_id))

    async def stats(self, interval: float = 1.0) -> AsyncIterator[EngineStats]:
        """Subscribe to engine snapshots every `interval` seconds until the loop is left."""
        q = self._open_queue(_STATS_KEY)
        try:
            await self._send(p.StatsSubscribe(interval=interval))
            while True:
                event = await q.get()
                if isinstance(event, BaseException):
                    raise event
                yield event.stats
        finally:
            del self._queues[_STATS_KEY]
            if self._closed_error is None:
                with contextlib.suppress(ServerError):
                    await self._send(p.StatsUnsubscribe())
