"""What fills `EngineStats` snapshots: rolling windows, rate meters and device readings.

`percentiles` is the one percentile rule every summary (engine, dashboard demo) uses;
`kv_dtype_name` is how a KV cache's element type is spelled in snapshots.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

import numpy as np

from asyncengine.block_pool import BlockPool
from asyncengine.stats_schema import (
    BLOCK_CACHED,
    BLOCK_FREE,
    BLOCK_SHARED,
    BLOCK_USED,
    DeviceStats,
    LatencySummary,
)

_MAP_CELLS = 4096


def percentiles(values: Iterable[float]) -> LatencySummary:
    """p50/p90/p99 of `values`: the sample at index floor(q * n) of the sorted n (the last
    one for q * n >= n)."""
    ordered = sorted(values)
    if not ordered:
        return LatencySummary()
    last = len(ordered) - 1

    def pick(q: float) -> float:
        return ordered[min(int(q * len(ordered)), last)]

    return LatencySummary(p50=pick(0.5), p90=pick(0.9), p99=pick(0.99), count=len(ordered))


class LatencyWindow:
    """The most recent `maxlen` latency samples, summarised as percentiles on demand."""

    def __init__(self, maxlen: int = 4096) -> None:
        self._samples: deque[float] = deque(maxlen=maxlen)

    def add(self, value: float) -> None:
        self._samples.append(value)

    def summary(self) -> LatencySummary:
        return percentiles(self._samples)


def decode_rate(generated_tokens: int, first_token_time: float | None, now: float) -> float | None:
    """A request's tokens per second since its first token: the tokens after the first over
    the time since it came. None until there are two tokens (one token alone has no rate)."""
    if generated_tokens < 2 or first_token_time is None or now <= first_token_time:
        return None
    return (generated_tokens - 1) / (now - first_token_time)


class RateMeter:
    """Tokens per second over a sliding window of recent steps."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self.total = 0

    def add(self, count: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.total += count
        self._events.append((now, count))
        self._trim(now)  # bounded even when nobody reads the rate

    def _trim(self, now: float) -> None:
        while self._events and now - self._events[0][0] > self.window_s:
            self._events.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        if not self._events:
            return 0.0
        span = max(now - self._events[0][0], 1.0)
        return sum(c for _, c in self._events) / span


# A block's state by rank (a downsampled cell shows its group's highest): as bytes, so a
# rank array indexes its characters.
_STATE_CHARS = np.frombuffer(
    (BLOCK_FREE + BLOCK_CACHED + BLOCK_USED + BLOCK_SHARED).encode("ascii"), dtype=np.uint8
)


def block_map(pool: BlockPool) -> str:
    """One character per block (downsampled by taking each group's busiest state: shared,
    used, cached, free). Array operations, not a Python loop per block: a GPU pool holds
    up to ~120,000 blocks and the map is built on the step thread for every stats snapshot
    a dashboard asks for."""
    n = pool.num_blocks
    refs = np.fromiter(pool.ref_counts, dtype=np.int64, count=n)
    rank = np.where(refs >= 2, 3, np.where(refs == 1, 2, 0)).astype(np.uint8)
    rank[np.fromiter(pool.cached_free_blocks(), dtype=np.int64)] = 1
    if n > _MAP_CELLS:
        group = -(-n // _MAP_CELLS)
        padded = np.zeros(-(-n // group) * group, dtype=np.uint8)  # free: never a group's max
        padded[:n] = rank
        rank = padded.reshape(-1, group).max(axis=1)
    return _STATE_CHARS[rank].tobytes().decode("ascii")


_KV_DTYPE_NAMES = {
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.bfloat16": "bfloat16",
    "torch.float16": "float16",
    "torch.float32": "float32",
}


def kv_dtype_name(dtype: object) -> str:
    """The KV cache's element type as snapshots show it: vLLM's "fp8_e4m3" for e4m3, the
    torch name otherwise (takes a torch.dtype; compared by name to keep torch unimported)."""
    name = str(dtype)
    return _KV_DTYPE_NAMES.get(name, name.removeprefix("torch."))


def device_stats(device_type: str, device_index: int = 0) -> DeviceStats:
    """GPU figures through torch and NVML when on CUDA; host CPU and RAM otherwise."""
    if device_type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device_index)
        stats = DeviceStats(
            kind="cuda",
            name=torch.cuda.get_device_name(device_index),
            memory_used_bytes=total - free,
            memory_total_bytes=total,
        )
        try:
            stats.utilization_percent = float(torch.cuda.utilization(device_index))
            stats.power_watts = torch.cuda.power_draw(device_index) / 1000.0
            stats.temperature_c = float(torch.cuda.temperature(device_index))
        except Exception:  # NVML missing: memory figures are still right
            pass
        return stats
    import platform

    import psutil

    mem = psutil.virtual_memory()
    return DeviceStats(
        kind="cpu",
        name=platform.processor() or platform.machine() or "CPU",
        memory_used_bytes=mem.total - mem.available,
        memory_total_bytes=mem.total,
        utilization_percent=psutil.cpu_percent(interval=None),
    )
