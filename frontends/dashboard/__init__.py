"""`asyncengine monitor`: a Textual dashboard of a running asyncengine server.

`run_monitor(url)` is the entry point the CLI calls; `MonitorApp` takes any `StatsSource`
(a live `WebSocketStatsSource`, or a `ScriptedStatsSource` in tests and demos).
"""

from __future__ import annotations

from .app import ConnectionState, MonitorApp
from .fleet import FleetStats, FleetStatsSource
from .sources import (
    Connected,
    Connecting,
    Disconnected,
    Reconnecting,
    ScriptedStatsSource,
    SourceEvent,
    StatsSource,
    WebSocketStatsSource,
)

__all__ = [
    "Connected",
    "Connecting",
    "ConnectionState",
    "Disconnected",
    "FleetStats",
    "FleetStatsSource",
    "MonitorApp",
    "Reconnecting",
    "ScriptedStatsSource",
    "SourceEvent",
    "StatsSource",
    "WebSocketStatsSource",
    "run_fleet_monitor",
    "run_monitor",
]


async def run_monitor(
    url: str,
    api_key: str | None = None,
    *,
    title: str | None = None,
    interval: float = 1.0,
) -> None:
    """Run the dashboard against the server at `url` in the current event loop, until quit.

    Args:
        url: WebSocket URL of the server, e.g. ``ws://127.0.0.1:8765``.
        api_key: The server's API key, if it requires one.
        title: Window title; defaults to "asyncengine monitor".
        interval: Seconds between the snapshots the server is asked to send.
    """
    source = WebSocketStatsSource(url, api_key=api_key, interval=interval)
    await MonitorApp(source, title=title).run_async()


async def run_fleet_monitor(
    urls: list[str],
    api_key: str | None = None,
    *,
    title: str | None = None,
    interval: float = 1.0,
) -> None:
    """Run the dashboard of several servers (a fleet's replicas): the usual panels show
    their totals, and a table shows each replica. `urls` are their WebSocket URLs."""
    source = FleetStatsSource(urls, api_key=api_key, interval=interval)
    await MonitorApp(source, title=title or "asyncengine fleet", fleet=True).run_async()
