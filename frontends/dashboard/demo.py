"""Synthetic but plausible `EngineStats` sequences, for snapshots, tests and screenshots.

`DemoEngine` is a toy model of a serving engine: requests arrive, prefill, decode and
finish; a block pool hands out blocks, shares a common system-prompt prefix, keeps freed
prefix blocks cached until evicted, and preempts (swaps) when it runs dry. It is seeded,
so every run yields the same frames, and it draws the block map the way a real pool
fragments. Nothing here is measured; it exists so the dashboard can be seen without a GPU.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from asyncengine.stats_collect import decode_rate, percentiles
from asyncengine.stats_schema import (
    BLOCK_CACHED,
    BLOCK_FREE,
    BLOCK_SHARED,
    BLOCK_USED,
    DeviceStats,
    EngineStats,
    LatencySummary,
    RequestState,
    RequestStats,
)

__all__ = ["DemoEngine", "demo_frames", "idle_cpu_stats"]

GiB = 2**30


@dataclass
class _Request:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    state: RequestState = "waiting"
    computed: int = 0
    generated: int = 0
    first_token: float | None = None  # when its first generated token came
    blocks: list[int] = field(default_factory=list)
    prefix: int = -1  # which shared system prompt it starts with, -1 for none


class DemoEngine:
    """A seeded toy engine that advances one `step` (one second) at a time."""

    def __init__(
        self,
        *,
        seed: int = 0,
        num_blocks: int = 912,
        block_size: int = 16,
        device: DeviceStats | None = None,
        model: str = "HuggingFaceTB/SmolLM2-135M-Instruct",
        max_running: int = 48,
    ) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device or DeviceStats(
            kind="cuda",
            name="NVIDIA H200",
            memory_total_bytes=int(139.8 * GiB),
        )
        self.model = model
        self.max_running = max_running
        self.time = 0.0
        self.owners: list[int] = [0] * num_blocks  # references per block
        self.cached: OrderedDict[int, None] = OrderedDict()  # LRU of free blocks with a hash
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        # System prompts that many requests start with (their blocks are shared).
        self.prefixes = [self._take(n) for n in (6, 3, 12)]
        self.prefix_weights = (0.45, 0.2, 0.1)
        self.requests: list[_Request] = []
        self.next_id = 0
        self.totals = {"prompt": 0, "gen": 0, "finished": 0, "aborted": 0}
        self.preemptions = self.swaps_out = self.swaps_in = 0
        self.queries = self.hits = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []

    # -- block pool -------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        blocks = []
        for _ in range(n):
            if self.free:
                # Mostly lowest-free-first, sometimes anywhere: real pools fragment.
                idx = -1 if self.rng.random() < 0.8 else self.rng.randrange(len(self.free))
                block = self.free.pop(idx)
            elif self.cached:
                block, _ = self.cached.popitem(last=False)
            else:
                break
            self.owners[block] += 1
            blocks.append(block)
        return blocks

    def _release(self, blocks: list[int], keep_cached: bool) -> None:
        for block in blocks:
            self.owners[block] -= 1
            if self.owners[block] == 0:
                if keep_cached:
                    self.cached[block] = None
                else:
                    self.free.append(block)

    def _available(self) -> int:
        return len(self.free) + len(self.cached)

    # -- request lifecycle ------------------------------------------------------------
    def _arrive(self, load: float) -> None:
        for _ in range(self._poisson(load)):
            self.next_id += 1
            roll, prefix = self.rng.random(), -1
            for i, weight in enumerate(self.prefix_weights):
                if roll < weight:
                    prefix = i
                    break
                roll -= weight
            shared_tokens = len(self.prefixes[prefix]) * self.block_size if prefix >= 0 else 0
            req = _Request(
                request_id=f"chat-{self.rng.getrandbits(24):06x}",
                prompt_tokens=self.rng.randint(20, 420) + shared_tokens,
                max_tokens=self.rng.randint(48, 640),
                arrival=self.time,
                prefix=prefix,
            )
            self.requests.append(req)

    def _poisson(self, lam: float) -> int:
        threshold, k, p = math.exp(-lam), 0, 1.0
        while True:
            p *= self.rng.random()
            if p <= threshold:
                return k
            k += 1

    def _admit(self) -> None:
        running = sum(r.state == "running" for r in self.requests)
        for req in self.requests:
            if running >= self.max_running:
                return
            if req.state == "swapped" and self._available() > len(req.blocks) + 48:
                req.blocks = self._take(len(req.blocks))
                req.state = "running"
                self.swaps_in += 1
                running += 1
            elif req.state == "waiting":
                need = math.ceil(req.prompt_tokens / self.block_size)
                if self._available() < need + 2:
                    return
                self.queries += 1
                if req.prefix >= 0:
                    self.hits += 1
                    shared = self.prefixes[req.prefix]
                    for block in shared:
                        if self.owners[block] == 0:
                            self.cached.pop(block, None)
                        self.owners[block] += 1
                    req.blocks = list(shared) + self._take(need - len(shared))
                else:
                    req.blocks = self._take(need)
                req.state = "running"
                running += 1

    def _decode(self, dt: float) -> tuple[int, int]:
        prompt = gen = 0
        for req in self.requests:
            if req.state != "running":
                continue
            if req.computed < req.prompt_tokens:
                chunk = min(req.prompt_tokens - req.computed, 2048)
                req.computed += chunk
                prompt += chunk
                if req.computed >= req.prompt_tokens:
                    self.ttft.append(0.03 + 0.12 * self.rng.random() + (self.time - req.arrival))
                continue
            tokens = int(self.rng.uniform(55, 95) * dt)
            if req.first_token is None:
                req.first_token = self.time
            req.generated = min(req.max_tokens, req.generated + tokens)
            gen += tokens
            self.itl.append(1 / max(tokens, 1) * self.rng.uniform(0.8, 1.4))
            while len(req.blocks) * self.block_size < req.prompt_tokens + req.generated:
                got = self._take(1)
                if not got:
                    self._preempt()
                    break
                req.blocks += got
        return prompt, gen

    def _preempt(self) -> None:
        victims = [r for r in self.requests if r.state == "running"]
        if not victims:
            return
        victim = max(victims, key=lambda r: r.arrival)
        self._release(victim.blocks, keep_cached=False)
        victim.state = "swapped"
        self.preemptions += 1
        self.swaps_out += 1

    def _finish(self) -> None:
        for req in list(self.requests):
            done = req.state == "running" and req.generated >= req.max_tokens
            if done or (req.state == "running" and self.rng.random() < 0.004):
                self._release(req.blocks, keep_cached=True)
                self.requests.remove(req)
                self.totals["finished" if done else "aborted"] += 1

    # -- public -----------------------------------------------------------------------
    def step(self, dt: float = 1.0, load: float | None = None) -> EngineStats:
        """Advance `dt` seconds at `load` arrivals per second and return the snapshot."""
        self.time += dt
        if load is None:
            load = 2.7 + 2.4 * math.sin(self.time / 11.0) + self.rng.random()
        self._arrive(load)
        self._admit()
        prompt, gen = self._decode(dt)
        self._finish()
        self.totals["prompt"] += prompt
        self.totals["gen"] += gen
        return self.snapshot(prompt / dt, gen / dt)

    def snapshot(self, prompt_rate: float = 0.0, gen_rate: float = 0.0) -> EngineStats:
        """The engine's state now, as the server would send it."""
        cells = []
        for block, refs in enumerate(self.owners):
            if refs > 1:
                cells.append(BLOCK_SHARED)
            elif refs == 1:
                cells.append(BLOCK_USED)
            elif block in self.cached:
                cells.append(BLOCK_CACHED)
            else:
                cells.append(BLOCK_FREE)
        used = sum(refs > 0 for refs in self.owners)
        busy = sum(r.state == "running" for r in self.requests)
        kv_gib = 0.07 * used * self.block_size / 1024
        device = msgspec.structs.replace(
            self.device,
            memory_used_bytes=int(min(self.device.memory_total_bytes, (96.0 + kv_gib) * GiB))
            if self.device.kind == "cuda"
            else self.device.memory_used_bytes,
            utilization_percent=min(100.0, 30.0 + 1.4 * busy + 4 * self.rng.random()),
            power_watts=min(700.0, 160.0 + 11.0 * busy) if self.device.kind == "cuda" else None,
            temperature_c=38.0 + 0.6 * busy if self.device.kind == "cuda" else None,
        )
        return EngineStats(
            timestamp=self.time,
            num_running=busy,
            num_waiting=sum(r.state == "waiting" for r in self.requests),
            num_swapped=sum(r.state == "swapped" for r in self.requests),
            kv_blocks_total=self.num_blocks,
            kv_blocks_used=used,
            kv_blocks_cached=len(self.cached),
            kv_block_size=self.block_size,
            kv_block_map="".join(cells),
            prefix_cache_hit_rate=self.hits / self.queries if self.queries else 0.0,
            prefix_cache_queries=self.queries,
            prefix_cache_hits=self.hits,
            num_preemptions=self.preemptions,
            num_swaps_out=self.swaps_out,
            num_swaps_in=self.swaps_in,
            prompt_tokens_total=self.totals["prompt"],
            generation_tokens_total=self.totals["gen"],
            prompt_tokens_per_s=prompt_rate,
            generation_tokens_per_s=gen_rate,
            num_requests_finished=self.totals["finished"],
            num_requests_aborted=self.totals["aborted"],
            ttft=percentiles(self.ttft[-500:]),
            itl=percentiles(self.itl[-5000:]),
            requests=[
                RequestStats(
                    request_id=r.request_id,
                    state=r.state,
                    prompt_tokens=r.prompt_tokens,
                    generated_tokens=r.generated,
                    tokens_per_s=decode_rate(r.generated, r.first_token, self.time),
                    age_s=self.time - r.arrival,
                )
                for r in self.requests
            ],
            device=device,
            model=self.model,
        )


def demo_frames(n: int = 90, *, seed: int = 0, **engine_kwargs: object) -> list[EngineStats]:
    """`n` consecutive one-second snapshots of a busy GPU server."""
    engine = DemoEngine(seed=seed, **engine_kwargs)  # type: ignore[arg-type]
    return [engine.step() for _ in range(n)]


def idle_cpu_stats() -> EngineStats:
    """A CPU server with nothing to do: a few cached blocks left from earlier requests."""
    block_map = "c" * 12 + "." * 4 + "c" * 3 + "." * (256 - 19)
    return EngineStats(
        timestamp=1.0,
        kv_blocks_total=256,
        kv_blocks_used=0,
        kv_blocks_cached=15,
        kv_block_size=16,
        kv_block_map=block_map,
        prefix_cache_hit_rate=0.5,
        prefix_cache_queries=4,
        prefix_cache_hits=2,
        prompt_tokens_total=812,
        generation_tokens_total=244,
        num_requests_finished=4,
        ttft=LatencySummary(p50=0.182, p90=0.240, p99=0.251, count=4),
        itl=LatencySummary(p50=0.0213, p90=0.0260, p99=0.0311, count=240),
        device=DeviceStats(
            kind="cpu",
            name="AMD EPYC 9654 96-Core Processor",
            memory_used_bytes=int(3.4 * GiB),
            memory_total_bytes=int(15.5 * GiB),
            utilization_percent=1.5,
        ),
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
    )
