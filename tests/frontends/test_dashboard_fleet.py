"""The fleet dashboard: totals of several replicas, the source that follows them all over
real WebSockets, the table of replicas in the app, and its snapshot."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

import msgspec
import pytest
from textual.widgets import Label
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from asyncengine.stats_schema import DeviceStats, EngineStats, LatencySummary
from frontends.dashboard import Connected, FleetStats, MonitorApp, ScriptedStatsSource
from frontends.dashboard.demo import demo_frames
from frontends.dashboard.fleet import (
    FleetStatsSource,
    FleetTable,
    ReplicaState,
    aggregate,
    fleet_label,
)

from .test_dashboard import SIZE, _free_port, fed, plain

UNIT = 1.0
URLS = ["ws://10.0.0.1:8765", "ws://10.0.0.2:8765", "ws://10.0.0.3:8765"]


def replica_stats(running: int, waiting: int, used: int, hits: int, queries: int,
                  tps: float, p99: float) -> EngineStats:
    return EngineStats(
        num_running=running, num_waiting=waiting, kv_blocks_total=100, kv_blocks_used=used,
        kv_blocks_cached=5, kv_block_map="u" * 4 + "." * 4, prefix_cache_hits=hits,
        prefix_cache_queries=queries, prefix_cache_hit_rate=hits / queries,
        generation_tokens_per_s=tps, prompt_tokens_per_s=2 * tps,
        generation_tokens_total=1000, num_requests_finished=10,
        ttft=LatencySummary(p50=p99 / 4, p90=p99 / 2, p99=p99, count=10),
        device=DeviceStats(kind="cuda", name="NVIDIA H200", memory_used_bytes=10,
                           memory_total_bytes=100, utilization_percent=50.0),
        model="tiny")


def test_aggregate_sums_and_keeps_the_worst_latency() -> None:
    a = replica_stats(3, 1, 40, 30, 100, 500.0, 0.2)
    b = replica_stats(1, 0, 10, 10, 300, 250.0, 0.9)
    total = aggregate([a, b])
    assert (total.num_running, total.num_waiting) == (4, 1)
    assert (total.kv_blocks_total, total.kv_blocks_used, total.kv_blocks_cached) == (200, 50, 10)
    assert total.prefix_cache_hit_rate == pytest.approx(40 / 400)  # by tokens, not averaged
    assert total.generation_tokens_per_s == 750.0 and total.generation_tokens_total == 2000
    assert total.ttft.p99 == 0.9 and total.ttft.count == 20
    assert total.kv_block_map == a.kv_block_map + b.kv_block_map
    assert total.device.name == "2× NVIDIA H200" and total.device.memory_total_bytes == 200
    assert total.model == "tiny" and total.healthy
    assert not aggregate([]).healthy


# ------------------------------------------------------------------ the live source
async def test_source_follows_every_replica() -> None:
    """Two replicas that answer and one that does not: the fleet is connected, the dead
    one is shown as such, and the totals are the live ones'."""

    def handler_for(stats: EngineStats) -> Callable[[ServerConnection], object]:
        async def handler(ws: ServerConnection) -> None:
            await ws.recv()  # the subscription
            event = {"type": "stats", "stats": msgspec.to_builtins(stats)}
            with contextlib.suppress(ConnectionClosed):
                while True:
                    await ws.send(json.dumps(event))
                    await asyncio.sleep(0.02)

        return handler

    a = replica_stats(3, 1, 40, 30, 100, 500.0, 0.2)
    b = replica_stats(1, 0, 10, 10, 300, 250.0, 0.9)
    async with serve(handler_for(a), "127.0.0.1", 0) as sa, \
            serve(handler_for(b), "127.0.0.1", 0) as sb:
        urls = [f"ws://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in (sa, sb)]
        urls.append(f"ws://127.0.0.1:{_free_port()}")  # nobody there
        source = FleetStatsSource(urls, interval=0.02, backoff_initial=0.05)
        assert source.url == fleet_label(urls)
        events: list[object] = []
        async with asyncio.timeout(10 * UNIT):
            async for event in source:
                events.append(event)
                fleets = [e for e in events if isinstance(e, FleetStats)]
                if isinstance(event, EngineStats) and event.num_running == 4 \
                        and fleets[-1].replicas[2].status != "connecting":
                    break
    assert any(isinstance(e, Connected) and e.url == source.url for e in events)
    last_fleet = [e for e in events if isinstance(e, FleetStats)][-1]
    assert last_fleet.replicas[2].status in ("disconnected", "reconnecting")
    assert last_fleet.replicas[2].stats is None
    totals = [e for e in events if isinstance(e, EngineStats)][-1]
    assert totals.num_running == 4 and totals.generation_tokens_per_s == 750.0


# ------------------------------------------------------------------ the app
def fleet_events() -> list[object]:
    one, two = demo_frames(60, seed=1)[-1], demo_frames(60, seed=2)[-1]
    replicas = [ReplicaState(url=URLS[0], status="connected", stats=one),
                ReplicaState(url=URLS[1], status="connected", stats=two),
                ReplicaState(url=URLS[2], status="reconnecting",
                             reason="connection refused")]
    return [Connected(url=fleet_label(URLS)), FleetStats(replicas=replicas),
            aggregate([one, two])]


async def test_app_shows_one_row_per_replica_and_the_totals() -> None:
    source = ScriptedStatsSource(url=fleet_label(URLS))
    app = MonitorApp(source, fleet=True)
    async with app.run_test(size=SIZE) as pilot:
        events = fleet_events()
        await fed(app, source, pilot, *events)  # type: ignore[arg-type]
        table = app.query_one(FleetTable)
        assert table.row_count == 4
        rows = [[c.plain if hasattr(c, "plain") else str(c) for c in table.get_row_at(i)]
                for i in range(4)]
        fleet, totals = events[1], events[2]
        assert [r[0] for r in rows] == [*URLS, "total"]
        assert [r[1] for r in rows] == ["connected", "connected", "reconnecting", "2/3 up"]
        first = fleet.replicas[0].stats  # type: ignore[attr-defined]
        assert rows[0][2] == str(first.num_running) and rows[0][3] == str(first.num_waiting)
        assert rows[0][5] == f"{first.prefix_cache_hit_rate:.1%}"
        assert rows[2][2:] == ["—"] * 5
        assert rows[3][2] == str(totals.num_running)  # type: ignore[attr-defined]
        # The usual panels show the totals.
        assert plain(app.query_one("#running-count", Label)) == str(totals.num_running)  # type: ignore[attr-defined]
        assert "2 of 3 replicas connected" in app.query_one("#fleet").border_subtitle
        assert not app.query("#requests")


def test_snapshot_fleet(snap_compare) -> None:
    source = ScriptedStatsSource(fleet_events(), url=fleet_label(URLS))  # type: ignore[arg-type]

    async def run_before(pilot) -> None:
        await source.wait_consumed()
        await pilot.pause()

    app = MonitorApp(source, fleet=True, title="asyncengine fleet")
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
