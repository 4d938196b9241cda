"""Engine statistics snapshots: the one shape in which the engine reports its state.

The engine fills an `EngineStats` after each step; the WebSocket server sends it as the
`stats` event, `/metrics` reads it, and the dashboard draws it. These are msgspec Structs so
the same object crosses threads, processes and the wire without a second schema.
"""

from __future__ import annotations

from typing import Literal

import msgspec

RequestState = Literal["waiting", "running", "swapped"]

# Block states in `EngineStats.kv_block_map`, one character per cell.
BLOCK_FREE = "."  # free and holding no reusable prefix
BLOCK_CACHED = "c"  # free, but still holding a hashed prefix that can be reused
BLOCK_USED = "u"  # referenced by exactly one request
BLOCK_SHARED = "s"  # referenced by several requests (prefix sharing)


class DeviceStats(msgspec.Struct, kw_only=True):
    """What the engine runs on: a GPU through torch/NVML, or the host CPU."""

    kind: Literal["cuda", "cpu"] = "cpu"
    name: str = ""
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0
    utilization_percent: float | None = None
    power_watts: float | None = None
    temperature_c: float | None = None


class RequestStats(msgspec.Struct, kw_only=True):
    """One in-flight request as the dashboard's table shows it."""

    request_id: str
    state: RequestState
    prompt_tokens: int
    generated_tokens: int
    # Generated tokens after the first over the time since the first came (a decode rate);
    # None until the request has two tokens.
    tokens_per_s: float | None = None
    age_s: float


class LatencySummary(msgspec.Struct, kw_only=True):
    """Percentiles (seconds) over a recent window of requests' first tokens or of tokens;
    `AsyncLLMEngine` fills them (an `LLMEngine` snapshot leaves them empty)."""

    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    count: int = 0


class SpecDecodeStats(msgspec.Struct, kw_only=True):
    """Speculative decoding counters since start (vLLM's): verify steps of a request that
    carried drafts, the drafted tokens, the accepted ones, and accepted by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    acceptance_rate: float = 0.0  # accepted / drafted tokens
    mean_acceptance_length: float = 0.0  # tokens per verify step: 1 + accepted / drafts


class EngineStats(msgspec.Struct, kw_only=True):
    """A snapshot of the engine, taken between steps."""

    timestamp: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    # Free blocks that admission keeps for the running requests' expected growth (0 when it
    # keeps no room: schedule_conservativeness 0).
    kv_blocks_reserved: int = 0
    kv_block_size: int = 16
    # The KV cache's element type: the model dtype ("bfloat16", ...) or "fp8_e4m3".
    kv_cache_dtype: str = ""
    # One character per block (see BLOCK_*), downsampled to at most 4096 cells.
    kv_block_map: str = ""
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_swaps_out: int = 0
    num_swaps_in: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prompt_tokens_per_s: float = 0.0
    generation_tokens_per_s: float = 0.0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    ttft: LatencySummary = msgspec.field(default_factory=LatencySummary)
    itl: LatencySummary = msgspec.field(default_factory=LatencySummary)
    requests: list[RequestStats] = msgspec.field(default_factory=list)
    device: DeviceStats = msgspec.field(default_factory=DeviceStats)
    # Present when the engine speculates (`speculative_config`).
    spec_decode: SpecDecodeStats | None = None
    model: str = ""
    healthy: bool = True
