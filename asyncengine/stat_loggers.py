"""Stat loggers: what receives the serving metrics `AsyncLLMEngine` measures.

`AsyncLLMEngine` measures TTFT and inter-token latency once, on the event loop as outputs
arrive, and hands each figure to every `StatLoggerBase`: `LatencyStatLogger` keeps recent
samples for the percentiles in `EngineStats.ttft`/`.itl` (the dashboard's figures), and
`PrometheusStatLogger` turns them (and the engine's `EngineStats` snapshots) into Prometheus
series in a registry of its own, so several servers in one process never collide.
`LoggingStatLogger` writes one line every few seconds while the engine works, as vLLM's
server does. Nothing here touches the model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncengine.stats_collect import LatencyWindow
from asyncengine.stats_schema import EngineStats

# `_created` series double the output for no benefit to dashboards.
prometheus_client.disable_created_metrics()

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class StatLoggerBase:
    """Hooks the async engine calls on the event loop; override what you record."""

    def on_first_token(self, ttft: float) -> None:
        """The first generated token of a request arrived `ttft` seconds after arrival."""

    def on_new_tokens(self, num_tokens: int, inter_token_latency: float | None) -> None:
        """`num_tokens` new tokens; the gap since the request's previous tokens if any."""

    def on_prompt_processed(self, num_prompt_tokens: int) -> None:
        """A request's prompt finished prefill (counted once per request)."""

    def on_request_finished(
        self,
        *,
        finish_reason: str,
        e2e_latency: float,
        queue_time: float | None,
        num_prompt_tokens: int,
        num_generation_tokens: int,
    ) -> None:
        """A request ended (finished, stopped, aborted or failed)."""

    def on_stats(self, stats: EngineStats) -> None:
        """A fresh engine snapshot (gauges and monotonically growing engine counters)."""


class LatencyStatLogger(StatLoggerBase):
    """Recent TTFT and inter-token latencies, summarised for `EngineStats.ttft`/`.itl`."""

    def __init__(self, maxlen: int = 4096) -> None:
        self.ttft = LatencyWindow(maxlen)
        self.itl = LatencyWindow(maxlen)

    def on_first_token(self, ttft: float) -> None:
        self.ttft.add(ttft)

    def on_new_tokens(self, num_tokens: int, inter_token_latency: float | None) -> None:
        if inter_token_latency is not None:
            self.itl.add(inter_token_latency)


class PrometheusStatLogger(StatLoggerBase):
    """Prometheus series for one engine, in `registry` (a fresh one when not given).

    Names are `<prefix>_<what>`, underscores only (colons are reserved for recording rules);
    every series carries a `model_name` label, as vLLM's do.
    """

    def __init__(
        self,
        model_name: str = "",
        registry: CollectorRegistry | None = None,
        prefix: str = "asyncengine",
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        p = prefix

        def hist(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(f"{p}_{name}", doc, labels, registry=reg,
                             buckets=tuple(buckets)).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{p}_{name}", doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{p}_{name}", doc, labels, registry=reg).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds",
                         "Time from request arrival to its first generated token.", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Time between consecutive generated tokens of a request.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "Time from request arrival to its end.", _REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds",
                               "Time a request waited before it was first scheduled.",
                               _REQUEST_BUCKETS)
        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_swapped = gauge("num_requests_swapped", "Requests swapped out to CPU memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.kv_reserved = gauge("kv_cache_reserved_perc",
                                 "Fraction of KV-cache blocks kept free for the running "
                                 "requests' expected growth (0-1).")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate",
                                     "Fraction of queried prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted by the scheduler.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        # Speculative decoding, vLLM's spec_decode_* counters (acceptance rate and mean
        # acceptance length derive from them).
        self.spec_drafts = counter("spec_decode_num_drafts",
                                   "Verify steps of requests with drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted.")
        self.spec_accepted_per_pos = Counter(
            f"{p}_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            ["model_name", "position"], registry=reg)
        self._success = Counter(f"{p}_request_success", "Requests that ended, by finish reason.",
                                ["model_name", "finished_reason"], registry=reg)
        # Engine counters arrive as running totals; remember the last one to add the delta.
        self._last_totals: dict[str, int] = {}

    def on_first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def on_new_tokens(self, num_tokens: int, inter_token_latency: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if inter_token_latency is not None:
            self.itl.observe(inter_token_latency)

    def on_prompt_processed(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_request_finished(
        self,
        *,
        finish_reason: str,
        e2e_latency: float,
        queue_time: float | None,
        num_prompt_tokens: int,
        num_generation_tokens: int,
    ) -> None:
        self.e2e.observe(e2e_latency)
        if queue_time is not None:
            self.queue_time.observe(queue_time)
        self._success.labels(self.model_name, finish_reason).inc()

    def on_stats(self, stats: EngineStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.num_swapped.set(stats.num_swapped)
        total = stats.kv_blocks_total
        self.kv_usage.set(stats.kv_blocks_used / total if total else 0.0)
        self.kv_reserved.set(stats.kv_blocks_reserved / total if total else 0.0)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        self._add_delta("preemptions", stats.num_preemptions, self.preemptions)
        self._add_delta("prefix_queries", stats.prefix_cache_queries, self.prefix_queries)
        self._add_delta("prefix_hits", stats.prefix_cache_hits, self.prefix_hits)
        spec = stats.spec_decode
        if spec is not None:
            self._add_delta("spec_drafts", spec.num_drafts, self.spec_drafts)
            self._add_delta("spec_draft_tokens", spec.num_draft_tokens, self.spec_draft_tokens)
            self._add_delta("spec_accepted", spec.num_accepted_tokens, self.spec_accepted_tokens)
            for pos, total in enumerate(spec.accepted_per_pos):
                self._add_delta(f"spec_pos_{pos}", total,
                                self.spec_accepted_per_pos.labels(self.model_name, str(pos)))

    def _add_delta(self, key: str, total: int, counter: Counter) -> None:
        last = self._last_totals.get(key, 0)
        if total > last:
            counter.inc(total - last)
        self._last_totals[key] = max(total, last)

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return prometheus_client.generate_latest(self.registry)


class LoggingStatLogger(StatLoggerBase):
    """One log line at most every `interval_s` while the engine works (vLLM's default
    interval, 10 s): prompt and generation throughput since the last line, the queues, KV
    usage with the room admission keeps for growth, prefix-cache hits and preemptions. An
    idle engine logs nothing. It logs from the snapshots it receives, so whoever attaches it
    also asks the engine for one every interval (`asyncengine serve` does)."""

    def __init__(
        self,
        interval_s: float = 10.0,
        log: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self._log = log if log is not None else logging.getLogger("asyncengine.stats").info
        self._clock = clock
        # When the last line (or the first snapshot) was taken, and the counters then.
        self._last: tuple[float, int, int, int] | None = None

    def on_stats(self, stats: EngineStats) -> None:
        now = self._clock()
        counters = (stats.prompt_tokens_total, stats.generation_tokens_total,
                    stats.num_preemptions)  # fmt: skip
        if self._last is None:
            self._last = (now, *counters)
            return
        then, *before = self._last
        if now - then < self.interval_s:
            return
        self._last = (now, *counters)
        moved = [c - b for c, b in zip(counters, before, strict=True)]
        if not (any(moved) or stats.num_running or stats.num_waiting or stats.num_swapped):
            return
        self._log(format_stats_line(stats, now - then, *moved))


def format_stats_line(stats: EngineStats, seconds: float, prompt_tokens: int,
                      generation_tokens: int, preemptions: int) -> str:  # fmt: skip
    """The line `LoggingStatLogger` writes: throughput over `seconds`, then the snapshot."""
    total = stats.kv_blocks_total
    kv = f"{stats.kv_blocks_used / total:.1%}" if total else "-"
    if total and stats.kv_blocks_reserved:
        kv += f" (+{stats.kv_blocks_reserved / total:.1%} kept for growth)"
    return (
        f"Avg prompt throughput: {prompt_tokens / seconds:.1f} tokens/s, "
        f"Avg generation throughput: {generation_tokens / seconds:.1f} tokens/s, "
        f"Running: {stats.num_running} reqs, Swapped: {stats.num_swapped} reqs, "
        f"Waiting: {stats.num_waiting} reqs, KV cache usage: {kv}, "
        f"Prefix cache hit rate: {stats.prefix_cache_hit_rate:.1%}, "
        f"Preemptions: {preemptions}"
    )
