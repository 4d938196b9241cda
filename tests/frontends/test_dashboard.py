"""Tests of the `asyncengine monitor` dashboard: sources, widgets, the app, snapshots."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
from rich.text import Text
from textual.widgets import Digits, Label, Static
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from asyncengine.stats_schema import DeviceStats, EngineStats, LatencySummary, RequestStats
from frontends.dashboard import (
    Connected,
    Connecting,
    Disconnected,
    MonitorApp,
    Reconnecting,
    ScriptedStatsSource,
    SourceEvent,
    StatsSource,
    WebSocketStatsSource,
)
from frontends.dashboard.app import ConnectionStatus
from frontends.dashboard.demo import demo_frames, idle_cpu_stats
from frontends.dashboard.history import StatsHistory
from frontends.dashboard.panels import RequestTable
from frontends.dashboard.sources import backoff_delay
from frontends.dashboard.widgets import (
    BLOCK_COLORS,
    BlockMap,
    HistorySparkline,
    Meter,
    StackedBar,
    downsample_block_map,
    fmt_age,
    fmt_compact,
    fmt_count,
    fmt_latency,
    fmt_rate,
    split_cells,
)

UNIT = 1.0  # seconds; timeouts below are multiples of it
SIZE = (120, 40)
URL = "ws://127.0.0.1:8765"


def _request(
    rid: str, state: str = "running", generated: int = 10, age: float = 1.0
) -> RequestStats:
    return RequestStats(
        request_id=rid,
        state=state,  # type: ignore[arg-type]
        prompt_tokens=100,
        generated_tokens=generated,
        tokens_per_s=12.5,
        age_s=age,
    )


def busy_stats(**changes: object) -> EngineStats:
    """A hand-made GPU snapshot whose every figure the tests can name."""
    stats = EngineStats(
        timestamp=10.0,
        num_running=2,
        num_waiting=1,
        num_swapped=1,
        kv_blocks_total=16,
        kv_blocks_used=8,
        kv_blocks_cached=4,
        kv_block_size=16,
        kv_block_map="ssuuuuuucccc....",
        prefix_cache_hit_rate=0.625,
        prefix_cache_queries=8,
        prefix_cache_hits=5,
        num_preemptions=3,
        num_swaps_out=2,
        num_swaps_in=1,
        prompt_tokens_total=5000,
        generation_tokens_total=1200,
        prompt_tokens_per_s=4321.0,
        generation_tokens_per_s=876.0,
        num_requests_finished=40,
        num_requests_aborted=2,
        ttft=LatencySummary(p50=0.05, p90=0.12, p99=0.4, count=40),
        itl=LatencySummary(p50=0.012, p90=0.018, p99=0.031, count=900),
        requests=[
            _request("req-a", "running", 20, 3.0),
            _request("req-b", "running", 5, 2.0),
            _request("req-c", "waiting", 0, 1.0),
            _request("req-d", "swapped", 7, 4.0),
        ],
        device=DeviceStats(
            kind="cuda",
            name="NVIDIA H200",
            memory_used_bytes=70 * 2**30,
            memory_total_bytes=140 * 2**30,
            utilization_percent=87.0,
            power_watts=512.0,
            temperature_c=61.0,
        ),
        model="tiny-llama",
    )
    return msgspec.structs.replace(stats, **changes)


def plain(widget: Label | Static) -> str:
    """The text a Label/Static shows."""
    content = widget.render()
    return content.plain if isinstance(content, Text) else str(content)


async def fed(app: MonitorApp, source: ScriptedStatsSource, pilot, *events: SourceEvent) -> None:
    """Push events and wait until the app has applied them and repainted."""
    source.push(*events)
    async with asyncio.timeout(2 * UNIT):
        await source.wait_consumed()
    await pilot.pause()


# -- formatting and drawing helpers ------------------------------------------------------
def test_formatting_units() -> None:
    assert fmt_rate(4321.4) == "4,321"
    assert fmt_rate(12.34) == "12.3"
    assert fmt_latency(0.0213) == "21.3 ms"
    assert fmt_latency(0.4) == "400 ms"
    assert fmt_latency(1.5) == "1.50 s"
    assert fmt_latency(0.5, count=0) == "—"
    assert fmt_age(7.25) == "7.2 s"
    assert fmt_age(184) == "3m 04s"
    assert fmt_age(3720) == "1h 02m"


def test_request_rate_cell_waits_for_a_second_token() -> None:
    def cell(state: str, rate: float | None) -> str:
        row = RequestTable.cells(msgspec.structs.replace(_request("r", state), tokens_per_s=rate))
        return row[4].plain  # type: ignore[union-attr]

    assert cell("running", None) == "—"  # one token: no rate yet
    assert cell("running", 42.25) == "42.2"
    assert cell("swapped", 42.25) == "—"  # not decoding now


def test_split_cells_is_proportional_and_keeps_small_segments_visible() -> None:
    assert split_cells([50, 25, 25], 8) == [4, 2, 2]
    cells = split_cells([1000, 1, 0, 5], 20)
    assert sum(cells) == 20
    assert cells[1] == 1 and cells[2] == 0 and cells[3] == 1
    assert split_cells([0, 0], 10) == [0, 0]


def test_downsample_block_map_keeps_the_commonest_state() -> None:
    same, per_cell = downsample_block_map("uus.", 8)
    assert (same, per_cell) == ("uus.", 1)
    small, per_cell = downsample_block_map("uuus" + "cc.." + "ssss", 3)
    assert per_cell == 4
    assert small == "u" + "c" + "s"  # the tie in the middle cell goes to cached over free


def test_history_records_and_clears() -> None:
    history = StatsHistory(maxlen=3)
    for i in range(5):
        history.append(busy_stats(num_running=i, kv_blocks_used=i))
    assert history["running"] == [2.0, 3.0, 4.0]
    assert history["kv_usage"] == [2 / 16, 3 / 16, 4 / 16]
    history.clear()
    assert len(history) == 0 and history["waiting"] == []


def test_backoff_grows_is_capped_and_jitter_only_shortens() -> None:
    no_jitter = [backoff_delay(a, initial=0.5, maximum=10.0, rng=lambda: 0.0) for a in range(8)]
    assert no_jitter == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    full = backoff_delay(3, initial=0.5, maximum=10.0, jitter=0.2, rng=lambda: 1.0)
    assert full == pytest.approx(4.0 * 0.8)
    assert all(backoff_delay(a, initial=1, maximum=5, rng=lambda: 0.5) <= 5 for a in range(20))


# -- WebSocketStatsSource ----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_source_counts_down_each_second_before_retrying() -> None:
    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    port = _free_port()  # nothing listens there: every attempt is refused
    source = WebSocketStatsSource(
        f"ws://127.0.0.1:{port}",
        backoff_initial=2.7,
        backoff_max=30,
        rng=lambda: 0.0,
        sleep=fake_sleep,
    )
    events: list[SourceEvent] = []
    async with asyncio.timeout(5 * UNIT):
        async for event in source:
            events.append(event)
            if isinstance(event, Connecting) and event.attempt == 2:
                break
    kinds = [type(e).__name__ for e in events]
    assert kinds[:6] == [
        "Connecting",
        "Disconnected",
        "Reconnecting",
        "Reconnecting",
        "Reconnecting",
        "Connecting",
    ]
    first = events[1]
    assert isinstance(first, Disconnected) and first.reason == "connection refused"
    countdown = [e.delay_s for e in events[2:5] if isinstance(e, Reconnecting)]
    assert countdown == pytest.approx([2.7, 2.0, 1.0])
    assert sleeps[:3] == pytest.approx([0.7, 1.0, 1.0])
    # The second failure backs off twice as long: 5.4 s, counted down from 5.4.
    second = [e for e in events[6:] if isinstance(e, Reconnecting)]
    assert second[0].delay_s == pytest.approx(5.4) and second[0].attempt == 2


async def test_source_stops_on_a_url_that_can_never_work() -> None:
    events = [e async for e in WebSocketStatsSource("http://not-a-websocket")]
    assert isinstance(events[-1], Disconnected)
    assert events[-1].will_retry is False


class TinyStatsServer:
    """A stand-in server on a fixed port: on subscribe it sends `per_connection` stats."""

    def __init__(self, port: int = 0, per_connection: int = 2) -> None:
        self.port = port
        self.per_connection = per_connection
        self.subscriptions: list[dict[str, object]] = []
        self.auth_headers: list[str | None] = []
        self.sent = 0
        self._server = None

    async def handler(self, ws: ServerConnection) -> None:
        self.auth_headers.append(ws.request.headers.get("Authorization"))
        self.subscriptions.append(json.loads(await ws.recv()))
        for _ in range(self.per_connection):
            self.sent += 1
            event = {"type": "stats", "stats": busy_stats(num_running=self.sent)}
            await ws.send(msgspec.json.encode(event).decode())
        await ws.send(json.dumps({"type": "delta", "request_id": "x", "text": "ignored"}))
        await ws.wait_closed()

    async def start(self) -> None:
        self._server = await serve(self.handler, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()  # closes open connections with 1001 (going away)
        await self._server.wait_closed()


async def _collect(source: StatsSource, into: asyncio.Queue[SourceEvent]) -> None:
    async for event in source:
        await into.put(event)


async def _next_matching(
    queue: asyncio.Queue[SourceEvent], seen: list[SourceEvent], pred: Callable[[SourceEvent], bool]
) -> SourceEvent:
    async with asyncio.timeout(5 * UNIT):
        while True:
            event = await queue.get()
            seen.append(event)
            if pred(event):
                return event


async def test_source_reconnects_after_the_server_restarts() -> None:
    server = TinyStatsServer()
    await server.start()
    source = WebSocketStatsSource(
        f"ws://127.0.0.1:{server.port}",
        api_key="sekret",
        interval=0.25,
        backoff_initial=0.05,
        backoff_max=0.2,
    )
    queue: asyncio.Queue[SourceEvent] = asyncio.Queue()
    seen: list[SourceEvent] = []
    consumer = asyncio.create_task(_collect(source, queue))
    try:
        await _next_matching(
            queue, seen, lambda e: isinstance(e, EngineStats) and e.num_running == 2
        )
        assert server.subscriptions == [{"type": "stats.subscribe", "interval": 0.25}]
        assert server.auth_headers == ["Bearer sekret"]

        await server.stop()
        gone = await _next_matching(queue, seen, lambda e: isinstance(e, Disconnected))
        assert isinstance(gone, Disconnected)
        assert gone.reason == "server closed the connection (1001)"
        await _next_matching(queue, seen, lambda e: isinstance(e, Reconnecting))
        # While the port is closed, attempts are refused and back off.
        await _next_matching(
            queue, seen, lambda e: isinstance(e, Disconnected) and e.reason == "connection refused"
        )

        restarted = TinyStatsServer(port=server.port)
        await restarted.start()
        try:
            back = await _next_matching(queue, seen, lambda e: isinstance(e, EngineStats))
            assert isinstance(back, EngineStats) and back.num_running == 1
            await _next_matching(queue, seen, lambda e: isinstance(e, EngineStats))
        finally:
            await restarted.stop()
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await asyncio.gather(server.stop(), return_exceptions=True)

    kinds = [type(e).__name__ for e in seen]
    first_gone = kinds.index("Disconnected")
    assert kinds[:4] == ["Connecting", "Connected", "EngineStats", "EngineStats"]
    assert kinds[first_gone + 1] == "Reconnecting"
    assert "Connected" in kinds[first_gone:]  # the second connection
    assert all(isinstance(e, EngineStats) or e.url == source.url for e in seen)  # type: ignore[union-attr]


# -- the app, headless -------------------------------------------------------------------
@pytest.fixture
def source() -> ScriptedStatsSource:
    return ScriptedStatsSource(url=URL)


async def test_app_shows_the_injected_stats(source: ScriptedStatsSource) -> None:
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await fed(app, source, pilot, Connected(url=URL), busy_stats())
        assert app.connection.status == "connected"
        assert app.snapshots_received == 1
        assert app.stats is not None and app.stats.num_running == 2

        # Throughput: big digits and totals.
        assert app.query_one("#prompt-digits", Digits).value == "4,321"
        assert app.query_one("#generation-digits", Digits).value == "876"
        assert "5.0k" in plain(app.query_one("#prompt-total", Label))
        # Queue counts and their sparklines.
        assert plain(app.query_one("#running-count", Label)) == "2"
        assert plain(app.query_one("#waiting-count", Label)) == "1"
        assert plain(app.query_one("#swapped-count", Label)) == "1"
        assert app.query_one("#running-spark", HistorySparkline).data == [2.0]
        assert "finished 40" in plain(app.query_one("#queue-summary", Label))
        # KV cache: bar segments (used-only, shared, cached, free), block map, events.
        bar = app.query_one("#kv-bar", StackedBar)
        assert [count for count, _ in bar.segments] == [6, 2, 4, 4]
        assert app.query_one(BlockMap).block_map == "ssuuuuuucccc...."
        events = plain(app.query_one("#kv-events", Label))
        assert "62.5%" in events and "preemptions 3" in events and "2/1" in events
        assert "16 blocks × 16 tokens" in app.query_one("#kv-cache").border_subtitle
        # Device: GPU figures.
        assert "NVIDIA H200" in plain(app.query_one("#device-name", Label))
        memory = app.query_one("#device-memory", Meter)
        assert memory.label == "memory" and memory.fraction == pytest.approx(0.5)
        assert memory.value_text == "70.0/140.0 GiB"
        util = app.query_one("#device-util", Meter)
        assert util.fraction == pytest.approx(0.87) and util.value_text == "87 %"
        assert "512 W" in plain(app.query_one("#device-extra", Label))
        # Status line: state, URL and model.
        status = app.query_one(ConnectionStatus).render().plain
        assert "connected" in status and URL in status and "tiny-llama" in status
        assert not app.query_one("#panels").has_class("-stale")


async def test_kv_panel_shows_the_kv_dtype(source: ScriptedStatsSource) -> None:
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await fed(app, source, pilot, Connected(url=URL), busy_stats(kv_cache_dtype="fp8_e4m3"))
        subtitle = app.query_one("#kv-cache").border_subtitle
        assert "16 blocks × 16 tokens · KV fp8_e4m3 · ▀ = " in subtitle
        await fed(app, source, pilot, busy_stats(kv_cache_dtype="bfloat16"))
        assert "KV bfloat16" in app.query_one("#kv-cache").border_subtitle


async def test_latency_table_shows_percentiles(source: ScriptedStatsSource) -> None:
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await fed(app, source, pilot, Connected(url=URL), busy_stats())
        table = app.query_one("#latency-table", Static)
        cells = [
            [cell.plain if isinstance(cell, Text) else str(cell) for cell in column._cells]
            for column in table.content.columns  # type: ignore[union-attr]
        ]
        assert cells[0] == ["TTFT", "ITL"]
        assert cells[1] == ["50.0 ms", "12.0 ms"]  # p50
        assert cells[3] == ["400 ms", "31.0 ms"]  # p99


async def test_kv_meter_shows_the_room_kept_for_growth(source: ScriptedStatsSource) -> None:
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await fed(app, source, pilot, Connected(url=URL), busy_stats(kv_blocks_reserved=4))
        usage = app.query_one("#kv-usage", Meter)
        assert usage.fraction == pytest.approx(0.5)
        assert usage.value_text == "50.0% + 25% kept for growth"
        await fed(app, source, pilot, busy_stats(kv_blocks_reserved=0))
        assert usage.value_text == "50.0%"


async def test_cpu_device_shows_cpu_and_ram(source: ScriptedStatsSource) -> None:
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await fed(app, source, pilot, Connected(url=URL), idle_cpu_stats())
        assert app.query_one("#device-memory", Meter).label == "RAM"
        util = app.query_one("#device-util", Meter)
        assert util.label == "CPU load" and util.value_text == "2 %"
        assert plain(app.query_one("#device-extra", Label)) == ""  # no power/temp on a CPU
        assert app.query_one(RequestTable).row_count == 0


async def test_request_table_updates_rows_in_place(source: ScriptedStatsSource) -> None:
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await fed(app, source, pilot, Connected(url=URL), busy_stats())
        table = app.query_one(RequestTable)
        assert [row.key.value for row in table.ordered_rows] == ["req-a", "req-b", "req-c", "req-d"]
        key_a = table.ordered_rows[0].key
        added: list[object] = []
        original_add_row = table.add_row

        def spy_add_row(*cells: object, key: str | None = None, **kw: object) -> object:
            added.append(key)
            return original_add_row(*cells, key=key, **kw)

        table.add_row = spy_add_row  # type: ignore[method-assign]

        # req-b finished, req-c started running, req-a made progress, req-e arrived.
        requests = [
            _request("req-a", "running", 25, 4.0),
            _request("req-c", "running", 1, 2.0),
            _request("req-d", "swapped", 7, 5.0),
            _request("req-e", "waiting", 0, 0.5),
        ]
        await fed(app, source, pilot, busy_stats(requests=requests))
        assert added == ["req-e"]  # only the new request got a new row
        assert [row.key.value for row in table.ordered_rows] == ["req-a", "req-c", "req-d", "req-e"]
        assert table.ordered_rows[0].key is key_a
        assert table.get_cell("req-a", "generated").plain == "25"
        assert table.get_cell("req-a", "age").plain == "4.0 s"
        assert table.get_cell("req-c", "state").plain == "running"
        assert table.get_cell("req-e", "tps").plain == "—"
        subtitle = app.query_one("#requests").border_subtitle
        assert "2 running" in subtitle and "1 waiting" in subtitle and "1 swapped" in subtitle


async def test_pause_freezes_the_display_but_keeps_the_history(
    source: ScriptedStatsSource,
) -> None:
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await fed(app, source, pilot, Connected(url=URL), busy_stats(num_running=2))
        await pilot.press("p")
        assert app.paused
        assert "PAUSED" in app.query_one(ConnectionStatus).render().plain
        # The footer offers Resume now, not Pause.
        assert app.check_action("resume", ()) and not app.check_action("pause", ())
        footer_keys = [str(key.description) for key in app.query("FooterKey")]
        assert "Resume" in footer_keys and "Pause" not in footer_keys

        await fed(app, source, pilot, busy_stats(num_running=9, prompt_tokens_per_s=1.0))
        assert plain(app.query_one("#running-count", Label)) == "2"  # frozen
        assert app.query_one("#prompt-digits", Digits).value == "4,321"
        assert app.latest is not None and app.latest.num_running == 9
        assert app.history["running"] == [2.0, 9.0]  # recorded all the same

        await pilot.press("p")
        await pilot.pause()
        assert not app.paused
        assert plain(app.query_one("#running-count", Label)) == "9"
        assert app.query_one("#running-spark", HistorySparkline).data == [2.0, 9.0]
        assert "PAUSED" not in app.query_one(ConnectionStatus).render().plain


async def test_reset_clears_the_history(source: ScriptedStatsSource) -> None:
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await fed(app, source, pilot, Connected(url=URL), *demo_frames(5))
        assert len(app.history) == 5
        assert len(app.query_one("#generation-spark", HistorySparkline).data or []) == 5
        await pilot.press("r")
        await pilot.pause()
        assert len(app.history) == 0
        assert app.query_one("#generation-spark", HistorySparkline).data == []
        # The current figures stay; only the history went.
        assert plain(app.query_one("#running-count", Label)) == str(app.stats.num_running)
        await fed(app, source, pilot, busy_stats())
        assert app.query_one("#running-spark", HistorySparkline).data == [2.0]


async def test_status_line_follows_the_connection(source: ScriptedStatsSource) -> None:
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        status = app.query_one(ConnectionStatus)
        assert app.connection.status == "connecting"
        await fed(app, source, pilot, Connected(url=URL), busy_stats())
        await fed(app, source, pilot, Disconnected(url=URL, reason="connection refused"))
        assert app.connection.status == "disconnected"
        assert status.render().plain.startswith(" ● disconnected  ws://")
        assert status.render().plain.endswith("connection refused")
        assert app.query_one("#panels").has_class("-stale")
        # The last figures stay on screen while the server is away.
        assert plain(app.query_one("#running-count", Label)) == "2"

        await fed(app, source, pilot, Reconnecting(url=URL, delay_s=2.7, attempt=1))
        line = status.render().plain
        assert "reconnecting in 3 s" in line and line.endswith("connection refused")
        await fed(app, source, pilot, Reconnecting(url=URL, delay_s=2.0, attempt=1))
        assert "reconnecting in 2 s" in status.render().plain
        await fed(app, source, pilot, Connecting(url=URL, attempt=1), Connected(url=URL))
        assert app.connection.status == "connected"
        assert not app.query_one("#panels").has_class("-stale")


async def test_a_source_that_ends_or_fails_leaves_the_app_running() -> None:
    class Broken:
        url = URL

        async def _events(self) -> AsyncIterator[SourceEvent]:
            yield Connected(url=URL)
            raise RuntimeError("boom")

        def __aiter__(self) -> AsyncIterator[SourceEvent]:
            return self._events()

    app = MonitorApp(Broken())
    async with app.run_test(size=SIZE) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.connection.status == "disconnected"
        assert "boom" in app.connection.reason
        assert app.is_running

    source = ScriptedStatsSource([Connected(url=URL)], url=URL)
    source.close()
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.connection == app.connection.__class__(
            status="disconnected", url=URL, reason="stream ended"
        )


async def test_quit_key_exits(source: ScriptedStatsSource) -> None:
    app = MonitorApp(source, title="my monitor")
    async with app.run_test(size=SIZE) as pilot:
        assert app.title == "my monitor"
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running


def test_block_colours_cover_every_state() -> None:
    assert set(BLOCK_COLORS) == {".", "c", "u", "s"}


# -- end to end: the real server and engine (fixtures from conftest.py) ------------------
async def test_dashboard_follows_a_real_server(server) -> None:
    """The app, on a live WebSocketStatsSource, shows what a real engine reports."""
    source = WebSocketStatsSource(server.url, interval=0.05, backoff_initial=0.05)
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        async with asyncio.timeout(10 * UNIT):
            while app.snapshots_received < 2:
                await asyncio.sleep(0.02)
        assert app.connection.status == "connected"
        first = app.stats
        assert first is not None and first.healthy

        async with connect(server.url) as ws:
            generate = {
                "type": "generate",
                "request_id": "e2e",
                "prompt": "Hello there",
                "params": {"temperature": 0, "max_tokens": 8, "ignore_eos": True},
            }
            await ws.send(json.dumps(generate))
            async with asyncio.timeout(10 * UNIT):
                while json.loads(await ws.recv())["type"] != "done":
                    pass

        async with asyncio.timeout(10 * UNIT):
            while app.stats is None or app.stats.generation_tokens_total < 8:
                await asyncio.sleep(0.02)
        await pilot.pause()
        stats = app.stats
        assert stats.prompt_tokens_total > first.prompt_tokens_total
        assert stats.kv_blocks_total > 0 and len(stats.kv_block_map) > 0
        assert app.query_one(BlockMap).block_map == stats.kv_block_map
        total = app.query_one("#generation-total", Label)
        assert f"total {fmt_compact(stats.generation_tokens_total)}" in plain(total)
        assert plain(app.query_one("#running-count", Label)) == fmt_count(stats.num_running)
        status = app.query_one(ConnectionStatus).render().plain
        assert "connected" in status and server.url in status
        if stats.model:
            assert stats.model in status


# -- snapshots ---------------------------------------------------------------------------
def _snapshot_app(events: list[SourceEvent]) -> tuple[MonitorApp, Callable]:
    source = ScriptedStatsSource(events, url=URL)

    async def run_before(pilot) -> None:
        await source.wait_consumed()
        await pilot.pause()

    return MonitorApp(source), run_before


def test_snapshot_idle_cpu(snap_compare) -> None:
    app, run_before = _snapshot_app([Connected(url=URL), idle_cpu_stats()])
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_snapshot_busy_gpu(snap_compare) -> None:
    app, run_before = _snapshot_app([Connected(url=URL), *demo_frames(96)])
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_snapshot_disconnected(snap_compare) -> None:
    frames = demo_frames(40)
    events: list[SourceEvent] = [
        Connected(url=URL),
        *frames,
        Disconnected(url=URL, reason="server closed the connection (1001)"),
        Reconnecting(url=URL, delay_s=4.0, attempt=3),
    ]
    app, run_before = _snapshot_app(events)
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
