"""Continuous batching under one token budget per step.

Running requests go first (their decodes and continuing prefill chunks), then swapped-out
ones come back, then waiting ones are admitted first come first served. Prompts are chunked
to fit the budget, so prefills and decodes share a step. When the KV pool runs dry the newest
running request is preempted: recompute (drop its blocks, requeue it at the front) or swap
(copy its blocks to CPU). A request only tracks `num_computed_tokens`; there are no phases.

Parallel sampling (n > 1): a request is n sequences (`ParentRequest`). The first is admitted
and prefills the prompt; the others wait, parked, until a running sequence of theirs (the
donor) has computed the prompt, then are forked from it: they share its prompt blocks, so the
prompt is admitted and computed once, and each computes only the prompt's last token (to
sample its own first token) and what it generates. Preemption takes a group's unscheduled
sequences together: recompute frees them and parks them to be forked again (or, when none of
the group still holds the prompt, requeues one to prefill it); swap moves them to CPU in one
piece, each shared block once.

Admission leaves room for growth (`asyncengine.admission`): a waiting request is admitted only
while the free blocks cover its prompt and what it and the running requests are expected to
still generate, so `max_num_seqs` is a ceiling and the pool decides how many requests run.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from asyncengine.admission import GrowthEstimate
from asyncengine.block_pool import BlockPool, SwapSpace
from asyncengine.request import ParentRequest, Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # Of num_new_tokens, the drafts (speculative decoding) after the last known token.
    num_spec_tokens: int = 0

    @property
    def needs_logits(self) -> bool:
        """True when this chunk reaches the last known token, so a new token is sampled."""
        req = self.request
        known = req.num_tokens + req.num_pending_tokens
        return req.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens == known


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
        """Nothing to run: no request is scheduled (blocks may still move)."""
        return not self.scheduled

    @property
    def has_block_moves(self) -> bool:
        return bool(self.blocks_to_copy or self.blocks_to_swap_out or self.blocks_to_swap_in)

    def block_moves(self) -> SchedulerOutput:
        """The step's block moves alone (no requests: what a worker process is sent)."""
        return SchedulerOutput(
            blocks_to_copy=self.blocks_to_copy,
            blocks_to_swap_out=self.blocks_to_swap_out,
            blocks_to_swap_in=self.blocks_to_swap_in,
        )


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: Literal["recompute", "swap"] = "recompute",
        swap_space: SwapSpace | None = None,
        growth: GrowthEstimate | None = None,
    ) -> None:
        self.pool = pool
        # None: admit whatever fits now (the running requests' growth is not reserved).
        self.growth = growth if growth is not None and growth.enabled else None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.swap_space = swap_space
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        # Request id -> its (first) sequence, while any sequence of the request is unfinished.
        self.requests: dict[str, Request] = {}
        # Sequences of parallel requests waiting to be forked from a donor of their group.
        self.parked: list[Request] = []
        self.num_preemptions = 0
        self.num_swaps_out = 0
        self.num_swaps_in = 0

    # -------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queue a sequence; a parallel request's later sequences wait to be forked."""
        if request.parent is not None and request.index > 0:
            self.parked.append(request)
            return
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def get_sequences(self, request_id: str) -> list[Request]:
        """The unfinished sequences of a request (one unless it samples n > 1)."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        return [s for s in req.siblings if not s.is_finished]

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove a sequence from every queue and free its blocks at once."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            if request in self.parked:
                self.parked.remove(request)
            else:
                self.waiting.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
            if self.swap_space is not None:
                self.swap_space.discard(request)
        self.pool.free(request)
        request.status = status
        if self.growth is not None:
            self.growth.observe_finish(request, status)
        group = request.parent
        if group is None or group.is_finished:
            self.requests.pop(request.request_id, None)
        else:
            self._requeue_orphans(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------- parallel requests
    def _holds_or_will_hold_prompt(self, group: ParentRequest) -> bool:
        return any(
            s.status in (RequestStatus.RUNNING, RequestStatus.SWAPPED)
            or (s.status == RequestStatus.WAITING and s not in self.parked)
            for s in group.seqs
        )

    def _requeue_orphans(self, group: ParentRequest) -> None:
        """Parked sequences whose group no longer holds the prompt (nor will: nothing of it
        runs, waits or is swapped) send one of them to prefill it again, at the front."""
        if self._holds_or_will_hold_prompt(group):
            return
        lead = next((s for s in group.seqs if s in self.parked), None)
        if lead is not None:
            self.parked.remove(lead)
            self.waiting.appendleft(lead)

    def _fork_parked(self, out: SchedulerOutput, budget: int) -> int:
        """Fork parked sequences from a running donor of their group that has computed the
        prompt; returns the budget left."""
        # Blocks this step fills by copy-on-write: copies run as one batch, so a donor
        # whose shared blocks include one (e.g. a sequence forked in this very step) would
        # hand out a block whose contents are not there yet.
        copied = {dst for _, dst in out.blocks_to_copy}

        def can_donate(s: Request, fork_point: int) -> bool:
            return (
                s.status == RequestStatus.RUNNING
                and s.num_computed_tokens >= fork_point
                and copied.isdisjoint(s.block_table[: self.pool.blocks_needed(fork_point)])
            )

        for seq in list(self.parked):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            group = seq.parent
            assert group is not None
            donor = next((s for s in group.seqs if can_donate(s, group.fork_point)), None)
            if donor is None:
                continue
            self.pool.fork(donor, seq, group.fork_point)
            num_new = min(seq.num_tokens_to_compute, budget)
            copies = self.pool.allocate_slots(seq, num_new)
            if copies is None:
                self.pool.free(seq)
                seq.num_computed_tokens = 0
                break
            self.parked.remove(seq)
            seq.status = RequestStatus.RUNNING
            seq.metrics.num_cached_prompt_tokens = group.fork_point
            # Next to its group, so a group's sequences stay together at the preemption end.
            last = max(k for k, r in enumerate(self.running) if r.parent is group)
            self.running.insert(last + 1, seq)
            out.blocks_to_copy += copies
            copied.update(dst for _, dst in copies)
            out.scheduled.append(ScheduledRequest(seq, num_new))
            budget -= num_new
        return budget

    # -------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending_tokens and req.reaches_max_tokens:
                # Its last token is in flight: it ends when that step is resolved.
                i += 1
                continue
            # A speculating request verifies its drafts too (they are cut to fit the budget).
            num_new = min(req.num_tokens_to_compute + len(req.spec_token_ids), budget)
            num_spec = max(0, num_new - req.num_tokens_to_compute)
            del req.spec_token_ids[num_spec:]
            while True:
                copies = self.pool.allocate_slots(req, num_new)
                if copies is not None:
                    break
                victims = self._victims(i)
                self._preempt(victims, out)
                if req in victims:
                    break
            if copies is None:
                # It was preempted itself (with its group): the next one moved to index i.
                continue
            out.blocks_to_copy += copies
            out.scheduled.append(ScheduledRequest(req, num_new, num_spec))
            budget -= num_new
            i += 1

        # No admissions in a step that preempted. A parallel request whose samples no
        # longer share blocks may preempt itself whole and leave this step empty: it comes
        # back in the next one, its samples sharing the prompt again.
        if not out.preempted and self.parked:
            budget = self._fork_parked(out, budget)

        if not out.preempted:
            while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
                unit = self._swap_in_unit()
                if not unit:
                    break
                for req in unit:
                    self.swapped.remove(req)
                assert self.swap_space is not None
                out.blocks_to_swap_in += self.swap_space.swap_in(self.pool, unit)
                self.num_swaps_in += len(unit)
                for j, req in enumerate(unit):
                    req.status = RequestStatus.RUNNING
                    self.running.append(req)
                    if budget <= 0:
                        continue
                    # can_swap_in promised one spare block per sequence: a sequence swapped
                    # out mid-prefill continues with the chunk that fits in its blocks plus
                    # what is free, less the others' spare blocks and a copy-on-write block.
                    spare = self.pool.num_free_blocks - (len(unit) - j - 1)
                    spare -= int(self.pool._needs_copy_on_write(req))
                    room = (len(req.block_table) + spare) * self.pool.block_size
                    num_new = min(req.num_tokens_to_compute, budget, room - req.num_computed_tokens)
                    copies = self.pool.allocate_slots(req, num_new)
                    assert copies is not None
                    out.blocks_to_copy += copies
                    out.scheduled.append(ScheduledRequest(req, num_new))
                    budget -= num_new

        held_back = False
        if not out.preempted and not self.swapped:
            growth = self.growth if self.waiting else None
            headroom = self._growth_headroom() if growth is not None else 0
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                # A request scoring its prompt (prompt_logprobs) must compute every position.
                fresh = req.num_computed_tokens == 0 and req.params.prompt_logprobs is None
                cached = self.pool.find_cached_blocks(req) if fresh else []
                need = 0
                if growth is not None:
                    need = self.pool.blocks_needed(growth.expected_total_tokens(req)) - len(cached)
                    # With nothing running, nothing grows but itself: it goes in if it fits.
                    if need > headroom and self.running:
                        held_back = True
                        break
                remaining = req.num_tokens_to_compute - len(cached) * self.pool.block_size
                num_new = min(remaining, budget)
                copies = self.pool.allocate_slots(req, num_new, cached)
                if copies is None:
                    break
                headroom -= need
                self.pool.record_prefix_lookup(req.num_tokens, len(cached) * self.pool.block_size)
                req.metrics.num_cached_prompt_tokens = len(cached) * self.pool.block_size
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new

        if self.growth is not None:
            self.growth.observe_step(preempted=bool(out.preempted), held_back=held_back)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def reserved_blocks(self) -> int:
        """Blocks the running requests are expected to still fill (0 when no room is kept)."""
        if self.growth is None:
            return 0
        return self.growth.reserved_blocks(self.running, self.pool.block_size)

    def _growth_headroom(self) -> int:
        """Free blocks less those the running requests are expected to still fill."""
        return self.pool.num_free_blocks - self.reserved_blocks()

    def _victims(self, i: int) -> list[Request]:
        """The newest running sequence, with the rest of its group not yet scheduled in
        this step (`running[i:]`), newest first."""
        last = self.running[-1]
        if last.parent is None:
            return [last]
        return [r for r in reversed(self.running[i:]) if r.parent is last.parent]

    def _swap_in_unit(self) -> list[Request]:
        """The first swapped sequence with its group's other swapped sequences (they may
        share CPU blocks, and share again on the GPU), as many as max_num_seqs leaves room
        for; empty while they do not fit."""
        assert self.swap_space is not None
        head = self.swapped[0]
        unit = [head]
        if head.parent is not None:
            unit = [r for r in self.swapped if r.parent is head.parent]
            unit = unit[: max(self.max_num_seqs - len(self.running), 1)]
        if self.running:  # blocks will come free: wait for room for the whole group
            return unit if self.swap_space.can_swap_in(self.pool, unit) else []
        # Nothing runs: sequences swapped out apart share nothing and may never fit at once.
        while unit and not self.swap_space.can_swap_in(self.pool, unit):
            unit.pop()
        return unit

    def _preempt(self, victims: list[Request], out: SchedulerOutput) -> None:
        for req in victims:
            self.running.remove(req)
            req.spec_token_ids = []
            req.spec_draft_probs = None
            self.num_preemptions += 1
            req.metrics.num_preemptions += 1
            out.preempted.append(req)
        if self.preemption_mode == "swap" and self.swap_space is not None:
            pairs = self.swap_space.swap_out(self.pool, victims)
            if pairs is not None:
                out.blocks_to_swap_out += pairs
                for req in victims:
                    req.status = RequestStatus.SWAPPED
                    self.swapped.append(req)
                # num_draft_computed_tokens stays: the runner swaps the draft's K/V out
                # and back with the target's, in the same blocks.
                self.num_swaps_out += len(victims)
                return
        # Recompute: the tokens stay, their K/V is dropped (prefix-cached blocks may survive).
        for req in victims:
            self.pool.free(req)
            req.num_computed_tokens = 0
            req.num_draft_computed_tokens = 0  # the draft's K/V goes with the blocks
            req.status = RequestStatus.WAITING
        group = victims[0].parent
        if group is None:
            self.waiting.appendleft(victims[0])
            return
        # A group's sequences come back by forking from one that holds the prompt again.
        self.parked.extend(sorted(victims, key=lambda r: r.index))
        self._requeue_orphans(group)

    # ---------------------------------------------------------------- checks
    def check_integrity(self) -> None:
        holders = [*self.running, *self.waiting, *self.swapped]
        self.pool.check_integrity(holders)
        for req in [*self.waiting, *self.parked]:
            assert not req.block_table, f"waiting request {req.request_id} holds blocks"
            assert req.status == RequestStatus.WAITING
        for req in self.swapped:
            assert not req.block_table, f"swapped request {req.request_id} holds GPU blocks"
        for req in self.parked:
            assert req.parent is not None, f"{req.request_id} is parked but has no group"
            assert self._holds_or_will_hold_prompt(req.parent), (
                f"{req.request_id} is parked but nothing of its group holds the prompt"
            )
        if self.swap_space is not None:
            self.swap_space.check_integrity()
            assert set(self.swap_space.tables) == set(self.swapped)
        assert len(self.running) <= self.max_num_seqs
        seqs = [*holders, *self.parked]
        assert len({id(r) for r in seqs}) == len(seqs), "a sequence is queued twice"
        assert {r.request_id for r in seqs} == set(self.requests), "a request is lost"
        for req in seqs:
            first = req.siblings[0]
            assert self.requests[req.request_id] is first, f"{req.request_id} is mapped wrongly"
