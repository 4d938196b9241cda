"""The dashboard of a fleet: several replicas' stats merged, and one row per replica.

`FleetStatsSource` follows every replica's WebSocket (a `WebSocketStatsSource` each) and
yields, whenever one of them reports, a `FleetStats` (each replica's connection state and
latest snapshot) followed by the fleet's totals as one `EngineStats` (`aggregate`), which
the usual panels draw. It is `connected` while any replica is. `FleetPanel` is the table:
state, running, waiting, KV use, prefix-cache hit rate and generation tok/s per replica,
then the totals.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import msgspec
from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable

from asyncengine.stats_schema import DeviceStats, EngineStats, LatencySummary

from .panels import Panel
from .sources import Connected, Connecting, Disconnected, Reconnecting, WebSocketStatsSource
from .widgets import fmt_count, fmt_rate

__all__ = ["FleetPanel", "FleetStats", "FleetStatsSource", "ReplicaState", "aggregate"]


class ReplicaState(msgspec.Struct, kw_only=True):
    """One replica as the fleet table shows it."""

    url: str
    status: str = "connecting"  # connecting | connected | reconnecting | disconnected
    reason: str = ""
    stats: EngineStats | None = None


class FleetStats(msgspec.Struct, kw_only=True):
    """Every replica's state, in the order the fleet lists them."""

    replicas: list[ReplicaState]


def _worst(summaries: Sequence[LatencySummary]) -> LatencySummary:
    """Percentiles cannot be merged from summaries: the fleet's are its worst replica's."""
    counted = [s for s in summaries if s.count]
    if not counted:
        return LatencySummary()
    return LatencySummary(p50=max(s.p50 for s in counted), p90=max(s.p90 for s in counted),
                          p99=max(s.p99 for s in counted),
                          count=sum(s.count for s in counted))


def _device(devices: Sequence[DeviceStats]) -> DeviceStats:
    first = devices[0]
    if first.kind != "cuda":
        return first  # CPU replicas share one host: its figures, once
    names = sorted({d.name for d in devices})
    utils = [d.utilization_percent for d in devices if d.utilization_percent is not None]
    powers = [d.power_watts for d in devices if d.power_watts is not None]
    return DeviceStats(
        kind="cuda", name=f"{len(devices)}× {' / '.join(names)}",
        memory_used_bytes=sum(d.memory_used_bytes for d in devices),
        memory_total_bytes=sum(d.memory_total_bytes for d in devices),
        utilization_percent=sum(utils) / len(utils) if utils else None,
        power_watts=sum(powers) if powers else None,
        temperature_c=max((d.temperature_c for d in devices if d.temperature_c is not None),
                          default=None))


def aggregate(snapshots: Sequence[EngineStats]) -> EngineStats:
    """The fleet as one engine: counts, blocks, tokens and rates summed; the block maps
    side by side; the worst replica's latency percentiles."""
    if not snapshots:
        return EngineStats(healthy=False)
    queries = sum(s.prefix_cache_queries for s in snapshots)
    hits = sum(s.prefix_cache_hits for s in snapshots)

    def total(name: str) -> float:
        return sum(getattr(s, name) for s in snapshots)

    return EngineStats(
        timestamp=max(s.timestamp for s in snapshots),
        num_running=int(total("num_running")), num_waiting=int(total("num_waiting")),
        num_swapped=int(total("num_swapped")),
        kv_blocks_total=int(total("kv_blocks_total")),
        kv_blocks_used=int(total("kv_blocks_used")),
        kv_blocks_cached=int(total("kv_blocks_cached")),
        kv_block_size=snapshots[0].kv_block_size, kv_cache_dtype=snapshots[0].kv_cache_dtype,
        kv_block_map="".join(s.kv_block_map for s in snapshots),
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        prefix_cache_queries=queries, prefix_cache_hits=hits,
        num_preemptions=int(total("num_preemptions")),
        num_swaps_out=int(total("num_swaps_out")), num_swaps_in=int(total("num_swaps_in")),
        prompt_tokens_total=int(total("prompt_tokens_total")),
        generation_tokens_total=int(total("generation_tokens_total")),
        prompt_tokens_per_s=total("prompt_tokens_per_s"),
        generation_tokens_per_s=total("generation_tokens_per_s"),
        num_requests_finished=int(total("num_requests_finished")),
        num_requests_aborted=int(total("num_requests_aborted")),
        ttft=_worst([s.ttft for s in snapshots]), itl=_worst([s.itl for s in snapshots]),
        requests=[r for s in snapshots for r in s.requests],
        device=_device([s.device for s in snapshots]),
        model=next((s.model for s in snapshots if s.model), ""),
        healthy=all(s.healthy for s in snapshots),
    )


def fleet_label(urls: Sequence[str]) -> str:
    """The status line's name for a fleet (the table lists every URL)."""
    more = " …" if len(urls) > 1 else ""
    return f"fleet of {len(urls)} ({urls[0]}{more})"


class FleetStatsSource:
    """Stats of several servers at once, each followed (and reconnected) on its own."""

    def __init__(self, urls: Sequence[str], api_key: str | None = None,
                 interval: float = 1.0, **source_kwargs: object) -> None:
        if not urls:
            raise ValueError("a fleet needs at least one URL")
        self.urls = list(urls)
        self.url = fleet_label(self.urls)
        self._sources = [WebSocketStatsSource(u, api_key, interval, **source_kwargs)
                         for u in self.urls]  # type: ignore[arg-type]

    def __aiter__(self) -> AsyncIterator[object]:
        return self._events()

    async def _events(self) -> AsyncIterator[object]:
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

        async def follow(i: int, source: WebSocketStatsSource) -> None:
            async for event in source:
                await queue.put((i, event))

        tasks = [asyncio.create_task(follow(i, s)) for i, s in enumerate(self._sources)]
        replicas = [ReplicaState(url=u) for u in self.urls]
        connected = False
        try:
            yield Connecting(url=self.url)
            while True:
                i, event = await queue.get()
                replica = replicas[i]
                if isinstance(event, EngineStats):
                    replica.stats = event
                elif isinstance(event, Connected):
                    replica.status, replica.reason = "connected", ""
                elif isinstance(event, Disconnected):
                    replica.status, replica.reason = "disconnected", event.reason
                elif isinstance(event, Reconnecting):
                    replica.status = "reconnecting"
                elif isinstance(event, Connecting):
                    replica.status = "connecting" if replica.status != "reconnecting" \
                        else replica.status
                up = [r for r in replicas if r.status == "connected"]
                if up and not connected:
                    yield Connected(url=self.url)
                elif not up and connected:
                    yield Disconnected(url=self.url, reason="no replica answers")
                connected = bool(up)
                yield FleetStats(replicas=[msgspec.structs.replace(r) for r in replicas])
                if isinstance(event, EngineStats):
                    yield aggregate([r.stats for r in up if r.stats is not None])
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


_STATUS_STYLE = {"connected": "#3fb950", "connecting": "#d29922",
                 "reconnecting": "#d29922", "disconnected": "#f85149"}


class FleetTable(DataTable[Text | str]):
    """One row per replica, then the totals."""

    COLUMNS = (("replica", "replica"), ("state", "state"), ("running", "running"),
               ("waiting", "waiting"), ("KV use", "kv"), ("prefix hits", "hits"),
               ("gen tok/s", "tps"))

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="none", zebra_stripes=True, show_cursor=False)

    def on_mount(self) -> None:
        widths = {"replica": 34, "state": 14}
        for label, key in self.COLUMNS:
            numeric = key not in widths
            self.add_column(Text(label, justify="right" if numeric else "left"), key=key,
                            width=widths.get(key, 11))

    @staticmethod
    def cells(name: str, status: str, stats: EngineStats | None,
              bold: bool = False) -> tuple[Text | str, ...]:
        style = "bold" if bold else ""
        state = Text(status, style=_STATUS_STYLE.get(status, ""))
        if stats is None:
            return (Text(name, style=style), state, *(Text("—", justify="right"),) * 5)
        kv = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        figures = (fmt_count(stats.num_running), fmt_count(stats.num_waiting), f"{kv:.0%}",
                   f"{stats.prefix_cache_hit_rate:.1%}",
                   fmt_rate(stats.generation_tokens_per_s))
        return (Text(name, style=style), state,
                *(Text(f, justify="right", style=style) for f in figures))

    def show(self, fleet: FleetStats) -> None:
        self.clear()
        for replica in fleet.replicas:
            self.add_row(*self.cells(replica.url, replica.status, replica.stats))
        up = [r.stats for r in fleet.replicas if r.status == "connected" and r.stats]
        totals = aggregate(up) if up else None
        self.add_row(*self.cells("total", f"{len(up)}/{len(fleet.replicas)} up", totals,
                                 bold=True), key="total")


class FleetPanel(Panel):
    """The replicas of a fleet, one row each, beside the totals the other panels show."""

    TITLE = "Replicas"

    def compose(self) -> ComposeResult:
        yield FleetTable(id="fleet-table")

    def show_fleet(self, fleet: FleetStats) -> None:
        self.query_one(FleetTable).show(fleet)
        up = sum(r.status == "connected" for r in fleet.replicas)
        self.border_subtitle = f"{up} of {len(fleet.replicas)} replicas connected"

    def show(self, stats: EngineStats, history: object) -> None:
        """Totals arrive with each replica's report; `show_fleet` draws them."""
