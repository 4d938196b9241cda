"""Continuous batching under one token budget per step.

Running requests go first (their decodes and continuing prefill chunks), then swapped-out
ones come back, then waiting ones are admitted first come first served. Prompts are chunked
to fit the budget, so prefills and decodes share a step. When the KV pool runs dry the newest
running request is preempted: recompute (drop its blocks, requeue it at the front) or swap
(copy its blocks to CPU). A request only tracks `num_computed_tokens`; there are no phases.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from asyncengine.block_pool import BlockPool, SwapSpace
from asyncengine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def needs_logits(self) -> bool:
        """True when this chunk reaches the last known token, so a new token is sampled."""
        req = self.request
        known = req.num_tokens + req.num_pending_tokens
        return req.num_computed_tokens + self.num_new_tokens == known


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # gpu -> gpu
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # gpu -> cpu
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # cpu -> gpu
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: Literal["recompute", "swap"] = "recompute",
        swap_space: SwapSpace | None = None,
    ) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.swap_space = swap_space
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swaps_out = 0
        self.num_swaps_in = 0

    # -------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from every queue and free its blocks at once."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
            if self.swap_space is not None:
                self.swap_space.discard(request)
        self.pool.free(request)
        request.status = status
        self.requests.pop(request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending_tokens and req.reaches_max_tokens:
                # Its last token is in flight: it ends when that step is resolved.
                i += 1
                continue
            num_new = min(req.num_tokens_to_compute, budget)
            while True:
                copies = self.pool.allocate_slots(req, num_new)
                if copies is not None:
                    break
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if copies is None:  # the request preempted itself
                break
            out.blocks_to_copy += copies
            out.scheduled.append(ScheduledRequest(req, num_new))
            scheduled_ids.add(req.request_id)
            budget -= num_new
            i += 1

        if not out.preempted:
            while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.swapped[0]
                assert self.swap_space is not None
                if not self.swap_space.can_swap_in(self.pool, req):
                    break
                self.swapped.popleft()
                out.blocks_to_swap_in += self.swap_space.swap_in(self.pool, req)
                self.num_swaps_in += 1
                # can_swap_in promised one spare block only: a request swapped out mid-prefill
                # continues with the chunk that fits in its blocks plus what is free.
                room = (len(req.block_table) + self.pool.num_free_blocks) * self.pool.block_size
                num_new = min(req.num_tokens_to_compute, budget, room - req.num_computed_tokens)
                copies = self.pool.allocate_slots(req, num_new)
                assert copies is not None
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new

        if not out.preempted and not self.swapped:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                cached = self.pool.find_cached_blocks(req) if req.num_computed_tokens == 0 else []
                remaining = req.num_tokens_to_compute - len(cached) * self.pool.block_size
                num_new = min(remaining, budget)
                copies = self.pool.allocate_slots(req, num_new, cached)
                if copies is None:
                    break
                self.pool.record_prefix_lookup(req.num_tokens, len(cached) * self.pool.block_size)
                req.metrics.num_cached_prompt_tokens = len(cached) * self.pool.block_size
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.num_preemptions += 1
        req.metrics.num_preemptions += 1
        out.preempted.append(req)
        if self.preemption_mode == "swap" and self.swap_space is not None:
            pairs = self.swap_space.swap_out(self.pool, req)
            if pairs is not None:
                out.blocks_to_swap_out += pairs
                req.status = RequestStatus.SWAPPED
                self.swapped.append(req)
                self.num_swaps_out += 1
                return
        # Recompute: the tokens stay, their K/V is dropped (prefix-cached blocks may survive).
        self.pool.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    # ---------------------------------------------------------------- checks
    def check_integrity(self) -> None:
        holders = [*self.running, *self.waiting, *self.swapped]
        self.pool.check_integrity(holders)
        for req in self.waiting:
            assert not req.block_table, f"waiting request {req.request_id} holds blocks"
        for req in self.swapped:
            assert not req.block_table, f"swapped request {req.request_id} holds GPU blocks"
        if self.swap_space is not None:
            self.swap_space.check_integrity()
            assert set(self.swap_space.tables) == {r.request_id for r in self.swapped}
        assert len(self.running) <= self.max_num_seqs
        ids = [r.request_id for r in holders]
        assert len(ids) == len(set(ids)) == len(self.requests), "a request is queued twice"
