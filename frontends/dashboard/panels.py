"""The dashboard's panels: each turns an `EngineStats` (plus history) into its widgets.

Every panel has `show(stats, history)`, called by the app whenever the displayed snapshot
changes; panels keep what they show in their widgets' reactive attributes, so a repeat of
the same figures costs no repaint. Layout and colours are in dashboard.tcss.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Digits, Label, Static

from asyncengine.stats_schema import (
    BLOCK_CACHED,
    BLOCK_FREE,
    BLOCK_SHARED,
    BLOCK_USED,
    EngineStats,
    LatencySummary,
    RequestStats,
)

from .history import StatsHistory
from .widgets import (
    BLOCK_COLORS,
    BlockMap,
    HistorySparkline,
    Meter,
    StackedBar,
    fmt_age,
    fmt_compact,
    fmt_count,
    fmt_gib,
    fmt_latency,
    fmt_rate,
    legend,
)

STATE_STYLES = {"running": "#3fb950", "waiting": "#d29922", "swapped": "#bc8cff"}


def fmt_request_rate(request: RequestStats) -> str:
    """A running request's decode rate ('—' before its second token or when not running)."""
    rate = request.tokens_per_s
    if request.state != "running" or rate is None:
        return "—"
    return f"{rate:.1f}"


class Panel(Vertical):
    """A bordered, titled box; subclasses fill and update it."""

    TITLE = ""

    def on_mount(self) -> None:
        self.border_title = self.TITLE

    def show(self, stats: EngineStats, history: StatsHistory) -> None:
        raise NotImplementedError


class ThroughputPanel(Panel):
    """Prompt and generation tokens/s in big digits over their history."""

    TITLE = "Throughput"

    def compose(self) -> ComposeResult:
        with Horizontal():
            for name, caption in (
                ("prompt", "prompt tokens/s"),
                ("generation", "generation tokens/s"),
            ):
                with Vertical(classes="rate", id=f"{name}-rate"):
                    yield Label(caption, classes="caption")
                    yield Digits("0", id=f"{name}-digits")
                    yield HistorySparkline(id=f"{name}-spark")
                    yield Label("", id=f"{name}-total", classes="caption")

    def show(self, stats: EngineStats, history: StatsHistory) -> None:
        for name, rate, total, series in (
            ("prompt", stats.prompt_tokens_per_s, stats.prompt_tokens_total, "prompt_tps"),
            (
                "generation",
                stats.generation_tokens_per_s,
                stats.generation_tokens_total,
                "generation_tps",
            ),
        ):
            self.query_one(f"#{name}-digits", Digits).update(fmt_rate(rate))
            spark = self.query_one(f"#{name}-spark", HistorySparkline)
            spark.floor = 50.0
            spark.data = history[series]
            peak = max(history[series], default=0.0)
            caption = Text(no_wrap=True, overflow="ellipsis")
            caption.append("total ", style="dim")
            caption.append(fmt_compact(total), style="bold")
            caption.append("  peak ", style="dim")
            caption.append(fmt_compact(peak), style="bold")
            self.query_one(f"#{name}-total", Label).update(caption)


class QueuePanel(Panel):
    """Running, waiting and swapped counts with their history."""

    TITLE = "Queue"

    def compose(self) -> ComposeResult:
        for state in ("running", "waiting", "swapped"):
            with Horizontal(classes="queue-row", id=f"queue-{state}"):
                yield Label(state, classes=f"queue-label {state}")
                yield Label("0", classes="queue-count", id=f"{state}-count")
                yield HistorySparkline(classes=state, id=f"{state}-spark")
        yield Label("", id="queue-summary", classes="caption")

    def show(self, stats: EngineStats, history: StatsHistory) -> None:
        for state, count in (
            ("running", stats.num_running),
            ("waiting", stats.num_waiting),
            ("swapped", stats.num_swapped),
        ):
            self.query_one(f"#{state}-count", Label).update(fmt_count(count))
            self.query_one(f"#{state}-spark", HistorySparkline).data = history[state]
        summary = Text()
        summary.append("finished ", style="dim")
        summary.append(fmt_count(stats.num_requests_finished), style="bold")
        summary.append("   aborted ", style="dim")
        summary.append(fmt_count(stats.num_requests_aborted), style="bold")
        self.query_one("#queue-summary", Label).update(summary)


class DevicePanel(Panel):
    """GPU memory, utilisation and power; or CPU load and RAM when serving on the CPU."""

    TITLE = "Device"

    def compose(self) -> ComposeResult:
        yield Label("", id="device-name")
        yield Meter("memory", id="device-memory")
        yield Meter("utilisation", id="device-util")
        yield Label("", id="device-extra", classes="caption")

    def show(self, stats: EngineStats, history: StatsHistory) -> None:
        device = stats.device
        gpu = device.kind == "cuda"
        name = Text()
        name.append(device.name or ("GPU" if gpu else "CPU"), style="bold")
        name.append(f"  {device.kind}", style="dim")
        self.query_one("#device-name", Label).update(name)

        memory = self.query_one("#device-memory", Meter)
        memory.label = "memory" if gpu else "RAM"
        if device.memory_total_bytes:
            memory.fraction = device.memory_used_bytes / device.memory_total_bytes
            memory.value_text = (
                f"{fmt_gib(device.memory_used_bytes)}/{fmt_gib(device.memory_total_bytes)} GiB"
            )
        else:
            memory.fraction, memory.value_text = None, ""

        util = self.query_one("#device-util", Meter)
        util.label = "utilisation" if gpu else "CPU load"
        if device.utilization_percent is None:
            util.fraction, util.value_text = None, ""
        else:
            util.fraction = device.utilization_percent / 100
            util.value_text = f"{device.utilization_percent:.0f} %"

        extra = Text()
        if device.power_watts is not None:
            extra.append("power ", style="dim")
            extra.append(f"{device.power_watts:.0f} W", style="bold")
        if device.temperature_c is not None:
            extra.append("   temp ", style="dim")
            extra.append(f"{device.temperature_c:.0f} °C", style="bold")
        self.query_one("#device-extra", Label).update(extra)


class KVCachePanel(Panel):
    """Block usage as a stacked bar, the block pool as a picture, prefix-cache figures; the
    subtitle gives the pool's size and the KV element type (e.g. "KV fp8_e4m3")."""

    TITLE = "KV cache"

    def compose(self) -> ComposeResult:
        yield StackedBar(id="kv-bar")
        yield Label("", id="kv-legend")
        yield BlockMap(id="kv-map")
        yield Label("", id="kv-events")

    def on_mount(self) -> None:
        super().on_mount()
        self._pool = (0, 16, "")  # (blocks, tokens per block, KV dtype) of the last snapshot
        self.watch(self.query_one(BlockMap), "blocks_per_cell", self._update_subtitle)

    def _update_subtitle(self) -> None:
        total, block_size, kv_dtype = self._pool
        if not total:
            self.border_subtitle = ""
            return
        per_cell = self.query_one(BlockMap).blocks_per_cell
        scale = "1 block" if per_cell == 1 else f"{per_cell} blocks"
        dtype = f" · KV {kv_dtype}" if kv_dtype else ""
        self.border_subtitle = (
            f"{fmt_count(total)} blocks × {block_size} tokens{dtype} · ▀ = {scale}"
        )

    def show(self, stats: EngineStats, history: StatsHistory) -> None:
        total = stats.kv_blocks_total
        block_map = stats.kv_block_map
        # The map may be downsampled; scale its share of shared blocks to the pool.
        shared = round(block_map.count(BLOCK_SHARED) / len(block_map) * total) if block_map else 0
        used = stats.kv_blocks_used
        shared = min(shared, used)
        cached = stats.kv_blocks_cached
        free = max(0, total - used - cached)
        self.query_one("#kv-bar", StackedBar).segments = (
            (used - shared, BLOCK_COLORS[BLOCK_USED]),
            (shared, BLOCK_COLORS[BLOCK_SHARED]),
            (cached, BLOCK_COLORS[BLOCK_CACHED]),
            (free, BLOCK_COLORS[BLOCK_FREE]),
        )
        pct = f" ({used / total:.0%})" if total else ""
        self.query_one("#kv-legend", Label).update(
            legend(
                [
                    (BLOCK_COLORS[BLOCK_USED], "used", f"{fmt_count(used)}{pct}"),
                    (BLOCK_COLORS[BLOCK_SHARED], "shared", fmt_count(shared)),
                    (BLOCK_COLORS[BLOCK_CACHED], "cached", fmt_count(cached)),
                    (BLOCK_COLORS[BLOCK_FREE], "free", fmt_count(free)),
                ]
            )
        )
        self.query_one("#kv-map", BlockMap).block_map = block_map
        self._pool = (total, stats.kv_block_size, stats.kv_cache_dtype)
        self._update_subtitle()

        events = Text(no_wrap=True, overflow="ellipsis")
        events.append("prefix hits ", style="dim")
        events.append(f"{stats.prefix_cache_hit_rate:.1%}", style="bold #388bfd")
        events.append(
            f" ({fmt_count(stats.prefix_cache_hits)}/{fmt_count(stats.prefix_cache_queries)})",
            style="dim",
        )
        events.append("   preemptions ", style="dim")
        events.append(fmt_count(stats.num_preemptions), style="bold")
        events.append("   swaps out/in ", style="dim")
        events.append(
            f"{fmt_count(stats.num_swaps_out)}/{fmt_count(stats.num_swaps_in)}", style="bold"
        )
        spec = stats.spec_decode
        if spec is not None:
            events.append("   spec accepted ", style="dim")
            events.append(f"{spec.acceptance_rate:.0%}", style="bold #3fb950")
            events.append(f" (mean length {spec.mean_acceptance_length:.2f})", style="dim")
        self.query_one("#kv-events", Label).update(events)


def latency_table(ttft: LatencySummary, itl: LatencySummary) -> Table:
    """TTFT and ITL percentiles as a small table."""
    table = Table(box=None, expand=True, pad_edge=False, show_edge=False)
    table.add_column("", style="bold", no_wrap=True)
    for heading in ("p50", "p90", "p99"):
        table.add_column(heading, justify="right", header_style="dim", no_wrap=True)
    for name, summary in (("TTFT", ttft), ("ITL", itl)):
        table.add_row(
            name,
            fmt_latency(summary.p50, summary.count),
            fmt_latency(summary.p90, summary.count),
            Text(fmt_latency(summary.p99, summary.count), style="#d29922"),
        )
    return table


class LatencyPanel(Panel):
    """Time to first token and inter-token latency percentiles."""

    TITLE = "Latency"

    def compose(self) -> ComposeResult:
        yield Static(latency_table(LatencySummary(), LatencySummary()), id="latency-table")
        yield Label("", id="latency-counts", classes="caption")
        yield Meter("KV cache usage", id="kv-usage")
        yield HistorySparkline(id="kv-usage-spark")

    def show(self, stats: EngineStats, history: StatsHistory) -> None:
        self.query_one("#latency-table", Static).update(latency_table(stats.ttft, stats.itl))
        counts = Text(no_wrap=True, overflow="ellipsis")
        counts.append("over ", style="dim")
        counts.append(fmt_compact(stats.ttft.count), style="bold")
        counts.append(" requests, ", style="dim")
        counts.append(fmt_compact(stats.itl.count), style="bold")
        counts.append(" tokens", style="dim")
        self.query_one("#latency-counts", Label).update(counts)
        total = stats.kv_blocks_total
        usage = self.query_one("#kv-usage", Meter)
        usage.fraction = stats.kv_blocks_used / total if total else None
        usage.value_text = f"{stats.kv_blocks_used / total:.1%}" if total else ""
        if total and stats.kv_blocks_reserved:
            # Free but spoken for: why requests can wait while the pool is not full.
            usage.value_text += f" + {stats.kv_blocks_reserved / total:.0%} kept for growth"
        spark = self.query_one("#kv-usage-spark", HistorySparkline)
        spark.floor = 1.0
        spark.data = history["kv_usage"]


class RequestTable(DataTable[Text | str]):
    """In-flight requests, one row per request id, updated cell by cell."""

    COLUMNS = (
        ("request", "request"),
        ("state", "state"),
        ("prompt", "prompt"),
        ("generated", "generated"),
        ("tok/s", "tps"),
        ("age", "age"),
    )

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="none", zebra_stripes=True, show_cursor=False)
        self._shown: dict[str, tuple[Text | str, ...]] = {}

    def on_mount(self) -> None:
        widths = {"request": 30, "state": 10}
        for label, key in self.COLUMNS:
            numeric = key not in widths
            header = Text(label, justify="right" if numeric else "left")
            self.add_column(header, key=key, width=widths.get(key, 13))

    @staticmethod
    def cells(request: RequestStats) -> tuple[Text | str, ...]:
        """The row's cells for one request."""
        right = "right"
        return (
            request.request_id,
            Text(request.state, style=STATE_STYLES.get(request.state, "")),
            Text(fmt_count(request.prompt_tokens), justify=right),
            Text(fmt_count(request.generated_tokens), justify=right),
            Text(fmt_request_rate(request), justify=right),
            Text(fmt_age(request.age_s), justify=right),
        )

    def sync(self, requests: list[RequestStats]) -> None:
        """Make the rows match `requests`: add new ids, drop gone ones, update changed cells."""
        wanted = {r.request_id: r for r in requests}
        for key in [k for k in self._shown if k not in wanted]:
            self.remove_row(key)
            del self._shown[key]
        for request_id, request in wanted.items():
            cells = self.cells(request)
            old = self._shown.get(request_id)
            if old is None:
                self.add_row(*cells, key=request_id)
            else:
                for (_, column), new, was in zip(self.COLUMNS, cells, old, strict=True):
                    if new != was:
                        self.update_cell(request_id, column, new)
            self._shown[request_id] = cells


class RequestsPanel(Panel):
    """The table of in-flight requests."""

    TITLE = "Requests"

    def compose(self) -> ComposeResult:
        yield RequestTable(id="requests-table")

    def show(self, stats: EngineStats, history: StatsHistory) -> None:
        self.query_one(RequestTable).sync(stats.requests)
        self.border_subtitle = (
            f"{stats.num_running} running · {stats.num_waiting} waiting · "
            f"{stats.num_swapped} swapped"
        )
