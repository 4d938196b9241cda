"""The scheduler's growth reserve: admission keeps KV room so running requests need not be
preempted to grow, while a lone request is always admitted."""

from __future__ import annotations

import random

from asyncengine.block_pool import BlockPool
from asyncengine.request import Request, RequestStatus
from asyncengine.sampling_params import SamplingParams
from asyncengine.scheduler import Scheduler


def run(reserve_tokens: int, num_blocks: int = 40) -> tuple[Scheduler, int]:
    pool = BlockPool(num_blocks, 4, enable_prefix_caching=False)
    sched = Scheduler(pool, max_num_seqs=16, max_num_batched_tokens=64,
                      growth_reserve_tokens=reserve_tokens)
    rnd = random.Random(0)
    for i in range(12):
        prompt = [rnd.randrange(100) for _ in range(10)]
        sched.add_request(Request(request_id=str(i), prompt=None, prompt_token_ids=prompt,
                                  params=SamplingParams(max_tokens=20), max_tokens=20))
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps += 1
        assert out.scheduled, "no progress"
        for s in out.scheduled:
            req, sample = s.request, s.needs_logits
            req.num_computed_tokens += s.num_new_tokens
            if sample:
                req.append_token(rnd.randrange(100))
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
        sched.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks
    return sched, steps


def test_full_reserve_avoids_preemption() -> None:
    without, _ = run(0)
    assert without.num_preemptions > 0
    with_reserve, _ = run(20)  # each request's whole max_tokens is reserved
    assert with_reserve.num_preemptions == 0


def test_reserve_larger_than_pool_still_admits_one_request() -> None:
    sched, _ = run(10_000, num_blocks=8)  # one request needs 8 blocks: it runs alone
    assert sched.num_preemptions == 0
