"""Drawing primitives of the dashboard: history sparklines, stacked bars, the block map.

Each widget holds what it shows in reactive attributes and renders it to fit its size;
none knows about `EngineStats` (the panels in `panels.py` translate). Number formatting
lives here too, so every panel speaks the same units.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.style import Style
from rich.text import Text
from textual.app import RenderResult
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Sparkline

from asyncengine.stats_schema import BLOCK_CACHED, BLOCK_FREE, BLOCK_SHARED, BLOCK_USED

# Block-state colours, shared by the stacked bar, the block map and their legends.
BLOCK_COLORS: dict[str, str] = {
    BLOCK_USED: "#3fb950",
    BLOCK_SHARED: "#bc8cff",
    BLOCK_CACHED: "#388bfd",
    BLOCK_FREE: "#2d333b",
}
BLOCK_LABELS: dict[str, str] = {
    BLOCK_USED: "used",
    BLOCK_SHARED: "shared",
    BLOCK_CACHED: "cached",
    BLOCK_FREE: "free",
}
# When one cell stands for several blocks, the rarer, more telling state wins a tie.
_BLOCK_PRIORITY = (BLOCK_SHARED, BLOCK_USED, BLOCK_CACHED, BLOCK_FREE)
_EIGHTHS = " ▁▂▃▄▅▆▇█"


# -- formatting --------------------------------------------------------------------------
def fmt_count(n: float) -> str:
    """1234567 -> '1,234,567'."""
    return f"{n:,.0f}"


def fmt_rate(rate: float) -> str:
    """Tokens per second for big digits: '12,345', or '12.5' below 100."""
    return f"{rate:,.1f}" if 0 < rate < 100 else f"{rate:,.0f}"


def fmt_compact(n: float) -> str:
    """1234 -> '1.2k', 5_600_000 -> '5.6M'."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def fmt_latency(seconds: float, count: int = 1) -> str:
    """0.0213 -> '21.3 ms', 1.5 -> '1.50 s'; '—' when there is nothing measured yet."""
    if count == 0:
        return "—"
    if seconds < 0.001:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 0.1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 1.0:
        return f"{seconds * 1e3:.0f} ms"
    return f"{seconds:.2f} s"


def fmt_age(seconds: float) -> str:
    """Request age: '7.2 s', '3m 04s', '1h 02m'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def fmt_gib(num_bytes: int) -> str:
    """Bytes as GiB with one decimal."""
    return f"{num_bytes / 2**30:.1f}"


def level_color(fraction: float) -> str:
    """Green, amber or red for how full something is."""
    if fraction >= 0.9:
        return "#f85149"
    if fraction >= 0.7:
        return "#d29922"
    return "#3fb950"


def split_cells(counts: Sequence[int], width: int) -> list[int]:
    """Share `width` cells among `counts` in proportion (largest remainder), so that
    every non-zero count gets at least one cell when there is room."""
    total = sum(counts)
    if total <= 0 or width <= 0:
        return [0] * len(counts)
    exact = [c * width / total for c in counts]
    cells = [math.floor(x) for x in exact]
    order = sorted(range(len(counts)), key=lambda i: exact[i] - cells[i], reverse=True)
    for i in order[: width - sum(cells)]:
        cells[i] += 1
    # Lend one cell to visible-but-tiny segments from the largest one.
    for i, count in enumerate(counts):
        if count > 0 and cells[i] == 0:
            donor = max(range(len(cells)), key=cells.__getitem__)
            if cells[donor] > 1:
                cells[donor] -= 1
                cells[i] = 1
    return cells


def downsample_block_map(block_map: str, cells: int) -> tuple[str, int]:
    """Fit a block map into `cells` cells: each cell shows the commonest state of the
    `per_cell` blocks it stands for. Returns (map, per_cell)."""
    n = len(block_map)
    if n <= cells or cells <= 0:
        return block_map, 1
    per_cell = math.ceil(n / cells)
    out = []
    for start in range(0, n, per_cell):
        chunk = block_map[start : start + per_cell]
        out.append(max(_BLOCK_PRIORITY, key=lambda s, c=chunk: (c.count(s), -_rank(s))))
    return "".join(out), per_cell


def _rank(state: str) -> int:
    return _BLOCK_PRIORITY.index(state) if state in _BLOCK_PRIORITY else len(_BLOCK_PRIORITY)


# -- widgets -----------------------------------------------------------------------------
class HistorySparkline(Sparkline):
    """A sparkline for time series: newest sample at the right, bars from zero.

    Textual's sparkline stretches short series over the whole width and scales from the
    series' minimum; a monitor wants the history to scroll in from the right and a flat
    line to mean "steady", not "maximal". `floor` is the smallest full-scale value, so
    noise around zero stays low.
    """

    floor: reactive[float] = reactive(1.0)

    def render(self) -> RenderResult:
        width, height = self.size.width, max(1, self.size.height)
        values = list(self.data or ())[-width:] if width else []
        _, base = self.background_colors
        low = base + self.get_component_styles("sparkline--min-color").color
        high = base + self.get_component_styles("sparkline--max-color").color
        peak = max([self.floor, *values])
        steps = height * 8
        levels = [round(max(0.0, v) / peak * steps) for v in values]
        pad = width - len(values)
        text = Text(no_wrap=True, overflow="crop")
        for row in range(height - 1, -1, -1):
            if pad:
                text.append(" " * pad)
            for value, level in zip(values, levels, strict=True):
                part = min(8, max(0, level - row * 8))
                if row == 0 and part == 0:
                    part = 1  # a baseline tick, so an idle history is still visible
                colour = low.blend(high, max(0.0, value) / peak)
                text.append(_EIGHTHS[part], style=Style(color=colour.rich_color))
            if row:
                text.append("\n")
        return text


class StackedBar(Widget):
    """A one-line bar of coloured segments: `segments` is ((count, colour), ...)."""

    DEFAULT_CSS = """
    StackedBar { height: 1; }
    """

    segments: reactive[tuple[tuple[int, str], ...]] = reactive(())

    def render(self) -> RenderResult:
        width = self.size.width
        counts = [count for count, _ in self.segments]
        text = Text(no_wrap=True, overflow="crop")
        if sum(counts) <= 0:
            return Text("─" * width, style="#444c56")
        for cells, (_, colour) in zip(split_cells(counts, width), self.segments, strict=True):
            text.append("█" * cells, style=colour)
        return text


class Meter(Widget):
    """A labelled gauge on two lines: "label ........ value" over a coloured bar."""

    DEFAULT_CSS = """
    Meter { height: 2; }
    """

    label: reactive[str] = reactive("")
    value_text: reactive[str] = reactive("")
    fraction: reactive[float | None] = reactive[float | None](None)

    def __init__(self, label: str = "", *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.set_reactive(Meter.label, label)

    def render(self) -> RenderResult:
        width = self.size.width
        head = Text(no_wrap=True, overflow="ellipsis")
        head.append(self.label, style="bold")
        value = self.value_text or "n/a"
        head.append(" " * max(1, width - len(self.label) - len(value)))
        head.append(value, style="bold" if self.fraction is not None else "dim")
        bar = Text(no_wrap=True)
        if self.fraction is None:
            bar.append("╌" * width, style="#444c56")
        else:
            fraction = min(1.0, max(0.0, self.fraction))
            filled = round(fraction * width)
            bar.append("━" * filled, style=level_color(fraction))
            bar.append("━" * (width - filled), style="#2d333b")
        lines = Text("\n").join([head, bar])
        lines.no_wrap = True
        return lines


class BlockMap(Widget):
    """The KV block pool as a picture: one half-cell per block, coloured by state.

    Blocks run left to right, top to bottom, two block-rows per terminal row (upper and
    lower half blocks), so runs of used blocks, holes left by finished requests and the
    shared prefix blocks can be seen at a glance. A pool bigger than the widget is
    downsampled (`per_cell` blocks per half-cell).
    """

    block_map: reactive[str] = reactive("")
    blocks_per_cell: reactive[int] = reactive(1)
    """How many blocks one half-cell stands for at the current size (kept up to date)."""

    def _update_scale(self) -> None:
        capacity = self.size.width * self.size.height * 2
        if capacity:
            self.blocks_per_cell = max(1, math.ceil(len(self.block_map) / capacity))

    def watch_block_map(self) -> None:
        self._update_scale()

    def on_resize(self) -> None:
        self._update_scale()

    def render(self) -> RenderResult:
        width, height = self.size.width, self.size.height
        if not width or not height:
            return ""
        if not self.block_map:
            return Text("no KV cache yet", style="dim")
        cells, _ = downsample_block_map(self.block_map, width * height * 2)
        rows = math.ceil(len(cells) / width)
        text = Text(no_wrap=True, overflow="crop")
        for row in range(0, rows, 2):
            top = cells[row * width : (row + 1) * width]
            bottom = cells[(row + 1) * width : (row + 2) * width]
            for col, state in enumerate(top):
                upper = BLOCK_COLORS.get(state, BLOCK_COLORS[BLOCK_FREE])
                if col < len(bottom):
                    lower = BLOCK_COLORS.get(bottom[col], BLOCK_COLORS[BLOCK_FREE])
                    text.append("▀", style=Style(color=upper, bgcolor=lower))
                else:
                    text.append("▀", style=Style(color=upper))
            if row + 2 < rows:
                text.append("\n")
        return text


def legend(items: Sequence[tuple[str, str, str]]) -> Text:
    """A one-line legend: ((colour, label, value), ...) as '■ label value'."""
    text = Text(no_wrap=True, overflow="ellipsis")
    for i, (colour, label, value) in enumerate(items):
        if i:
            text.append("   ")
        text.append("■ ", style=colour)
        text.append(f"{label} ", style="dim")
        text.append(value, style="bold")
    return text
