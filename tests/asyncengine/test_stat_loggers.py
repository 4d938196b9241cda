"""LoggingStatLogger: a line at most every interval while the engine works, throughput from
the counters' growth since the last line, the room kept for growth beside KV usage, and
silence while idle."""

from __future__ import annotations

from asyncengine.stat_loggers import LoggingStatLogger, format_stats_line
from asyncengine.stats_schema import EngineStats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def snapshot(prompt: int, generated: int, **fields: object) -> EngineStats:
    base = dict(kv_blocks_total=200, kv_blocks_used=50, num_running=4, num_waiting=2)
    return EngineStats(prompt_tokens_total=prompt, generation_tokens_total=generated,
                       **{**base, **fields})  # type: ignore[arg-type]


def test_a_line_every_interval_with_throughput_since_the_last() -> None:
    clock, lines = Clock(), []
    logger = LoggingStatLogger(10.0, log=lines.append, clock=clock)
    logger.on_stats(snapshot(0, 0))
    clock.now += 4
    logger.on_stats(snapshot(400, 100))
    assert lines == []  # within the interval
    clock.now += 6
    logger.on_stats(snapshot(1000, 500, num_preemptions=3, kv_blocks_reserved=20))
    assert len(lines) == 1
    line = lines[0]
    assert "Avg prompt throughput: 100.0 tokens/s" in line
    assert "Avg generation throughput: 50.0 tokens/s" in line
    assert "Running: 4 reqs" in line and "Waiting: 2 reqs" in line
    assert "KV cache usage: 25.0% (+10.0% kept for growth)" in line
    assert line.endswith("Preemptions: 3")
    clock.now += 10
    logger.on_stats(snapshot(1000, 600, num_preemptions=3))
    assert "Avg generation throughput: 10.0 tokens/s" in lines[1]
    assert lines[1].endswith("Preemptions: 0")  # since the last line


def test_an_idle_engine_logs_nothing() -> None:
    clock, lines = Clock(), []
    logger = LoggingStatLogger(10.0, log=lines.append, clock=clock)
    idle = dict(num_running=0, num_waiting=0)
    logger.on_stats(snapshot(5, 5, **idle))
    for _ in range(3):
        clock.now += 10
        logger.on_stats(snapshot(5, 5, **idle))
    assert lines == []


def test_the_line_without_a_pool_or_a_reserve() -> None:
    line = format_stats_line(EngineStats(), 1.0, 0, 0, 0)
    assert "KV cache usage: -," in line and "kept for growth" not in line
