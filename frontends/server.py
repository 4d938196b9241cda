"""The WebSocket server: many streaming requests per connection, plus /healthz and /metrics.

One port serves both: `process_request` answers plain HTTP (`GET /healthz`, `GET /metrics`)
and checks the API key before a WebSocket handshake completes (HTTP 401, no work done).
Per connection, a reader task decodes frames, one task per request streams an
`AsyncLLMEngine.generate` into `delta`/`done` events, and one writer task owns all sends.
Producers wait for send credits (a bounded number of unsent frames), so a client that stops
reading only stalls its own requests, whose engine mailboxes then merge deltas: memory stays
bounded and the engine never waits on a socket.

Requests are tokenized here (chat template for `messages`) and pass the engine's request
check (`AsyncLLMEngine.check_request`) before they are submitted: rejected requests never
reach the engine, and each refusal's protocol code is the typed error's `code`. Prompt
text is not logged unless asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import itertools
import logging
import re
import signal
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from asyncengine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
)
from asyncengine.errors import (
    DuplicateRequestIdError,
    ErrorCode,
    InvalidRequestError,
    OverloadedError,
    RequestError,
)
from asyncengine.request_check import QueueLimits
from asyncengine.stat_loggers import PrometheusStatLogger
from asyncengine.structured_outputs.frontend import compile_constraint
from frontends import protocol as p
from frontends.api_key import ApiKey
from frontends.listening import ListeningAddress
from frontends.tokenize_offload import chat_size, maybe_in_thread

logger = logging.getLogger(__name__)

# Browser origins accepted by default: pages served from this machine.
_LOOPBACK_ORIGIN = re.compile(r"https?://(localhost|127(\.\d{1,3}){3}|\[::1\])(:\d{1,5})?")


@dataclasses.dataclass
class ServerConfig:
    """How the server listens and what it accepts."""

    host: str = "127.0.0.1"
    port: int = 8765
    api_key: str | None = None
    # Accepted browser `Origin` headers. None: pages from this machine only (http(s) on
    # localhost, 127.x.x.x or [::1], any port), so a web page elsewhere cannot drive a local
    # server; "*" accepts any. Clients that send no Origin (non-browsers) always pass this
    # check: for them the API key is the gate.
    allowed_origins: list[str] | None = None
    max_size: int = 1 << 20  # largest accepted frame, bytes (bigger: close 1009)
    max_queued_requests: int = 1024  # accepted requests still waiting for a first token
    max_queued_prompt_tokens: int = 1 << 20  # their prompt tokens
    max_requests_per_connection: int = 256
    max_pending_frames: int = 256  # unsent frames per connection before producers wait
    drain_timeout: float = 30.0
    ping_interval: float | None = 20.0
    ping_timeout: float | None = 20.0
    log_prompts: bool = False

    def validate(self) -> None:
        require_key_off_loopback(self.host, self.api_key)
        for name in ("max_size", "max_requests_per_connection", "max_pending_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


def accepted_origins(allowed: list[str] | None) -> list[str | re.Pattern[str] | None] | None:
    """The `origins` argument of `websockets.serve` for `ServerConfig.allowed_origins`."""
    if allowed is None:
        return [None, _LOOPBACK_ORIGIN]
    if "*" in allowed:
        return None
    return [None, *allowed]


class _NoDebugLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """websockets' logger without DEBUG records: at DEBUG it logs every frame, prompts too."""

    def isEnabledFor(self, level: int) -> bool:
        return level > logging.DEBUG and self.logger.isEnabledFor(level)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_key_off_loopback(host: str, api_key: str | None) -> None:
    """Every front end refuses to listen beyond this machine without an API key."""
    if not is_loopback(host) and not api_key:
        raise ValueError(
            f"refusing to bind non-loopback host {host!r} without an API key "
            "(set --api-key or ASYNCENGINE_API_KEY)")


@dataclasses.dataclass(slots=True)
class _InFlight:
    task: asyncio.Task[None] | None
    prompt_tokens: int
    completion_tokens: int = 0
    stream: RequestStream | None = None
    n: int = 1
    # Finish reason per sample index, as the samples end.
    finish_reasons: dict[int, str] = dataclasses.field(default_factory=dict)
    prompt_logprobs: p.WirePromptLogprobs | None = None

    def done(self, rid: str, default_reason: str) -> p.Done:
        """The request's `done` event; samples not finished yet get `default_reason`."""
        reasons = [self.finish_reasons.get(i, default_reason) for i in range(self.n)]
        return p.Done(request_id=rid, finish_reason=reasons[0],
                      usage=p.Usage(prompt_tokens=self.prompt_tokens,
                                    completion_tokens=self.completion_tokens),
                      finish_reasons=reasons if self.n > 1 else None,
                      prompt_logprobs=self.prompt_logprobs)

    def stop(self) -> None:
        """Cancel the streaming task and abort the engine request (idempotent)."""
        if self.task is not None:
            self.task.cancel()
        if self.stream is not None:
            # A task cancelled before it first ran never reaches its `finally`.
            self.stream.close()


class _Connection:
    """One client socket: its requests, its send buffer and the task that writes it."""

    _ids = itertools.count()

    def __init__(self, ws: ServerConnection, max_pending_frames: int) -> None:
        self.ws = ws
        self.id = next(self._ids)
        self.requests: dict[str, _InFlight] = {}
        self.outq: asyncio.Queue[bytes] = asyncio.Queue()
        self.stats_task: asyncio.Task[None] | None = None
        self._max_pending = max_pending_frames
        self._room = asyncio.Event()
        self._room.set()

    async def send(self, event: p.ServerEvent) -> None:
        """Queue one event; waits while the client is `max_pending_frames` behind."""
        while self.outq.qsize() >= self._max_pending:
            self._room.clear()
            await self._room.wait()
        self.outq.put_nowait(p.encode(event))

    def try_send(self, event: p.ServerEvent) -> bool:
        """Queue an event that may be dropped (stats) when the client is behind."""
        if self.outq.qsize() >= self._max_pending:
            return False
        self.outq.put_nowait(p.encode(event))
        return True

    def discard_unsent(self) -> None:
        while not self.outq.empty():
            self.outq.get_nowait()
            self.outq.task_done()

    async def writer(self) -> None:
        while True:
            frame = await self.outq.get()
            try:
                await self.ws.send(frame, text=True)
            finally:
                self.outq.task_done()
                if self.outq.qsize() < self._max_pending:
                    self._room.set()


class EngineServer(ListeningAddress):
    """A running server around an `AsyncLLMEngine`. Build it with `serve_engine`."""

    scheme = "ws"

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        config.validate()
        self.engine = engine
        self.config = config
        self.registry = CollectorRegistry()
        self.metrics = PrometheusStatLogger(engine.model_name, registry=self.registry)
        self._queue_limits = QueueLimits(config.max_queued_requests,
                                         config.max_queued_prompt_tokens)
        self._rejected = Counter("asyncengine_requests_rejected",
                                 "Requests refused before reaching the engine, by error code.",
                                 ["code"], registry=self.registry)
        self._connections_gauge = Gauge("asyncengine_websocket_connections",
                                        "Open WebSocket connections.", registry=self.registry)
        self._connections: set[_Connection] = set()
        self._api_key = ApiKey(config.api_key)
        self._ws_server: Server | None = None
        self._address: tuple[str, int] | None = None
        self._draining = False
        self._closed = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        cfg = self.config
        self.engine.add_stat_logger(self.metrics)
        ws_logger = logging.getLogger("websockets.server")
        self._ws_server = await serve(
            self._handler, cfg.host, cfg.port,
            process_request=self._process_request,
            origins=accepted_origins(cfg.allowed_origins),
            logger=ws_logger if cfg.log_prompts else _NoDebugLogger(ws_logger, {}),
            max_size=cfg.max_size,
            compression=None,  # frames are small; deflate would cost CPU per token
            ping_interval=cfg.ping_interval, ping_timeout=cfg.ping_timeout,
        )
        # Remembered: the listening sockets go away once draining starts.
        self._address = self._ws_server.sockets[0].getsockname()[:2]
        logger.info("serving %s on %s (healthz: %s/healthz, metrics: %s/metrics)",
                    self.engine.model_name or "model", self.url, self.http_url, self.http_url)

    @property
    def http_url(self) -> str:
        return self.url_for("http")

    @property
    def draining(self) -> bool:
        return self._draining

    def in_flight_tasks(self) -> list[asyncio.Task[None]]:
        return [r.task for c in self._connections for r in c.requests.values()
                if r.task is not None]

    async def drain(self, timeout: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish (cancel them after `timeout`), close."""
        if self._ws_server is None or self._closed.is_set():
            return
        timeout = self.config.drain_timeout if timeout is None else timeout
        # New handshakes get HTTP 503 and /healthz says 503 while the listener stays up, so
        # load balancers see the drain instead of refused connections.
        self._draining = True
        tasks = self.in_flight_tasks()
        if tasks:
            logger.info("draining %d in-flight request(s) (timeout %.1fs)", len(tasks), timeout)
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for slot in [r for c in self._connections for r in c.requests.values()]:
                if slot.task in pending:
                    slot.stop()
            if pending:
                logger.warning("cancelled %d request(s) still running after drain timeout",
                               len(pending))
                await asyncio.wait(pending)
        # Let every writer flush the final `done` events before the close frames.
        flushes = [asyncio.ensure_future(c.outq.join()) for c in self._connections]
        if flushes:
            _, pending_flush = await asyncio.wait(flushes, timeout=max(1.0, timeout))
            for f in pending_flush:
                f.cancel()
        await self.close()

    async def close(self) -> None:
        """Close every connection (1001) and stop listening; requests are aborted."""
        if self._ws_server is None or self._closed.is_set():
            return
        self._draining = True
        self._ws_server.close(close_connections=True)
        await self._ws_server.wait_closed()
        self.engine.remove_stat_logger(self.metrics)
        self._closed.set()
        logger.info("server stopped")

    async def wait_closed(self) -> None:
        await self._closed.wait()

    # ------------------------------------------------------------------ plain HTTP
    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        url = urlsplit(request.path)
        if url.path == "/healthz":
            if self.engine.errored:
                return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "engine is dead\n")
            if self._draining or not self.engine.is_running:
                return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "shutting down\n")
            return connection.respond(HTTPStatus.OK, "OK\n")
        if url.path == "/metrics":
            self.metrics.on_stats(self.engine.stats())
            body = self.metrics.render().decode()
            response = connection.respond(HTTPStatus.OK, body)
            del response.headers["Content-Type"]
            response.headers["Content-Type"] = CONTENT_TYPE_LATEST
            return response
        if self._api_key.required and not self._authorized(request.headers, url.query):
            self._rejected.labels(ErrorCode.UNAUTHORIZED).inc()
            response = connection.respond(HTTPStatus.UNAUTHORIZED, "invalid or missing API key\n")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        if self._draining:
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "shutting down\n")
        return None

    def _authorized(self, headers: Headers, query: str) -> bool:
        given = ""
        auth = headers.get("Authorization", "")
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        else:
            given = parse_qs(query).get("api_key", [""])[0]
        return self._api_key.admits(given)

    # ------------------------------------------------------------------ WebSocket
    async def _handler(self, ws: ServerConnection) -> None:
        conn = _Connection(ws, self.config.max_pending_frames)
        self._connections.add(conn)
        self._connections_gauge.inc()
        logger.debug("connection %d opened from %s", conn.id, ws.remote_address)
        writer = asyncio.create_task(conn.writer())
        reader = asyncio.create_task(self._read(conn))
        try:
            # Either side ending (client gone, send failed) ends the connection.
            await asyncio.wait([reader, writer], return_when=asyncio.FIRST_COMPLETED)
        finally:
            slots = list(conn.requests.values())
            tasks = [r.task for r in slots if r.task is not None]
            if conn.stats_task is not None:
                tasks.append(conn.stats_task)
            for t in (reader, writer, *tasks):
                t.cancel()
            for slot in slots:
                slot.stop()
            # Cancelling a request task aborts it in the engine (its blocks are freed).
            await asyncio.gather(reader, writer, *tasks, return_exceptions=True)
            conn.discard_unsent()  # nobody will send them; a drain must not wait on them
            self._connections.discard(conn)
            self._connections_gauge.dec()
            logger.debug("connection %d closed (%s)", conn.id, ws.close_code)

    async def _read(self, conn: _Connection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for raw in conn.ws:
                try:
                    await self._on_message(conn, raw)
                except Exception:
                    # A bug must cost one message, not the connection and its other requests.
                    logger.exception("connection %d: unexpected error handling a message",
                                     conn.id)
                    self._rejected.labels(ErrorCode.INTERNAL_ERROR).inc()
                    await conn.send(p.Error(code=ErrorCode.INTERNAL_ERROR,
                                            message="internal server error"))
                # Buffered frames are handed out without a suspension: yield once per frame,
                # so that a flooding client shares the loop and the request tasks it started
                # run before it can cancel them.
                await asyncio.sleep(0)

    async def _on_message(self, conn: _Connection, raw: str | bytes) -> None:
        if isinstance(raw, bytes):
            self._rejected.labels(ErrorCode.INVALID_REQUEST).inc()
            await conn.send(p.Error(code=ErrorCode.INVALID_REQUEST, message="binary frames are not "
                                    "accepted: send JSON text frames"))
            return
        msg = p.decode_client_message(raw)
        if isinstance(msg, p.Generate):
            try:
                await self._on_generate(conn, msg)
            except RequestError as exc:
                await self._refuse(conn, msg, exc.code, _wire_message(exc, msg))
            except EngineDeadError:
                await self._refuse(conn, msg, ErrorCode.ENGINE_ERROR, "engine is not running")
        elif isinstance(msg, p.Cancel):
            await self._on_cancel(conn, msg.request_id)
        elif isinstance(msg, p.StatsSubscribe):
            if conn.stats_task is not None:
                conn.stats_task.cancel()
            conn.stats_task = asyncio.create_task(self._stream_stats(conn, msg.interval))
        elif isinstance(msg, p.StatsUnsubscribe):
            if conn.stats_task is not None:
                conn.stats_task.cancel()
                conn.stats_task = None
        else:  # an Error describing a bad frame
            self._rejected.labels(msg.code).inc()
            await conn.send(msg)

    async def _refuse(self, conn: _Connection, msg: p.Generate, code: ErrorCode,
                      message: str) -> None:
        self._rejected.labels(code).inc()
        await conn.send(p.Error(code=code, message=message, request_id=msg.request_id))

    async def _on_generate(self, conn: _Connection, msg: p.Generate) -> None:
        """Check the request (`AsyncLLMEngine.check_request`, plus this connection's own
        limits) and start streaming it; a refusal raises a `RequestError`."""
        engine = self.engine
        rid = msg.request_id
        if self._draining:
            raise OverloadedError("server is shutting down")
        if engine.errored or not engine.is_running:
            raise EngineDeadError("engine is not running")
        if rid in conn.requests:
            raise DuplicateRequestIdError(f"request_id {rid!r} is already in flight",
                                          field="request_id")
        if len(conn.requests) >= self.config.max_requests_per_connection:
            raise OverloadedError("too many in-flight requests on this connection "
                                  f"(max {self.config.max_requests_per_connection})")
        # Engine ids are per connection so two clients may use the same request_id.
        engine_rid = f"c{conn.id}:{rid}"
        # Reserve the id while tokenizing (which may yield to other tasks).
        slot = _InFlight(task=None, prompt_tokens=0)
        conn.requests[rid] = slot
        try:
            params = msg.params.to_sampling_params()
            if params.structured_outputs is not None:  # compiled off the loop, time-limited
                await compile_constraint(engine, params.structured_outputs)
            prompt_ids = await self._tokenize(msg)
            # Synchronous from this check to `add_request`, so the queue limits hold exactly.
            engine.check_request(engine_rid, prompt_ids, params,
                                 queue_limits=self._queue_limits)
            slot.prompt_tokens = len(prompt_ids)
            slot.n = params.n
            if self.config.log_prompts:
                logger.info("request %s/%s: %r", conn.id, rid, msg.prompt or msg.messages)
            slot.stream = engine.add_request(None, params, engine_rid,
                                             prompt_token_ids=prompt_ids)
        except BaseException:
            del conn.requests[rid]
            raise
        slot.task = asyncio.create_task(self._stream(conn, rid, slot, slot.stream))

    async def _tokenize(self, msg: p.Generate) -> list[int]:
        if msg.prompt_token_ids is not None:
            return list(msg.prompt_token_ids)
        engine = self.engine
        if engine.tokenizer is None:
            raise InvalidRequestError("this server has no tokenizer: send `prompt_token_ids` "
                                      "instead of `prompt` or `messages`")
        try:
            if msg.messages is not None:
                messages = [{"role": m.role, "content": m.content} for m in msg.messages]
                ids = await maybe_in_thread(chat_size(messages), engine.encode_chat, messages)
            else:
                assert msg.prompt is not None
                ids = await maybe_in_thread(len(msg.prompt), engine.encode, msg.prompt)
        except RequestError:
            raise
        except ValueError as exc:  # the tokenizer's own complaint
            raise InvalidRequestError(str(exc)) from exc
        return list(ids)

    async def _stream(self, conn: _Connection, rid: str, slot: _InFlight,
                      stream: RequestStream) -> None:
        """Run one request: deltas, then done (or an error)."""
        default_reason = "abort"
        try:
            async for out in stream:
                if out.prompt_logprobs is not None:
                    slot.prompt_logprobs = p.wire_prompt_logprobs(out.prompt_logprobs)
                for comp in out.outputs:
                    if comp.token_ids or comp.text:
                        slot.completion_tokens += len(comp.token_ids)
                        await conn.send(p.Delta(
                            request_id=rid, text=comp.text, token_ids=comp.token_ids,
                            index=comp.index if slot.n > 1 else None))
                    if comp.finish_reason is not None:
                        slot.finish_reasons[comp.index] = comp.finish_reason
                if out.finished:
                    default_reason = "stop"
            await conn.send(slot.done(rid, default_reason))
        except RequestError as exc:  # refused on the step thread (a text prompt's check)
            self._rejected.labels(exc.code).inc()
            await conn.send(p.Error(code=exc.code, message=exc.message, request_id=rid))
        except ValueError as exc:  # the tokenizer's own complaint, from the step thread
            self._rejected.labels(ErrorCode.INVALID_REQUEST).inc()
            await conn.send(p.Error(code=ErrorCode.INVALID_REQUEST, message=str(exc),
                                    request_id=rid))
        except (RequestFailedError, EngineDeadError) as exc:
            await conn.send(p.Error(code=ErrorCode.ENGINE_ERROR, message=str(exc),
                                    request_id=rid))
        finally:
            stream.close()
            if conn.requests.get(rid) is slot:
                del conn.requests[rid]

    async def _on_cancel(self, conn: _Connection, rid: str) -> None:
        slot = conn.requests.get(rid)
        if slot is None or slot.task is None:
            await conn.send(p.Error(code=ErrorCode.NOT_FOUND, request_id=rid,
                                    message=f"no request {rid!r} in flight on this connection"))
            return
        slot.stop()
        await asyncio.wait([slot.task])
        # A task cancelled before it first ran never reached its `finally`.
        if conn.requests.get(rid) is slot:
            del conn.requests[rid]
        if slot.n == 1:
            slot.finish_reasons.clear()  # a cancelled request reports "abort"
        await conn.send(slot.done(rid, "abort"))

    async def _stream_stats(self, conn: _Connection, interval: float) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            conn.try_send(p.Stats(stats=self.engine.stats()))
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - loop.time()))


def _wire_message(exc: RequestError, msg: p.Generate) -> str:
    """The error's message with the JSON path of its field in `msg`, when it has one."""
    field = exc.field
    if field is None:
        return exc.message
    if field in p.GenerateParams.__struct_fields__:
        path = f"$.params.{field}"
    elif field in ("prompt", "messages", "prompt_token_ids"):
        # The prompt as the client sent it: text, chat messages or token ids.
        sent = next(f for f in ("prompt", "messages", "prompt_token_ids")
                    if getattr(msg, f) is not None)
        path = f"$.{field if field == 'prompt_token_ids' else sent}"
    else:
        path = f"$.{field}"
    return f"{exc.message} - at `{path}`"


@contextlib.asynccontextmanager
async def serve_engine(
    engine: AsyncLLMEngine, config: ServerConfig | None = None
) -> AsyncIterator[EngineServer]:
    """Serve `engine` for the duration of the block; on exit, drain briefly and close.

    `async with serve_engine(engine, ServerConfig(port=0)) as server: server.port`
    """
    server = EngineServer(engine, config or ServerConfig())
    await server.start()
    try:
        yield server
    finally:
        await server.close()


async def run_server(
    engine: AsyncLLMEngine,
    config: ServerConfig,
    *,
    stop: asyncio.Event | None = None,
    on_started: Any = None,
) -> None:
    """Serve until SIGINT/SIGTERM (or `stop` is set), then drain and return.

    `on_started(server)`, when given, is awaited once the server listens; when it returns
    the server drains too (the dashboard runs there in `serve --dashboard`).
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    server = EngineServer(engine, config)
    await server.start()
    waiters = [asyncio.create_task(stop.wait())]
    if on_started is not None:
        waiters.append(asyncio.create_task(on_started(server)))
    try:
        done, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            if t.exception() is not None:
                logger.error("stopping: %r", t.exception())
        logger.info("shutting down: draining requests")
        await server.drain()
    finally:
        await server.close()
        for sig in installed:
            loop.remove_signal_handler(sig)
