"""What fills stats snapshots: the one percentile rule, the latency window, a request's rate."""

from __future__ import annotations

import pytest

from asyncengine.block_pool import BlockPool
from asyncengine.request import Request
from asyncengine.sampling_params import SamplingParams
from asyncengine.stats_collect import (
    LatencyWindow,
    RateMeter,
    block_map,
    decode_rate,
    percentiles,
)
from asyncengine.stats_schema import LatencySummary


def test_percentiles_pick_index_floor_q_n() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, unsorted
    summary = percentiles(values)
    # Sorted index floor(q * 100): 50, 90, 99 hold the values 51, 91, 100.
    assert (summary.p50, summary.p90, summary.p99, summary.count) == (51.0, 91.0, 100.0, 100)
    assert percentiles([3.0]) == LatencySummary(p50=3.0, p90=3.0, p99=3.0, count=1)
    assert percentiles([]) == LatencySummary()


def test_latency_window_keeps_the_most_recent_samples() -> None:
    window = LatencyWindow(maxlen=3)
    for v in (9.0, 1.0, 2.0, 3.0):
        window.add(v)
    assert window.summary() == percentiles([1.0, 2.0, 3.0])


@pytest.mark.parametrize(
    ("generated", "first", "now", "rate"),
    [
        (0, None, 5.0, None),
        (1, 4.0, 5.0, None),  # one token has no rate
        (2, 5.0, 5.0, None),  # no time since the first
        (2, 4.0, 4.5, 2.0),
        (11, 3.0, 5.0, 5.0),  # 10 tokens after the first in 2 s
    ],
)
def test_decode_rate(generated: int, first: float | None, now: float, rate: float | None) -> None:
    assert decode_rate(generated, first, now) == rate


def test_rate_meter_counts_a_window() -> None:
    meter = RateMeter(window_s=5.0)
    meter.add(10, now=0.0)
    meter.add(20, now=4.0)
    assert meter.total == 30
    assert meter.rate(now=4.0) == pytest.approx(30 / 4.0)
    assert meter.rate(now=20.0) == 0.0


def test_block_map_downsamples_to_each_groups_busiest_state() -> None:
    """A pool larger than the map: each cell shows the highest of shared, used, cached and
    free in its group, and the last, shorter group counts as much as its blocks."""
    pool = BlockPool(4096 * 3 + 2, 16)  # groups of 4 blocks, the last of 2
    req = Request("r", None, list(range(16)), SamplingParams(), 8)
    assert pool.allocate_slots(req, 16) is not None
    req.num_computed_tokens = 16
    pool.cache_full_blocks(req)
    pool.free(req)  # its one full block stays cached
    (cached,) = pool.cached_free_blocks()
    cells = {cached // 4: "c"}
    for block, ref, cell in ((4 * 700, 1, "u"), (4 * 900 + 3, 2, "s"), (4 * 900, 1, "s"),
                             (4 * 3072 + 1, 1, "u")):  # fmt: skip
        pool.ref_counts[block] = ref
        cells[block // 4] = cell
    m = block_map(pool)
    assert len(m) == 3073
    assert {i: c for i, c in enumerate(m) if c != "."} == cells
