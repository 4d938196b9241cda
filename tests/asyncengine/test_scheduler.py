"""Scheduler: FCFS admission, the token budget, max_num_seqs, chunked prefill mixed with
decodes, preemption of the newest request (recompute and swap), swapped-before-waiting, room
kept for growth at admission, and a stateful property test that plays the engine's part
without a model."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asyncengine.admission import GrowthEstimate
from asyncengine.block_pool import BlockPool, SwapSpace
from asyncengine.request import ParentRequest, Request, RequestStatus
from asyncengine.request_check import parallel_blocks
from asyncengine.sampling_params import SamplingParams
from asyncengine.scheduler import Scheduler, SchedulerOutput
from tests.asyncengine.test_block_pool import KVShadow

BS = 4
_ids = itertools.count()


def make_request(num_prompt: int, max_tokens: int = 8, tokens: list[int] | None = None) -> Request:
    n = next(_ids)
    # Distinct tokens per request unless given: no accidental prefix-cache hits.
    ids = tokens if tokens is not None else [1000 * n + i for i in range(num_prompt)]
    return Request(f"r{n}", None, ids, SamplingParams(), max_tokens)


def make_scheduler(
    num_blocks: int = 64,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    preemption_mode: str = "recompute",
    num_cpu_blocks: int = 64,
    enable_prefix_caching: bool = True,
    growth: GrowthEstimate | None = None,
) -> Scheduler:
    pool = BlockPool(num_blocks, BS, enable_prefix_caching)
    swap = SwapSpace(num_cpu_blocks) if preemption_mode == "swap" else None
    return Scheduler(
        pool,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        preemption_mode=preemption_mode,  # type: ignore[arg-type]
        swap_space=swap,
        growth=growth,
    )


def finish_step(sched: Scheduler, out: SchedulerOutput, token: int = 1) -> None:
    """What the engine does after the model ran: advance, cache, sample, stop at max_tokens."""
    for s in out.scheduled:
        req = s.request
        needs_logits = s.needs_logits
        req.num_computed_tokens += s.num_new_tokens
        sched.pool.cache_full_blocks(req)
        if needs_logits:
            req.append_token(token)
            if req.num_output_tokens >= req.max_tokens:
                sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
    sched.check_integrity()


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    finish_step(sched, out)
    return out


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def scheduled(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


# ----------------------------------------------------------------- admission
def test_admission_is_first_come_first_served() -> None:
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(5) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = step(sched)
    assert scheduled(out) == [(reqs[0].request_id, 5), (reqs[1].request_id, 5)]
    assert ids(sched.waiting) == [reqs[2].request_id]
    assert reqs[0].status == RequestStatus.RUNNING


def test_a_request_that_does_not_fit_blocks_later_ones() -> None:
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    first, big, small = make_request(12), make_request(16), make_request(2)
    for r in (first, big, small):
        sched.add_request(r)
    out = sched.schedule()
    # 3 blocks for the first; the big one needs 4 of the 3 left, and the small one must wait
    # behind it rather than jump the queue.
    assert scheduled(out) == [(first.request_id, 12)]
    assert ids(sched.waiting) == [big.request_id, small.request_id]


def test_token_budget_chunks_the_prompt() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b, c = make_request(7), make_request(7), make_request(3)
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    assert scheduled(out) == [(a.request_id, 7), (b.request_id, 3)]
    assert out.num_batched_tokens == 10
    assert [s.needs_logits for s in out.scheduled] == [True, False]
    assert ids(sched.waiting) == [c.request_id]  # no budget left for it
    finish_step(sched, out)
    out = sched.schedule()
    # a decodes one token, b finishes its prompt, c gets the rest of the budget.
    assert scheduled(out) == [(a.request_id, 1), (b.request_id, 4), (c.request_id, 3)]
    assert out.num_batched_tokens == 8


def test_max_num_seqs_is_respected() -> None:
    sched = make_scheduler(max_num_seqs=3)
    for _ in range(5):
        sched.add_request(make_request(2, max_tokens=4))
    for _ in range(3):
        out = step(sched)
        assert len(out.scheduled) == 3
        assert len(sched.running) == 3
        assert len(sched.waiting) == 2


def test_chunked_prefill_mixes_with_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    short = make_request(3, max_tokens=10)
    sched.add_request(short)
    step(sched)
    long = make_request(20)
    sched.add_request(long)
    for chunk in (7, 7, 6):
        out = sched.schedule()
        assert scheduled(out) == [(short.request_id, 1), (long.request_id, chunk)]
        assert [s.needs_logits for s in out.scheduled] == [True, chunk == 6]
        assert out.num_batched_tokens == 1 + chunk
        finish_step(sched, out)
    assert long.num_computed_tokens == 20 and long.num_output_tokens == 1


def test_prefix_hit_on_admission() -> None:
    sched = make_scheduler()
    prefix = list(range(100, 112))
    first = make_request(0, tokens=[*prefix, 1])
    sched.add_request(first)
    step(sched)
    second = make_request(0, tokens=[*prefix, 2, 3])
    sched.add_request(second)
    out = sched.schedule()
    assert scheduled(out)[-1] == (second.request_id, 2)  # 3 blocks of 4 came from the cache
    assert second.metrics.num_cached_prompt_tokens == 12
    assert second.block_table[:3] == first.block_table[:3]
    assert sched.pool.prefix_hits == 12


# ------------------------------------------------------------ parallel sampling
def make_parallel(num_prompt: int, n: int, max_tokens: int = 8) -> list[Request]:
    """The n sequences of one request, as LLMEngine.add_request makes them."""
    first = make_request(num_prompt, max_tokens)
    seqs = [first] + [
        Request(first.request_id, None, first.prompt_token_ids, first.params, max_tokens,
                index=i)
        for i in range(1, n)
    ]
    ParentRequest.link(seqs)
    return seqs


def test_parallel_request_prefills_the_prompt_once_then_forks() -> None:
    sched = make_scheduler(num_blocks=16)
    a, b, c = make_parallel(10, 3)
    for seq in (a, b, c):
        sched.add_request(seq)
    assert ids(sched.waiting) == [a.request_id] and sched.parked == [b, c]
    out = step(sched)
    assert scheduled(out) == [(a.request_id, 10)]  # the prompt, once
    prompt_blocks = list(a.block_table)
    out = sched.schedule()
    # a decodes; b and c share its blocks and recompute only the prompt's last token,
    # each copying the partial last block on that first write.
    assert [(s.request.index, s.num_new_tokens) for s in out.scheduled] == [(0, 1), (1, 1),
                                                                           (2, 1)]
    assert out.blocks_to_copy == [(prompt_blocks[2], b.block_table[2]),
                                  (prompt_blocks[2], c.block_table[2])]
    assert b.block_table[:2] == c.block_table[:2] == prompt_blocks[:2]
    assert [sched.pool.ref_counts[blk] for blk in prompt_blocks] == [3, 3, 1]
    assert sched.running == [a, b, c] and sched.parked == []
    assert sched.pool.num_used_blocks == 5
    finish_step(sched, out)
    while sched.has_unfinished_requests():
        step(sched)
    assert [s.num_output_tokens for s in (a, b, c)] == [8, 8, 8]
    assert sched.pool.num_free_blocks == 16


def test_recompute_preemption_parks_a_group_and_forks_it_again() -> None:
    sched = make_scheduler(num_blocks=7)
    old = make_request(8, max_tokens=12)
    sched.add_request(old)
    step(sched)
    seqs = make_parallel(6, 2, max_tokens=10)
    for seq in seqs:
        sched.add_request(seq)
    preempted: list[Request] = []
    refork = False
    for _ in range(80):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        preempted += out.preempted
        if seqs[0] in out.preempted:
            # Nothing of the group holds the prompt: one sequence prefills it again.
            assert seqs[0] in sched.waiting and seqs[1] in sched.parked
        if any(s.request is seqs[1] and s.request.num_computed_tokens == 5 for s in
               out.scheduled) and seqs[1].num_output_tokens:
            refork = True  # forked again, its own tokens recomputed after the shared prompt
        finish_step(sched, out)
    assert not sched.has_unfinished_requests()
    assert set(preempted) >= set(seqs) and refork
    assert [s.num_output_tokens for s in (old, *seqs)] == [12, 10, 10]
    assert sched.pool.num_free_blocks == 7


def test_swap_preemption_moves_a_group_and_its_shared_blocks_once() -> None:
    sched = make_scheduler(num_blocks=9, preemption_mode="swap", max_num_batched_tokens=64)
    old = make_request(8, max_tokens=12)
    sched.add_request(old)
    step(sched)
    seqs = make_parallel(9, 3, max_tokens=12)
    for seq in seqs:
        sched.add_request(seq)
    step(sched)  # the prompt
    step(sched)  # the forks: 2 shared full blocks, 3 tails
    shared = seqs[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in seqs)
    assert sched.pool.num_free_blocks == 9 - 3 - 5
    while True:
        out = sched.schedule()
        if out.preempted:
            break
        finish_step(sched, out)
    assert set(out.preempted) == set(seqs) and scheduled(out) == [(old.request_id, 1)]
    assert sched.swap_space is not None
    # The shared blocks went to CPU once and stay shared there.
    assert len(out.blocks_to_swap_out) == 2 + 3
    assert all(sched.swap_space.tables[s][:2] == sched.swap_space.tables[seqs[0]][:2]
               for s in seqs)
    finish_step(sched, out)
    while not (out := step(sched)).blocks_to_swap_in:
        pass
    assert len(out.blocks_to_swap_in) == 5  # back in one piece, sharing again
    assert all(s.block_table[:2] == seqs[0].block_table[:2] for s in seqs)
    while sched.has_unfinished_requests():
        step(sched)
    assert [s.num_output_tokens for s in seqs] == [12, 12, 12]
    assert sched.pool.num_free_blocks == 9


# ---------------------------------------------------------------- preemption
def _fill_pool(mode: str) -> tuple[Scheduler, list[Request]]:
    """Three decoding requests that fill a 6-block pool exactly, so the next token needs room."""
    sched = make_scheduler(num_blocks=6, preemption_mode=mode, max_num_batched_tokens=64)
    reqs = [make_request(8, max_tokens=6) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = step(sched)  # 8 prompt tokens each: 2 full blocks each, all 6 used
    assert len(out.scheduled) == 3 and sched.pool.num_free_blocks == 0
    return sched, reqs


def test_preemption_recompute_takes_the_newest() -> None:
    sched, (a, b, c) = _fill_pool("recompute")
    out = sched.schedule()
    # a's sampled token (position 8) needs a third block: c (newest) gives its blocks back
    # and starts over.
    assert ids(out.preempted) == [c.request_id]
    assert scheduled(out) == [(a.request_id, 1), (b.request_id, 1)]
    assert c.status == RequestStatus.WAITING and ids(sched.waiting)[0] == c.request_id
    assert c.block_table == [] and c.num_computed_tokens == 0
    assert c.num_tokens == 9  # its sampled token is kept and recomputed
    assert c.metrics.num_preemptions == 1 and sched.num_preemptions == 1
    assert out.blocks_to_swap_out == []
    finish_step(sched, out)


def test_preemption_swap_takes_the_newest() -> None:
    sched, (a, b, c) = _fill_pool("swap")
    c_blocks = list(c.block_table)
    out = sched.schedule()
    assert ids(out.preempted) == [c.request_id]
    assert scheduled(out) == [(a.request_id, 1), (b.request_id, 1)]
    assert c.status == RequestStatus.SWAPPED and ids(sched.swapped) == [c.request_id]
    assert c.block_table == [] and c.num_computed_tokens == 8  # progress is kept
    assert [g for g, _ in out.blocks_to_swap_out] == c_blocks
    assert sched.swap_space is not None
    assert sched.swap_space.tables[c] == [cpu for _, cpu in out.blocks_to_swap_out]
    assert sched.num_swaps_out == 1
    finish_step(sched, out)


def test_swap_falls_back_to_recompute_when_swap_space_is_full() -> None:
    sched = make_scheduler(num_blocks=6, preemption_mode="swap", num_cpu_blocks=1)
    reqs = [make_request(8, max_tokens=6) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    step(sched)
    out = sched.schedule()
    assert ids(out.preempted) == [reqs[2].request_id]
    assert reqs[2].status == RequestStatus.WAITING and reqs[2].num_computed_tokens == 0
    assert out.blocks_to_swap_out == [] and sched.num_swaps_out == 0
    finish_step(sched, out)


def test_a_request_can_preempt_itself() -> None:
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=4)
    old, new = make_request(4, max_tokens=9), make_request(12, max_tokens=1)
    sched.add_request(old)
    step(sched)
    sched.add_request(new)
    assert scheduled(step(sched)) == [(old.request_id, 1), (new.request_id, 3)]
    assert scheduled(step(sched)) == [(old.request_id, 1), (new.request_id, 3)]
    assert sched.pool.num_free_blocks == 0
    out = sched.schedule()
    # new (the newest, and the one short of a block) gives way to itself; old goes on.
    assert ids(out.preempted) == [new.request_id]
    assert scheduled(out) == [(old.request_id, 1)]
    assert new.status == RequestStatus.WAITING and new.num_computed_tokens == 0
    finish_step(sched, out)
    for _ in range(30):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert not sched.has_unfinished_requests()
    assert old.num_output_tokens == 9 and new.num_output_tokens == 1
    assert sched.pool.num_free_blocks == 4


def test_swapped_requests_return_before_waiting_ones_are_admitted() -> None:
    sched, (_, _, c) = _fill_pool("swap")
    out = step(sched)
    assert ids(out.preempted) == [c.request_id]
    late = make_request(2)
    sched.add_request(late)
    assert sched.swap_space is not None
    for _ in range(60):
        swapped_before = list(sched.swapped)
        cpu_tables = dict(sched.swap_space.tables)
        out = sched.schedule()
        back = [r for r in swapped_before if r not in sched.swapped]
        # Swapped-in requests run in the same step, their blocks copied back from CPU.
        assert set(ids(back)) <= set(ids(s.request for s in out.scheduled))
        assert sorted(cpu for cpu, _ in out.blocks_to_swap_in) == sorted(
            cpu for r in back for cpu in cpu_tables[r]
        )
        if late.status == RequestStatus.RUNNING:
            assert not sched.swapped, "admitted while a swapped request waits"
            break
        assert late.status == RequestStatus.WAITING
        finish_step(sched, out)
    assert late.status == RequestStatus.RUNNING
    assert c.status != RequestStatus.SWAPPED
    assert sched.num_swaps_in >= 1


def test_swap_in_of_a_request_preempted_mid_prefill_fits_its_chunk() -> None:
    """Regression: a request swapped out mid-prefill came back with room for one block only
    and asked for a whole budget's chunk, tripping an assertion in schedule()."""
    sched = make_scheduler(num_blocks=9, max_num_batched_tokens=14, preemption_mode="swap")
    old = make_request(10, max_tokens=15)
    sched.add_request(old)
    step(sched)  # old: 3 blocks
    new = make_request(33, max_tokens=1)
    sched.add_request(new)
    assert scheduled(step(sched)) == [(old.request_id, 1), (new.request_id, 13)]
    out = step(sched)  # new's next chunk needs 3 more blocks of the 2 left: it swaps itself
    assert ids(out.preempted) == [new.request_id]
    out = sched.schedule()  # old takes a 4th block; 5 are free, new has 4 on CPU
    assert len(out.blocks_to_swap_in) == 4
    # 4 blocks back + the one free block: 20 slots for 13 computed tokens, a chunk of 7.
    assert scheduled(out) == [(old.request_id, 1), (new.request_id, 7)]
    assert len(new.block_table) == 5
    finish_step(sched, out)
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.pool.num_free_blocks == 9


# ----------------------------------------------------------------- finishing
@pytest.mark.parametrize("where", ["waiting", "running", "swapped"])
def test_finish_request_frees_blocks_from_any_queue(where: str) -> None:
    sched, (a, _, c) = _fill_pool("swap")
    if where == "swapped":
        step(sched)
        assert c.status == RequestStatus.SWAPPED
    target = {"waiting": make_request(3), "running": a, "swapped": c}[where]
    if where == "waiting":
        sched.add_request(target)
    sched.finish_request(target, RequestStatus.FINISHED_ABORTED)
    assert target.status == RequestStatus.FINISHED_ABORTED and target.block_table == []
    assert target.request_id not in sched.requests
    assert sched.swap_space is not None and target.request_id not in sched.swap_space.tables
    sched.check_integrity()


# ------------------------------------------------------------ room for growth
def run_to_completion(sched: Scheduler, reqs: list[Request]) -> int:
    """Add every request, step until all finish; returns the most that ran at once."""
    for r in reqs:
        sched.add_request(r)
    peak = 0
    while sched.has_unfinished_requests():
        step(sched)
        peak = max(peak, len(sched.running))
    return peak


def test_admission_without_room_for_growth_preempts() -> None:
    # 8 requests of 8 prompt + 8 output tokens: 4 blocks each once done, 32 blocks in all,
    # in a pool of 16. Prompts alone fit 8 at once (2 blocks each), so all are admitted.
    sched = make_scheduler(num_blocks=16, max_num_seqs=8)
    peak = run_to_completion(sched, [make_request(8, max_tokens=8) for _ in range(8)])
    assert peak == 8
    assert sched.num_preemptions > 0


def test_admission_with_room_for_growth_never_preempts() -> None:
    # The same requests with the whole growth reserved: 4 run at once, none is preempted.
    sched = make_scheduler(num_blocks=16, max_num_seqs=8, growth=GrowthEstimate(ratio=1.0))
    peak = run_to_completion(sched, [make_request(8, max_tokens=8) for _ in range(8)])
    assert peak == 4
    assert sched.num_preemptions == 0


def test_conservativeness_zero_admits_as_without_reserve() -> None:
    sched = make_scheduler(num_blocks=16, max_num_seqs=8,
                           growth=GrowthEstimate(conservativeness=0.0))
    assert sched.growth is None
    peak = run_to_completion(sched, [make_request(8, max_tokens=8) for _ in range(8)])
    assert peak == 8 and sched.num_preemptions > 0


def test_a_lone_request_is_admitted_whatever_its_growth() -> None:
    # Its prompt fits but prompt + max_tokens does not: with nothing running, it goes in
    # (nothing else could free room for it), and runs until the pool is full.
    sched = make_scheduler(num_blocks=4, max_num_seqs=4, growth=GrowthEstimate(ratio=1.0))
    big = make_request(8, max_tokens=40)
    sched.add_request(big)
    out = sched.schedule()
    assert scheduled(out) == [(big.request_id, 8)]


def test_held_back_requests_wait_in_order_and_steps_relax_the_ratio() -> None:
    growth = GrowthEstimate(ratio=1.0, min_ratio=0.1)
    sched = make_scheduler(num_blocks=16, max_num_seqs=8, growth=growth)
    reqs = [make_request(8, max_tokens=8) for _ in range(6)]
    for r in reqs:
        sched.add_request(r)
    out = step(sched)
    assert scheduled(out) == [(r.request_id, 8) for r in reqs[:4]]
    assert ids(sched.waiting) == ids(reqs[4:])
    # Held back without a preemption: admission grows bolder, a step at a time.
    assert growth.ratio == pytest.approx(1.0 - growth.decay)


def test_requests_that_run_to_max_tokens_stop_the_preemptions() -> None:
    # Bold admission (ratio 0.1) into a pool that cannot hold every output preempts, until
    # finished requests show that outputs use all of max_tokens: from then on admission
    # reserves all of it, and the second half of the requests runs without a preemption.
    growth = GrowthEstimate(ratio=0.1, min_ratio=0.1)
    sched = make_scheduler(num_blocks=16, max_num_seqs=8, growth=growth)
    run_to_completion(sched, [make_request(8, max_tokens=8) for _ in range(8)])
    assert sched.num_preemptions > 0
    assert growth.used == pytest.approx(1.0) and growth.ratio == 1.0
    before = sched.num_preemptions
    peak = run_to_completion(sched, [make_request(8, max_tokens=8) for _ in range(8)])
    assert sched.num_preemptions == before
    assert peak == 4


# ---------------------------------------------------------- stateful property
ALPHABET = 3  # few token ids, so prompts share prefixes and hit the cache


class SchedulerMachine(RuleBasedStateMachine):
    """The engine's loop without a model: add, step (schedule, 'run', sample), abort.

    A shadow of the KV cache follows every block move and write, so after each step every
    request must read back its own tokens (on the GPU or in swap space).
    """

    preemption_mode = "recompute"

    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler
        self.kv: KVShadow
        self.rng = random.Random(0)
        self.history: list[list[int]] = []
        self.added: list[Request] = []

    @initialize(
        num_blocks=st.integers(3, 12),
        max_num_seqs=st.integers(1, 4),
        budget=st.integers(1, 20),
        num_cpu_blocks=st.integers(1, 16),
        prefix_caching=st.booleans(),
        seed=st.integers(0, 2**16),
        # Admission's room for growth: none, or the estimate at several conservativenesses.
        conservativeness=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    )
    def setup(self, num_blocks: int, max_num_seqs: int, budget: int, num_cpu_blocks: int,
              prefix_caching: bool, seed: int, conservativeness: float) -> None:
        self.sched = make_scheduler(
            num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
            preemption_mode=self.preemption_mode, num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=prefix_caching,
            growth=GrowthEstimate(conservativeness=conservativeness),
        )
        self.kv = KVShadow(num_blocks, num_cpu_blocks, BS)
        self.rng = random.Random(seed)  # the "model": sampled tokens

    @property
    def capacity(self) -> int:
        return self.sched.pool.num_blocks * BS

    @rule(data=st.data())
    def add(self, data: st.DataObject) -> None:
        # As LLMEngine.add_request: prompt + max_tokens must fit the pool (all n samples).
        total = data.draw(st.integers(2, min(self.capacity, 40)), label="total")
        num_prompt = data.draw(st.integers(1, total - 1), label="num_prompt")
        n = data.draw(st.integers(1, 3), label="n")
        while n > 1 and parallel_blocks(n, num_prompt, total - num_prompt, BS) > \
                self.sched.pool.num_blocks:
            n -= 1
        if self.history and data.draw(st.booleans(), label="share"):
            base = data.draw(st.sampled_from(self.history), label="base")
            keep = data.draw(st.integers(0, len(base)), label="keep")
            tokens = base[:keep]
        else:
            tokens = []
        tokens += [self.rng.randrange(ALPHABET) for _ in range(num_prompt - len(tokens))]
        tokens = tokens[:num_prompt]
        self.history.append(tokens)
        first = make_request(0, total - num_prompt, tokens)
        seqs = [first] + [
            Request(first.request_id, None, tokens, first.params, first.max_tokens, index=i)
            for i in range(1, n)
        ]
        if n > 1:
            ParentRequest.link(seqs)
            event("add: parallel request")
        for seq in seqs:
            self.added.append(seq)
            self.sched.add_request(seq)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        # Arrival order, a request once whatever its n (as LLMEngine.abort_request).
        rids = list(dict.fromkeys(r.request_id for r in self.added
                                  if r.request_id in self.sched.requests))
        rid = data.draw(st.sampled_from(rids), label="abort")
        seqs = self.sched.get_sequences(rid)
        event(f"abort {seqs[0].status.value}")
        for seq in seqs:
            self.sched.finish_request(seq, RequestStatus.FINISHED_ABORTED)
        assert all(s.block_table == [] for s in seqs) and rid not in self.sched.requests

    @rule()
    def step(self) -> None:
        self._step()

    def _step(self) -> SchedulerOutput:
        sched = self.sched
        before = (list(sched.running), list(sched.waiting), list(sched.swapped))
        out = sched.schedule()
        self._check_output(out, *before)
        # The runner's order: swap out, swap in, copy-on-write, then the forward pass writes.
        self.kv.swap_out(out.blocks_to_swap_out)
        self.kv.swap_in(out.blocks_to_swap_in)
        self.kv.copy(out.blocks_to_copy)
        for s in out.scheduled:
            req = s.request
            self.kv.write(req, req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens)
        for s in out.scheduled:
            req = s.request
            needs_logits = s.needs_logits
            req.num_computed_tokens += s.num_new_tokens
            sched.pool.cache_full_blocks(req)
            if needs_logits:
                req.append_token(self.rng.randrange(ALPHABET))
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
        if out.preempted:
            event("preempted")
        if out.blocks_to_swap_in:
            event("swapped in")
        if any(r.metrics.num_cached_prompt_tokens and r.parent is None for r in sched.running):
            event("prefix hit")
        if out.blocks_to_copy:
            event("copy on write")
        if any(s.request.parent is not None and s.request.index > 0 for s in out.scheduled):
            event("forked sample ran")
        return out

    def _check_output(self, out: SchedulerOutput, running_before: list[Request],
                      waiting_before: list[Request], swapped_before: list[Request]) -> None:
        sched = self.sched
        reqs = [s.request for s in out.scheduled]
        assert len({id(r) for r in reqs}) == len(reqs), "a request is scheduled twice"
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(reqs) <= sched.max_num_seqs
        for s in out.scheduled:
            req = s.request
            assert 1 <= s.num_new_tokens <= req.num_tokens_to_compute
            assert req.status == RequestStatus.RUNNING and req in sched.running
            assert len(req.block_table) * BS >= req.num_computed_tokens + s.num_new_tokens
        for req in out.preempted:
            assert req not in reqs
            assert req.status in (RequestStatus.WAITING, RequestStatus.SWAPPED)
        # First come, first served: admitted ones are a prefix of the queue, and only when
        # nothing was preempted and no swapped request is left behind.
        admitted = [r for r in waiting_before if r.status == RequestStatus.RUNNING]
        assert admitted == waiting_before[: len(admitted)]
        # Swapped sequences come back a request (its swapped sequences) at a time, in order.
        swapped_in = [r for r in swapped_before if r.status == RequestStatus.RUNNING]
        swapped_units = units(swapped_before)
        assert units(swapped_in) == swapped_units[: len(units(swapped_in))]
        if admitted:
            assert not out.preempted and not sched.swapped
        if swapped_in:
            assert not out.preempted
        # Victims are taken newest first, a request's unscheduled sequences together.
        preempted_units = units(out.preempted)
        assert preempted_units == units(running_before[::-1])[: len(preempted_units)]
        for r in out.preempted:
            if r.parent is not None:
                assert all(s in out.preempted for s in r.parent.seqs
                           if s in running_before and s not in reqs)

    @invariant()
    def consistent(self) -> None:
        sched = self.sched
        sched.check_integrity()
        for req in sched.running:
            self.kv.check_gpu(req)
        for req in sched.swapped:
            assert sched.swap_space is not None
            self.kv.check_cpu(req, sched.swap_space.tables[req])
        for req in [*sched.waiting, *sched.parked]:
            assert req.num_computed_tokens == 0 and req.status == RequestStatus.WAITING

    def teardown(self) -> None:
        sched = getattr(self, "sched", None)
        if sched is None:
            return
        # Liveness: with no new arrivals everything finishes. The oldest request is never a
        # victim of a newer one, so each step advances it by a token; it may have to redo
        # its tokens once after an earlier preemption, hence twice the work.
        # A parallel request's samples may wait for room to be forked (or for the prompt to
        # be prefilled again), so each sequence counts its whole work.
        live = [r for r in self.added if not r.is_finished]
        work = sum(r.num_prompt_tokens + r.max_tokens for r in live)
        bound = 2 * (work + len(live)) + 1
        steps = 0
        while sched.has_unfinished_requests():
            assert steps < bound, f"no progress after {steps} steps"
            out = self._step()
            self.consistent()
            steps += 1
            # Only a parallel request that preempted itself whole may leave a step empty.
            assert out.scheduled or not sched.has_unfinished_requests() or (
                out.preempted and all(r.parent is out.preempted[0].parent is not None
                                      for r in out.preempted)), "an empty step"
        assert sched.pool.num_free_blocks == sched.pool.num_blocks
        assert not sched.running and not sched.waiting and not sched.swapped
        assert not sched.parked
        if sched.swap_space is not None:
            assert sched.swap_space.num_free_blocks == sched.swap_space.num_blocks


def units(seqs: list[Request]) -> list[object]:
    """The requests of some sequences, each once, in order of first appearance."""
    return list(dict.fromkeys(r.parent if r.parent is not None else r for r in seqs))


class SwapSchedulerMachine(SchedulerMachine):
    preemption_mode = "swap"


_settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    # Rule draws that hit a disabled rule count as filtered; that is expected here.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
SchedulerMachine.TestCase.settings = _settings
SwapSchedulerMachine.TestCase.settings = _settings
TestSchedulerRecompute = SchedulerMachine.TestCase
TestSchedulerSwap = SwapSchedulerMachine.TestCase
