"""Rolling history of the few figures the dashboard draws as sparklines."""

from __future__ import annotations

from collections import deque

from asyncengine.stats_schema import EngineStats

SERIES = ("running", "waiting", "swapped", "prompt_tps", "generation_tps", "kv_usage")


class StatsHistory:
    """The last `maxlen` values of each series in `SERIES`, oldest first."""

    def __init__(self, maxlen: int = 300) -> None:
        self.maxlen = maxlen
        self._series: dict[str, deque[float]] = {name: deque(maxlen=maxlen) for name in SERIES}

    def append(self, stats: EngineStats) -> None:
        """Record one snapshot."""
        total = stats.kv_blocks_total
        values = {
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "swapped": stats.num_swapped,
            "prompt_tps": stats.prompt_tokens_per_s,
            "generation_tps": stats.generation_tokens_per_s,
            "kv_usage": stats.kv_blocks_used / total if total else 0.0,
        }
        for name, value in values.items():
            self._series[name].append(float(value))

    def clear(self) -> None:
        """Forget everything recorded so far."""
        for series in self._series.values():
            series.clear()

    def __getitem__(self, name: str) -> list[float]:
        return list(self._series[name])

    def __len__(self) -> int:
        return len(self._series["running"])
