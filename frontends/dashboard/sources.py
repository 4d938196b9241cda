"""Where the dashboard's data comes from: a stream of stats snapshots and connection events.

A `StatsSource` is an async iterable of `SourceEvent`s: `EngineStats` snapshots interleaved
with connection-state events (`Connecting`, `Connected`, `Disconnected`, `Reconnecting`).
The app consumes one source and knows nothing of sockets, so tests and snapshots inject a
`ScriptedStatsSource` (deterministic, no timers) and the CLI injects a
`WebSocketStatsSource`, which talks to `asyncengine serve` and reconnects on its own.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Protocol, runtime_checkable

import msgspec
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from asyncengine.stats_schema import EngineStats

__all__ = [
    "Connected",
    "Connecting",
    "Disconnected",
    "Reconnecting",
    "ScriptedStatsSource",
    "SourceEvent",
    "StatsSource",
    "WebSocketStatsSource",
    "backoff_delay",
]


class Connecting(msgspec.Struct, frozen=True, kw_only=True):
    """An attempt to open the connection has started (attempt 0 is the first)."""

    url: str
    attempt: int = 0


class Connected(msgspec.Struct, frozen=True, kw_only=True):
    """The connection is open and the stats subscription was sent."""

    url: str


class Disconnected(msgspec.Struct, frozen=True, kw_only=True):
    """The connection failed or closed; `reason` says why, in words for the status line."""

    url: str
    reason: str
    will_retry: bool = True


class Reconnecting(msgspec.Struct, frozen=True, kw_only=True):
    """The next attempt starts in `delay_s` seconds; repeated as the countdown ticks."""

    url: str
    delay_s: float
    attempt: int


ConnectionEvent = Connecting | Connected | Disconnected | Reconnecting
SourceEvent = EngineStats | ConnectionEvent


@runtime_checkable
class StatsSource(Protocol):
    """An async iterable of stats snapshots and connection events, for one server."""

    url: str

    def __aiter__(self) -> AsyncIterator[SourceEvent]: ...


def backoff_delay(
    attempt: int,
    *,
    initial: float,
    maximum: float,
    factor: float = 2.0,
    jitter: float = 0.2,
    rng: Callable[[], float] = random.random,
) -> float:
    """Exponential back-off for retry `attempt` (0-based), capped at `maximum`.

    The jitter only shortens the delay (by up to `jitter` of it), so the cap holds and
    dashboards started together don't reconnect in lock-step after a server restart.
    """
    base = min(maximum, initial * factor**attempt)
    return base * (1.0 - jitter * rng())


class _ServerEvent(msgspec.Struct):
    """The part of a server event the dashboard reads; other events and fields are ignored."""

    type: str
    stats: EngineStats | None = None
    code: str | None = None
    message: str | None = None


_event_decoder = msgspec.json.Decoder(_ServerEvent)
_encoder = msgspec.json.Encoder()


def _describe(exc: BaseException) -> str:
    """A short, operator-facing reason for a failed or closed connection."""
    if isinstance(exc, InvalidStatus):
        status = exc.response.status_code
        hint = " (check --api-key)" if status in (401, 403) else ""
        return f"server refused the connection: HTTP {status}{hint}"
    if isinstance(exc, ConnectionClosed):
        rcvd = exc.rcvd
        if rcvd is None:
            return "connection lost"
        reason = f": {rcvd.reason}" if rcvd.reason else ""
        return f"server closed the connection ({rcvd.code}{reason})"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return "timed out opening the connection"
    if isinstance(exc, msgspec.DecodeError):
        return f"unreadable stats event: {exc}"
    return str(exc) or type(exc).__name__


class WebSocketStatsSource:
    """Stats from an asyncengine server's WebSocket, with automatic reconnection.

    Iterating yields `Connecting`, then `Connected` and a stream of `EngineStats`; when the
    server goes away it yields `Disconnected`, then `Reconnecting` once per second of the
    back-off countdown, and starts over. It only stops on a URL that can never work, or
    when the consuming task is cancelled.

    Args:
        url: WebSocket URL of the server, e.g. ``ws://127.0.0.1:8765``.
        api_key: Sent as ``Authorization: Bearer <key>`` when given.
        interval: Seconds between snapshots, asked of the server on subscribe.
        backoff_initial: First retry delay in seconds; doubles per failed attempt.
        backoff_max: Cap on the retry delay in seconds.
        open_timeout: Seconds allowed for the opening handshake.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        interval: float = 1.0,
        *,
        backoff_initial: float = 0.5,
        backoff_max: float = 10.0,
        open_timeout: float = 5.0,
        rng: Callable[[], float] = random.random,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        self.url = url
        self.interval = interval
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._open_timeout = open_timeout
        self._rng = rng
        self._sleep = sleep

    def __aiter__(self) -> AsyncIterator[SourceEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[SourceEvent]:
        attempt = 0
        while True:
            yield Connecting(url=self.url, attempt=attempt)
            received = False
            try:
                async with connect(
                    self.url,
                    additional_headers=self._headers,
                    open_timeout=self._open_timeout,
                    proxy=None,  # the server is usually local; never detour via a proxy
                    max_size=8 * 2**20,
                ) as ws:
                    subscribe = {"type": "stats.subscribe", "interval": self.interval}
                    await ws.send(_encoder.encode(subscribe).decode())
                    yield Connected(url=self.url)
                    async for raw in ws:
                        event = _event_decoder.decode(raw)
                        if event.type == "stats" and event.stats is not None:
                            received = True
                            yield event.stats
                    code = ws.close_code
                    reason = f"server closed the connection ({code})"
            except InvalidURI as exc:
                yield Disconnected(url=self.url, reason=str(exc), will_retry=False)
                return
            except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed) as exc:
                reason = _describe(exc)
            except msgspec.DecodeError as exc:
                reason = _describe(exc)
            # A connection that delivered data proves the server is back: start the
            # back-off afresh. One that opens and closes at once keeps backing off.
            if received:
                attempt = 0
            yield Disconnected(url=self.url, reason=reason)
            delay = backoff_delay(
                attempt, initial=self._backoff_initial, maximum=self._backoff_max, rng=self._rng
            )
            attempt += 1
            async for event in self._countdown(delay, attempt):
                yield event

    async def _countdown(self, delay: float, attempt: int) -> AsyncIterator[Reconnecting]:
        """Yield `Reconnecting` now and at each whole second left, sleeping in between."""
        remaining = delay
        while remaining > 0:
            yield Reconnecting(url=self.url, delay_s=remaining, attempt=attempt)
            step = remaining - math.floor(remaining) or min(1.0, remaining)
            await self._sleep(step)
            remaining = round(remaining - step, 9)


_END = object()


class ScriptedStatsSource:
    """A deterministic source for tests, snapshots and demos: it yields what it is fed.

    Events given to the constructor or `push` are yielded in order with no timers; when
    the script runs out the iterator waits for more, so the app stays "live". `close`
    ends the iteration. `wait_consumed` returns once the consumer has handled every
    event pushed so far (it has asked for the next one), which lets a test assert on the
    result of exactly the events it fed.
    """

    def __init__(self, events: Iterable[SourceEvent] = (), *, url: str = "scripted://") -> None:
        self.url = url
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._consumed = asyncio.Event()
        self.push(*events)

    def push(self, *events: SourceEvent) -> None:
        """Append events to the script."""
        for event in events:
            self._queue.put_nowait(event)
        if events:
            self._consumed.clear()

    def close(self) -> None:
        """End the iteration once the events already pushed are consumed."""
        self._queue.put_nowait(_END)
        self._consumed.clear()

    async def wait_consumed(self) -> None:
        """Wait until every event pushed so far has been handled by the consumer."""
        await self._consumed.wait()

    def __aiter__(self) -> AsyncIterator[SourceEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[SourceEvent]:
        while True:
            if self._queue.empty():
                self._consumed.set()
            item = await self._queue.get()
            if item is _END:
                self._consumed.set()
                return
            yield item  # type: ignore[misc]
