"""The `asyncengine monitor` Textual app: one window onto a running server.

The app consumes a `StatsSource` in a worker, keeps the connection state, the snapshot on
display and its history in reactive attributes, and hands each new snapshot to the
panels. The source is injected, so tests and snapshots run on scripted data with no timers
and no server. Keys: `p` pauses (the display freezes, history keeps recording), `r` resets
the history, `q` quits.
"""

from __future__ import annotations

import math
from typing import ClassVar

import msgspec
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Footer, Header

from asyncengine.stats_schema import EngineStats

from .fleet import FleetPanel, FleetStats
from .history import StatsHistory
from .panels import (
    DevicePanel,
    KVCachePanel,
    LatencyPanel,
    Panel,
    QueuePanel,
    RequestsPanel,
    ThroughputPanel,
)
from .sources import (
    Connected,
    Connecting,
    Disconnected,
    Reconnecting,
    SourceEvent,
    StatsSource,
)

__all__ = ["ConnectionState", "ConnectionStatus", "MonitorApp"]


class ConnectionState(msgspec.Struct, frozen=True, kw_only=True):
    """What the status line says about the link to the server."""

    status: str = "connecting"  # connecting | connected | reconnecting | disconnected
    url: str = ""
    reason: str = ""
    retry_in_s: float | None = None
    attempt: int = 0


_STATUS_STYLES = {
    "connected": ("●", "#3fb950"),
    "connecting": ("◌", "#d29922"),
    "reconnecting": ("◌", "#d29922"),
    "disconnected": ("●", "#f85149"),
}


class ConnectionStatus(Widget):
    """The one-line status bar: connection state, URL, model, and a pause badge."""

    DEFAULT_CSS = """
    ConnectionStatus { height: 1; }
    """

    state: reactive[ConnectionState] = reactive(ConnectionState)
    model: reactive[str] = reactive("")
    paused: reactive[bool] = reactive(False)

    def render(self) -> Text:
        state = self.state
        glyph, colour = _STATUS_STYLES.get(state.status, ("●", "white"))
        text = Text(no_wrap=True, overflow="ellipsis", end="")
        text.append(f" {glyph} ", style=f"bold {colour}")
        if state.status == "reconnecting" and state.retry_in_s is not None:
            text.append(f"reconnecting in {math.ceil(state.retry_in_s)} s", style=f"bold {colour}")
        else:
            text.append(state.status, style=f"bold {colour}")
        text.append("  ")
        text.append(state.url, style="underline")
        if self.model:
            text.append("  model ", style="dim")
            text.append(self.model, style="bold")
        if self.paused:
            text.append("  ")
            text.append(" ⏸ PAUSED ", style="bold #0d1117 on #d29922")
        if state.reason and state.status != "connected":
            text.append(f"  {state.reason}", style=colour)
        return text


class MonitorApp(App[None]):
    """Live view of an asyncengine server's queue, KV cache, throughput and device."""

    CSS_PATH = "dashboard.tcss"
    ENABLE_COMMAND_PALETTE = False
    TITLE = "asyncengine monitor"
    BINDINGS: ClassVar[list[BindingType]] = [
        ("p", "pause", "Pause"),
        ("p", "resume", "Resume"),
        ("r", "reset", "Reset history"),
        ("q", "quit", "Quit"),
    ]

    stats: reactive[EngineStats | None] = reactive(None, always_update=True)
    """The snapshot on display (frozen while paused)."""
    latest: reactive[EngineStats | None] = reactive(None, always_update=True)
    """The newest snapshot received, shown or not."""
    connection: reactive[ConnectionState] = reactive(ConnectionState)
    paused: reactive[bool] = reactive(False, bindings=True)
    snapshots_received: reactive[int] = reactive(0)

    def __init__(
        self,
        source: StatsSource,
        *,
        title: str | None = None,
        history_size: int = 300,
        fleet: bool = False,
    ) -> None:
        super().__init__()
        self.source = source
        # A fleet's source also sends `FleetStats`: a row per replica replaces the requests.
        self.fleet = fleet
        self.history = StatsHistory(history_size)
        if title:
            self.title = title
        self.set_reactive(MonitorApp.connection, ConnectionState(url=source.url))

    def compose(self) -> ComposeResult:
        yield Header(icon="◆")
        yield ConnectionStatus(id="status")
        with Vertical(id="panels"):
            with Horizontal(id="top-row"):
                yield ThroughputPanel(id="throughput")
                yield QueuePanel(id="queue")
                yield DevicePanel(id="device")
            with Horizontal(id="middle-row"):
                yield KVCachePanel(id="kv-cache")
                yield LatencyPanel(id="latency")
            if self.fleet:
                yield FleetPanel(id="fleet")
            else:
                yield RequestsPanel(id="requests")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(ConnectionStatus).state = self.connection
        self.consume()

    @work(exclusive=True, exit_on_error=False, group="source")
    async def consume(self) -> None:
        """Read the source until it ends; each event updates the reactive state."""
        try:
            async for event in self.source:
                self.handle_event(event)
        except Exception as exc:  # a broken source must not take the window down
            self.connection = ConnectionState(
                status="disconnected", url=self.source.url, reason=f"source failed: {exc}"
            )
            return
        if self.connection.status != "disconnected":
            self.connection = ConnectionState(
                status="disconnected", url=self.source.url, reason="stream ended"
            )

    def handle_event(self, event: SourceEvent) -> None:
        """Apply one event from the source."""
        if isinstance(event, FleetStats):
            if self.fleet and not self.paused:
                self.query_one(FleetPanel).show_fleet(event)
            return
        if isinstance(event, EngineStats):
            self.history.append(event)
            self.snapshots_received += 1
            self.latest = event
            if not self.paused:
                self.stats = event
            return
        current = self.connection
        if isinstance(event, Connecting):
            new = ConnectionState(
                status="connecting", url=event.url, reason=current.reason, attempt=event.attempt
            )
        elif isinstance(event, Connected):
            new = ConnectionState(status="connected", url=event.url)
        elif isinstance(event, Disconnected):
            new = ConnectionState(status="disconnected", url=event.url, reason=event.reason)
        elif isinstance(event, Reconnecting):
            new = ConnectionState(
                status="reconnecting",
                url=event.url,
                reason=current.reason,
                retry_in_s=event.delay_s,
                attempt=event.attempt,
            )
        else:
            return
        self.connection = new

    # -- watchers ---------------------------------------------------------------------
    def watch_stats(self, stats: EngineStats | None) -> None:
        if stats is None:
            return
        for panel in self.query(Panel):
            panel.show(stats, self.history)
        self.query_one(ConnectionStatus).model = stats.model

    def watch_connection(self, state: ConnectionState) -> None:
        self.query_one(ConnectionStatus).state = state
        # Old figures stay visible, greyed out, while the server is away.
        self.query_one("#panels").set_class(state.status != "connected", "-stale")

    def watch_paused(self, paused: bool) -> None:
        self.query_one(ConnectionStatus).paused = paused
        if not paused and self.latest is not None and self.latest is not self.stats:
            self.stats = self.latest

    # -- actions ----------------------------------------------------------------------
    def action_pause(self) -> None:
        """Freeze the display; snapshots keep arriving and feeding the history."""
        self.paused = True

    def action_resume(self) -> None:
        """Unfreeze the display and jump to the newest snapshot."""
        self.paused = False

    def action_reset(self) -> None:
        """Forget the history behind the sparklines."""
        self.history.clear()
        if self.stats is not None:
            self.stats = self.stats  # redraw the panels with the emptied history

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # `p` is Pause or Resume, whichever applies; the footer shows only that one.
        if action == "pause":
            return not self.paused
        if action == "resume":
            return self.paused
        return True
