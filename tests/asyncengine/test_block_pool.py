"""BlockPool and SwapSpace: allocation, ref counts, prefix caching, eviction order,
copy-on-write, swapping, and a stateful property test that tracks what every block holds."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from asyncengine.block_pool import BlockPool, SwapSpace
from asyncengine.request import Request
from asyncengine.sampling_params import SamplingParams
from asyncengine.stats_collect import block_map
from asyncengine.stats_schema import BLOCK_CACHED, BLOCK_FREE, BLOCK_SHARED, BLOCK_USED

BS = 4  # block size used throughout: small, so a few tokens span several blocks

_ids = itertools.count()


def make_request(tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(f"req-{next(_ids)}", None, list(tokens), SamplingParams(), max_tokens)


def compute(pool: BlockPool, req: Request, num_new: int | None = None) -> None:
    """Allocate and 'run' the request's next `num_new` tokens (all of them by default)."""
    n = req.num_tokens_to_compute if num_new is None else num_new
    assert pool.allocate_slots(req, n) is not None
    req.num_computed_tokens += n
    pool.cache_full_blocks(req)


def admit(pool: BlockPool, req: Request) -> list[int]:
    """Admit a fresh request the way the scheduler does: prefix hits first, then the rest."""
    cached = pool.find_cached_blocks(req)
    remaining = req.num_tokens - len(cached) * BS
    assert pool.allocate_slots(req, remaining, cached) is not None
    req.num_computed_tokens += remaining
    pool.cache_full_blocks(req)
    return cached


def pool_state(pool: BlockPool) -> dict[str, Any]:
    return {
        "ref_counts": list(pool.ref_counts),
        "block_hash": list(pool.block_hash),
        "block_tokens": list(pool.block_tokens),
        "hash_to_block": dict(pool.hash_to_block),
        "free_plain": list(pool._free_plain),
        "free_cached": list(pool._free_cached),
        "draft_cached": list(pool.draft_cached),
    }


def run_draft(pool: BlockPool, req: Request, upto: int | None = None) -> None:
    """'Run' the draft model over the request's positions up to `upto` (all its known
    tokens by default), as the draft proposer does."""
    before = req.num_draft_computed_tokens
    req.num_draft_computed_tokens = req.num_tokens if upto is None else upto
    pool.cache_draft_blocks(req, before)


def draft_flags(pool: BlockPool, req: Request) -> list[bool]:
    return [pool.draft_cached[b] for b in req.block_table]


# ------------------------------------------------------------------ allocation
def test_allocate_and_free_return_every_block() -> None:
    pool = BlockPool(8, BS)
    req = make_request(list(range(10)))
    assert pool.allocate_slots(req, 10) == []
    assert len(req.block_table) == 3  # ceil(10 / 4)
    assert all(pool.ref_counts[b] == 1 for b in req.block_table)
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    pool.check_integrity([req])
    # Growing within the last block takes nothing; crossing into a new one takes one.
    req.num_computed_tokens = 10
    assert pool.allocate_slots(req, 2) == []
    assert len(req.block_table) == 3
    assert pool.allocate_slots(req, 3) == []
    assert len(req.block_table) == 4
    pool.free(req)
    assert req.block_table == []
    assert pool.num_free_blocks == 8
    pool.check_integrity([req])


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0, BS)


def test_fork_shares_blocks_and_counts_references() -> None:
    pool = BlockPool(8, BS)
    parent = make_request(list(range(8)))
    compute(pool, parent)
    child = make_request(parent.all_token_ids)
    pool.fork(parent, child)
    assert child.block_table == parent.block_table
    assert child.num_computed_tokens == parent.num_computed_tokens
    assert all(pool.ref_counts[b] == 2 for b in parent.block_table)
    pool.check_integrity([parent, child])
    pool.free(parent)
    assert all(pool.ref_counts[b] == 1 for b in child.block_table)
    assert pool.num_used_blocks == 2
    pool.check_integrity([child])
    pool.free(child)
    assert pool.num_free_blocks == 8


# ------------------------------------------------------------------ prefix cache
def test_prefix_hit_shares_full_blocks() -> None:
    pool = BlockPool(16, BS)
    first = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    compute(pool, first)
    second = make_request([1, 2, 3, 4, 5, 6, 7, 8, 20, 21])
    cached = pool.find_cached_blocks(second)
    assert cached == first.block_table[:2]
    assert pool.allocate_slots(second, second.num_tokens - 2 * BS, cached) == []
    assert second.num_computed_tokens == 2 * BS
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert [pool.ref_counts[b] for b in second.block_table] == [2, 2, 1]
    pool.check_integrity([first, second])


def test_hashes_are_chained_on_the_previous_block() -> None:
    pool = BlockPool(16, BS)
    compute(pool, make_request([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: the second block must not hit either.
    other = make_request([0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert pool.find_cached_blocks(other) == []


def test_last_known_token_is_never_served_from_the_cache() -> None:
    pool = BlockPool(16, BS)
    first = make_request(list(range(8)))
    compute(pool, first)
    assert len(pool.hash_to_block) == 2
    # Exactly the same 8 tokens: the second block holds the last token, whose logits we need.
    same = make_request(list(range(8)))
    assert pool.find_cached_blocks(same) == first.block_table[:1]
    longer = make_request([*range(8), 99])
    assert pool.find_cached_blocks(longer) == first.block_table[:2]


def test_prefix_cache_disabled_never_hits() -> None:
    pool = BlockPool(16, BS, enable_prefix_caching=False)
    first = make_request(list(range(9)))
    compute(pool, first)
    assert pool.hash_to_block == {}
    assert pool.find_cached_blocks(make_request(list(range(9)))) == []


def test_only_computed_blocks_are_cached() -> None:
    pool = BlockPool(16, BS)
    req = make_request(list(range(12)))
    assert pool.allocate_slots(req, 12) == []
    req.num_computed_tokens = 6  # the chunk computed so far covers one full block
    pool.cache_full_blocks(req)
    assert list(pool.hash_to_block.values()) == req.block_table[:1]
    assert req.num_hashed_blocks == 1


def test_freed_block_is_revived_by_a_hit() -> None:
    pool = BlockPool(4, BS)
    first = make_request(list(range(9)))
    compute(pool, first)
    table = list(first.block_table)
    pool.free(first)
    assert pool.num_cached_free_blocks == 2  # the partial third block holds no hash
    again = make_request(list(range(9)))
    assert admit(pool, again) == table[:2]
    assert pool.num_cached_free_blocks == 0
    pool.check_integrity([again])


def test_reset_prefix_cache_drops_free_cached_blocks_only() -> None:
    pool = BlockPool(8, BS)
    gone = make_request(list(range(9)))
    compute(pool, gone)
    held = make_request([40 + i for i in range(9)])
    compute(pool, held)
    pool.free(gone)
    assert pool.num_cached_free_blocks == 2
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_free_blocks == 0 and pool.num_free_blocks == 8 - 3
    assert pool.find_cached_blocks(make_request(list(range(9)))) == []
    # A block still held keeps its prefix: live and correct, it is found as before.
    assert pool.find_cached_blocks(make_request([40 + i for i in range(9)])) \
        == held.block_table[:2]
    pool.check_integrity([held])
    assert pool.reset_prefix_cache() == 0


def test_plain_free_blocks_are_used_before_cached_ones() -> None:
    pool = BlockPool(4, BS)
    req = make_request(list(range(5)))
    compute(pool, req)
    cached_block = req.block_table[0]
    pool.free(req)
    # 3 plain blocks and 1 cached: new work takes all the plain ones first.
    other = make_request([50 + i for i in range(12)])
    assert pool.allocate_slots(other, 12) == []
    assert cached_block not in other.block_table
    assert pool.hash_to_block  # the cached prefix survived
    assert pool.find_cached_blocks(make_request(list(range(5)))) == [cached_block]


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3, BS)
    reqs = [make_request([10 * k + i for i in range(5)]) for k in range(3)]
    for r in reqs:
        # One full, hashed block each; the partial second block is allocated only when used.
        compute(pool, r, BS)
    tables = [r.block_table[0] for r in reqs]
    order = [1, 0, 2]
    for k in order:
        pool.free(reqs[k])
    assert list(pool._free_cached) == [tables[k] for k in order]
    probe = make_request([99, 98, 97, 96])
    assert pool.allocate_slots(probe, 4) == []
    assert probe.block_table == [tables[1]]  # freed first, evicted first
    # Eviction drops the hash: the evicted prefix no longer hits, the others still do.
    assert pool.block_hash[tables[1]] is None
    assert tables[1] not in pool.hash_to_block.values()
    assert pool.find_cached_blocks(make_request(reqs[1].all_token_ids)) == []
    assert pool.find_cached_blocks(make_request(reqs[0].all_token_ids)) == [tables[0]]
    pool.check_integrity([probe])


def test_free_releases_the_tail_of_a_prefix_first() -> None:
    pool = BlockPool(3, BS)
    req = make_request(list(range(13)))
    compute(pool, req, 12)
    head, mid, tail = req.block_table
    pool.free(req)
    probe = make_request([90, 91, 92])
    assert pool.allocate_slots(probe, 3) == []
    assert probe.block_table == [tail]
    # The head and middle still form a hit of two blocks.
    assert pool.find_cached_blocks(make_request(list(range(10)))) == [head, mid]


def test_duplicate_content_is_not_hashed_twice() -> None:
    pool = BlockPool(8, BS)
    a = make_request(list(range(5)))
    b = make_request(list(range(5)))
    # Both computed without a hit (as in the same step): only the first block is registered.
    assert pool.allocate_slots(a, 5) == [] and pool.allocate_slots(b, 5) == []
    a.num_computed_tokens = b.num_computed_tokens = 5
    pool.cache_full_blocks(a)
    pool.cache_full_blocks(b)
    assert pool.hash_to_block == {pool.block_hash[a.block_table[0]]: a.block_table[0]}
    assert pool.block_hash[b.block_table[0]] is None
    pool.free(a)
    pool.free(b)
    pool.check_integrity([])


# ------------------------------------------------------- the draft model's half
def test_draft_passing_cached_blocks_marks_them() -> None:
    pool = BlockPool(16, BS)
    req = make_request(list(range(14)))
    compute(pool, req)  # three full blocks cached, before the draft ran
    assert draft_flags(pool, req) == [False] * 4
    run_draft(pool, req, 6)  # through block 0, into block 1
    assert draft_flags(pool, req) == [True, False, False, False]
    run_draft(pool, req)  # all 14: blocks 1 and 2; the partial one holds no hash
    assert draft_flags(pool, req) == [True, True, True, False]
    pool.check_integrity([req])


def test_a_block_the_draft_passed_first_is_marked_when_cached() -> None:
    pool = BlockPool(16, BS)
    req = make_request(list(range(9)))
    assert pool.allocate_slots(req, 9) == []
    run_draft(pool, req)  # the draft is ahead of the target: nothing hashed yet
    assert not any(pool.draft_cached)
    req.num_computed_tokens = 6
    pool.cache_full_blocks(req)
    assert draft_flags(pool, req) == [True, False, False]
    req.num_computed_tokens = 9
    pool.cache_full_blocks(req)
    assert draft_flags(pool, req) == [True, True, False]
    pool.check_integrity([req])


def test_a_block_cached_without_the_draft_is_not_trusted() -> None:
    pool = BlockPool(16, BS)
    plain = make_request(list(range(13)))
    compute(pool, plain)  # never drafted (an n-gram or non-speculating request)
    pool.free(plain)
    hit = make_request([*range(12), 50, 51])
    assert len(admit(pool, hit)) == 3
    assert hit.num_draft_computed_tokens == 0  # the draft recomputes the whole prompt
    # Once it has, the shared blocks hold the draft's K/V and serve the next hit.
    run_draft(pool, hit)
    nxt = make_request([*range(12), 60])
    assert len(admit(pool, nxt)) == 3
    assert nxt.num_draft_computed_tokens == 12
    pool.check_integrity([hit, nxt])


def test_a_hit_gets_the_leading_blocks_holding_the_draft_kv_and_keeps_them() -> None:
    pool = BlockPool(16, BS)
    first = make_request(list(range(17)))
    compute(pool, first)
    run_draft(pool, first, 9)  # blocks 0 and 1 only
    table = list(first.block_table)
    pool.free(first)
    again = make_request(list(range(17)))
    assert admit(pool, again) == table[:4]
    # Never past the first block without the draft's K/V, never past the hit.
    assert again.num_draft_computed_tokens == 2 * BS
    assert draft_flags(pool, again)[:4] == [True, True, False, False]  # kept on the hit
    run_draft(pool, again)
    pool.free(again)
    # A hit that stops early (the next token differs) takes only its own blocks' draft K/V.
    short = make_request([*range(6), 99, 98])
    assert admit(pool, short) == table[:1]
    assert short.num_draft_computed_tokens == BS
    # And a hit whose first block lacks it takes none, whatever follows.
    pool.draft_cached[table[0]] = False
    later = make_request(list(range(17)))
    assert admit(pool, later) == table[:4]
    assert later.num_draft_computed_tokens == 0
    pool.check_integrity([short, later])


def test_a_start_on_no_blocks_forgets_draft_kv_it_held_before() -> None:
    pool = BlockPool(8, BS)
    parent = make_request(list(range(9)))
    compute(pool, parent)
    run_draft(pool, parent)
    child = make_request(list(range(9)))
    pool.fork(parent, child, 8)
    assert child.num_draft_computed_tokens == 8
    pool.free(child)  # as a fork whose first chunk did not fit, back to waiting
    child.num_computed_tokens = 0
    pool.free(parent)
    pool.reset_prefix_cache()
    assert pool.find_cached_blocks(child) == []
    assert pool.allocate_slots(child, 9) == []  # no hit: its blocks hold no draft K/V
    assert child.num_draft_computed_tokens == 0
    pool.check_integrity([child])


def test_eviction_and_reset_clear_the_draft_mark() -> None:
    pool = BlockPool(3, BS)
    req = make_request(list(range(9)))
    compute(pool, req)
    run_draft(pool, req)
    head, mid, _ = req.block_table
    pool.free(req)
    assert pool.draft_cached[head] and pool.draft_cached[mid]
    probe = make_request([90, 91, 92, 93, 94])
    assert pool.allocate_slots(probe, 5) == []  # takes the plain block, then evicts
    assert mid in probe.block_table and not pool.draft_cached[mid]
    assert pool.draft_cached[head]
    assert pool.reset_prefix_cache() == 1
    assert not any(pool.draft_cached)
    pool.check_integrity([probe])


def test_a_reused_block_written_with_other_tokens_loses_the_mark() -> None:
    pool = BlockPool(8, BS)
    parent = make_request([1, 2, 3, 4, 5])
    compute(pool, parent)
    run_draft(pool, parent)
    cached = parent.block_table[0]
    assert pool.draft_cached[cached]
    child = make_request([1, 2, 3, 9])  # diverges inside the full, cached block
    pool.fork(parent, child, 3)
    pool.free(parent)
    assert pool.allocate_slots(child, 1) == []  # written in place by its only holder
    assert child.block_table == [cached] and not pool.draft_cached[cached]
    pool.check_integrity([child])


def test_only_blocks_under_the_requests_own_hash_are_marked() -> None:
    pool = BlockPool(8, BS)
    parent = make_request(list(range(8)))
    compute(pool, parent, 8)
    child = make_request([*range(6), 70, 71])  # shares block 1, full with other tokens
    pool.fork(parent, child, 6)
    run_draft(pool, child, 8)
    assert draft_flags(pool, child) == [True, False]
    pool.check_integrity([parent, child])


def test_copy_on_write_leaves_the_copy_unmarked_until_the_draft_passes_it() -> None:
    pool = BlockPool(8, BS)
    parent = make_request(list(range(6)))
    compute(pool, parent)
    run_draft(pool, parent)
    child = make_request([*range(5), 40, 42, 43])
    pool.fork(parent, child, 5)
    copies = pool.allocate_slots(child, 3)
    assert copies is not None and len(copies) == 1
    ((src, dst),) = copies
    child.num_computed_tokens += 3
    pool.cache_full_blocks(child)  # block 1 full now; the copy brought draft K/V up to 5
    assert pool.block_hash[dst] is not None and not pool.draft_cached[dst]
    assert pool.draft_cached[child.block_table[0]]
    child.num_draft_computed_tokens = 5  # (a fork starts at 0; here, what the copy holds)
    run_draft(pool, child)
    assert pool.draft_cached[dst] and not pool.draft_cached[src]
    pool.check_integrity([parent, child])


def test_a_fork_takes_the_parents_draft_kv_within_the_shared_positions() -> None:
    pool = BlockPool(8, BS)
    parent = make_request(list(range(10)))
    compute(pool, parent)
    run_draft(pool, parent, 7)
    early, late = make_request(list(range(5))), make_request(list(range(9)))
    pool.fork(parent, early, 5)
    pool.fork(parent, late, 9)
    assert (early.num_draft_computed_tokens, late.num_draft_computed_tokens) == (5, 7)
    pool.check_integrity([parent, early, late])


def test_no_draft_marks_without_prefix_caching() -> None:
    pool = BlockPool(8, BS, enable_prefix_caching=False)
    req = make_request(list(range(9)))
    compute(pool, req)
    run_draft(pool, req)
    assert not any(pool.draft_cached)


def test_check_integrity_refuses_a_draft_mark_without_a_hash() -> None:
    pool = BlockPool(4, BS)
    req = make_request(list(range(3)))
    compute(pool, req)
    pool.draft_cached[req.block_table[0]] = True
    with pytest.raises(AssertionError, match="draft-cached"):
        pool.check_integrity([req])


# ---------------------------------------------------------------- copy-on-write
def test_fork_then_write_into_shared_partial_block_copies() -> None:
    pool = BlockPool(8, BS)
    parent = make_request(list(range(6)))
    compute(pool, parent)
    parent_table = list(parent.block_table)
    child = make_request(parent.all_token_ids)
    pool.fork(parent, child)
    child.append_token(7)
    copies = pool.allocate_slots(child, 1)
    assert copies is not None and len(copies) == 1
    src, dst = copies[0]
    assert src == parent_table[1]
    assert dst not in parent_table
    assert parent.block_table == parent_table  # the parent keeps its block
    assert child.block_table == [parent_table[0], dst]
    assert pool.ref_counts[src] == 1 and pool.ref_counts[dst] == 1
    assert pool.ref_counts[parent_table[0]] == 2  # the full block stays shared
    pool.check_integrity([parent, child])
    # The parent is the sole owner now: its own next write copies nothing.
    parent.append_token(8)
    assert pool.allocate_slots(parent, 1) == []
    pool.check_integrity([parent, child])


def test_fork_at_block_boundary_needs_no_copy() -> None:
    pool = BlockPool(8, BS)
    parent = make_request(list(range(8)))
    compute(pool, parent)
    child = make_request(parent.all_token_ids)
    pool.fork(parent, child)
    child.append_token(1)
    assert pool.allocate_slots(child, 1) == []
    assert child.block_table[:2] == parent.block_table
    assert len(child.block_table) == 3


def test_fork_of_a_prefix_shares_only_its_blocks_and_copies_the_partial_one() -> None:
    pool = BlockPool(8, BS)
    parent = make_request(list(range(11)))
    compute(pool, parent)
    # A parallel sample forked at the prompt less its last token (the engine's fork point).
    child = make_request(parent.all_token_ids[:7])
    pool.fork(parent, child, 6)
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 6
    assert child.num_hashed_blocks == 1
    assert [pool.ref_counts[b] for b in parent.block_table] == [2, 2, 1]
    pool.check_integrity([parent, child])
    copies = pool.allocate_slots(child, 1)  # writes token 6 into the shared partial block
    assert copies is not None and [src for src, _ in copies] == [parent.block_table[1]]
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] != parent.block_table[1]
    child.num_computed_tokens += 1
    pool.check_integrity([parent, child])
    with pytest.raises(ValueError, match="cannot fork"):
        pool.fork(parent, make_request([0]), 12)
    with pytest.raises(ValueError, match="already holds blocks"):
        pool.fork(parent, child, 4)


def test_a_fork_writing_into_a_cached_block_it_alone_holds_uncaches_it() -> None:
    pool = BlockPool(8, BS)
    parent = make_request([1, 2, 3, 4, 5])
    compute(pool, parent)
    cached = parent.block_table[0]
    assert pool.block_hash[cached] is not None
    child = make_request([1, 2, 3, 9])  # a sample diverging inside the full, cached block
    pool.fork(parent, child, 3)
    pool.free(parent)
    assert pool.allocate_slots(child, 1) == []  # its only holder now: written in place
    child.num_computed_tokens += 1
    assert child.block_table == [cached] and pool.block_hash[cached] is None
    assert pool.find_cached_blocks(make_request([1, 2, 3, 4, 5])) == []
    pool.check_integrity([child])


def test_check_integrity_refuses_a_shared_block_written_next() -> None:
    pool = BlockPool(8, BS)
    parent = make_request(list(range(4)))
    compute(pool, parent)
    parent.append_token(9)
    assert pool.allocate_slots(parent, 1) == []  # a block reserved for token 4, not written
    child = make_request(parent.all_token_ids)
    child.block_table = list(parent.block_table)  # shares the reserved block: a bug
    child.num_computed_tokens = 4
    for b in child.block_table:
        pool.add_ref(b)
    with pytest.raises(AssertionError, match="writes into it next"):
        pool.check_integrity([parent, child])
    pool._unref(child.block_table[1])
    child.block_table = [child.block_table[1]]
    child.num_computed_tokens = 5
    with pytest.raises(AssertionError, match="table indexes"):
        pool.check_integrity([parent, child])


def test_sequences_swapped_together_keep_sharing() -> None:
    pool = BlockPool(10, BS)
    swap = SwapSpace(10)
    parent = make_request(list(range(10)))
    compute(pool, parent)
    child = make_request(parent.all_token_ids[:10])
    pool.fork(parent, child, 9)
    compute(pool, child)  # copies the partial third block, then writes token 9
    other = make_request(parent.all_token_ids)
    pool.fork(parent, other, 9)  # holds the parent's partial block too: nothing written yet
    seqs = [parent, child, other]
    pool.check_integrity(seqs)
    shared = parent.block_table[:2]
    tails = {parent.block_table[2], child.block_table[2]}
    pairs = swap.swap_out(pool, seqs)
    assert pairs is not None
    # Each distinct block once: the two shared ones, the parent's tail, the child's copy.
    assert len(pairs) == 4 and [g for g, _ in pairs][:2] == shared
    assert {g for g, _ in pairs[2:]} == tails
    assert pool.num_free_blocks == 10 and swap.num_free_blocks == 6
    assert swap.tables[parent][:2] == swap.tables[child][:2] == swap.tables[other][:2]
    swap.check_integrity()
    assert swap.can_swap_in(pool, seqs)  # 4 blocks + one spare per sequence
    back = swap.swap_in(pool, seqs)
    assert len(back) == 4 and swap.num_free_blocks == 10 and swap.tables == {}
    assert parent.block_table[:2] == child.block_table[:2] == other.block_table[:2]
    assert other.block_table[2] == parent.block_table[2] != child.block_table[2]
    assert [pool.ref_counts[b] for b in parent.block_table] == [3, 3, 2]
    pool.check_integrity(seqs)
    swap.check_integrity()
    # Swapped alone, a sequence's shared blocks are copied for it; discarding frees its own.
    assert swap.swap_out(pool, [child]) is not None
    assert [pool.ref_counts[b] for b in parent.block_table] == [2, 2, 2]
    swap.discard(child)
    assert swap.num_free_blocks == 10
    swap.check_integrity()


def test_copy_on_write_fails_cleanly_when_the_pool_is_full() -> None:
    pool = BlockPool(2, BS)
    parent = make_request(list(range(6)))
    compute(pool, parent)
    child = make_request(parent.all_token_ids)
    pool.fork(parent, child)
    child.append_token(3)
    before = pool_state(pool)
    assert pool.allocate_slots(child, 1) is None
    assert pool_state(pool) == before
    assert child.block_table == parent.block_table


# -------------------------------------------------------------------- failures
def test_allocate_slots_failure_leaves_everything_unchanged() -> None:
    pool = BlockPool(5, BS)
    holder = make_request(list(range(9)))
    compute(pool, holder)
    pool.free(holder)  # two cached free blocks, three plain ones
    hog = make_request([70 + i for i in range(8)])
    assert pool.allocate_slots(hog, 8) == []
    # A hit on both cached blocks plus 12 new tokens needs 2 revived + 3 new > 3 free.
    req = make_request([*range(8), *range(100, 112)])
    cached = pool.find_cached_blocks(req)
    assert len(cached) == 2
    before_pool, before_req = pool_state(pool), copy.deepcopy(
        (req.block_table, req.num_computed_tokens, req.num_hashed_blocks,
         req.num_draft_computed_tokens)
    )  # fmt: skip
    assert pool.allocate_slots(req, 12, cached) is None
    assert pool_state(pool) == before_pool
    assert (req.block_table, req.num_computed_tokens, req.num_hashed_blocks,
            req.num_draft_computed_tokens) == before_req  # fmt: skip
    # A smaller chunk fits.
    assert pool.allocate_slots(req, 4, cached) == []
    assert req.num_computed_tokens == 8
    pool.check_integrity([hog, req])


def test_cached_blocks_only_start_an_empty_table() -> None:
    pool = BlockPool(8, BS)
    first = make_request(list(range(9)))
    compute(pool, first)
    req = make_request(list(range(9)))
    cached = pool.find_cached_blocks(req)
    assert pool.allocate_slots(req, 1) == []
    with pytest.raises(ValueError, match="empty block table"):
        pool.allocate_slots(req, 1, cached)


# ------------------------------------------------------------------ swap space
def test_swap_out_and_in_round_trip() -> None:
    pool = BlockPool(6, BS)
    swap = SwapSpace(4)
    req = make_request(list(range(10)))
    compute(pool, req)
    gpu_before = list(req.block_table)
    out_pairs = swap.swap_out(pool, req)
    assert out_pairs is not None
    assert [g for g, _ in out_pairs] == gpu_before
    cpu_blocks = [c for _, c in out_pairs]
    assert len(set(cpu_blocks)) == 3
    assert req.block_table == [] and req.num_computed_tokens == 10
    assert pool.num_free_blocks == 6
    assert swap.num_free_blocks == 1
    swap.check_integrity()
    pool.check_integrity([req])

    assert swap.can_swap_in(pool, req)
    in_pairs = swap.swap_in(pool, req)
    assert [c for c, _ in in_pairs] == cpu_blocks
    assert [g for _, g in in_pairs] == req.block_table
    assert len(req.block_table) == 3
    assert swap.num_free_blocks == 4 and swap.tables == {}
    swap.check_integrity()
    pool.check_integrity([req])
    # Back on the GPU the request continues: one more token fits without trouble.
    req.append_token(5)
    assert pool.allocate_slots(req, 1) == []


def test_swap_space_exhaustion_returns_none_and_changes_nothing() -> None:
    pool = BlockPool(8, BS)
    swap = SwapSpace(2)
    req = make_request(list(range(10)))
    compute(pool, req)
    table = list(req.block_table)
    assert swap.swap_out(pool, req) is None
    assert req.block_table == table
    assert pool.num_used_blocks == 3
    assert swap.num_free_blocks == 2 and swap.tables == {}
    swap.check_integrity()


def test_swap_in_needs_a_spare_block() -> None:
    pool = BlockPool(3, BS)
    swap = SwapSpace(4)
    req = make_request(list(range(12)))
    compute(pool, req)
    assert swap.swap_out(pool, req) is not None
    hog = make_request([1])
    compute(pool, hog)
    assert not swap.can_swap_in(pool, req)  # 3 blocks back plus one for the next token
    pool.free(hog)
    assert swap.can_swap_in(pool, req) is False  # still only 3 blocks in all
    swap.discard(req)
    assert swap.num_free_blocks == 4
    swap.check_integrity()


# ------------------------------------------------------------------- integrity
def _busy_pool() -> tuple[BlockPool, list[Request]]:
    pool = BlockPool(8, BS)
    a = make_request(list(range(9)))
    compute(pool, a)
    b = make_request(list(range(20, 25)))
    compute(pool, b)
    pool.free(b)
    return pool, [a]


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda pool, reqs: pool.ref_counts.__setitem__(reqs[0].block_table[0], 2),
        lambda pool, reqs: pool.ref_counts.__setitem__(pool._free_plain[0], 1),
        lambda pool, reqs: pool._free_plain.append(pool._free_plain[0]),
        lambda pool, reqs: pool._free_plain.append(next(iter(pool._free_cached))),
        lambda pool, reqs: pool._free_plain.append(reqs[0].block_table[0]),
        lambda pool, reqs: pool.block_hash.__setitem__(pool._free_plain[0], 1234),
        lambda pool, reqs: pool.hash_to_block.pop(pool.block_hash[reqs[0].block_table[0]]),
        lambda pool, reqs: reqs[0].block_table.append(reqs[0].block_table[0]),
    ],
    ids=["ref-count", "free-but-referenced", "free-twice", "both-free-lists",
         "used-and-free", "plain-with-hash", "hash-map", "table-lists-twice"],
)
def test_check_integrity_catches_corruption(corrupt) -> None:
    pool, holders = _busy_pool()
    pool.check_integrity(holders)
    corrupt(pool, holders)
    with pytest.raises(AssertionError):
        pool.check_integrity(holders)


def test_swap_space_integrity_catches_a_leak() -> None:
    swap = SwapSpace(4)
    swap.check_integrity()
    swap._free.pop()
    with pytest.raises(AssertionError, match="leaked"):
        swap.check_integrity()


# ---------------------------------------------------------- stateful property
class KVShadow:
    """What each physical block would hold: the token id written to each slot, by the target
    and, in the block's second half, by the draft model.

    Applying the pool's copies to this shadow and checking that every request reads back its
    own tokens catches wrong prefix hits, missing copy-on-write and lost swaps alike.
    """

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.gpu: list[list[int | None]] = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu: list[list[int | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.draft_gpu: list[list[int | None]] = [[None] * block_size
                                                  for _ in range(num_gpu_blocks)]  # fmt: skip
        self.draft_cpu: list[list[int | None]] = [[None] * block_size
                                                  for _ in range(num_cpu_blocks)]  # fmt: skip

    def write(self, req: Request, start: int, end: int, *, draft: bool = False) -> None:
        bs = self.block_size
        blocks = self.draft_gpu if draft else self.gpu
        for pos in range(start, end):
            blocks[req.block_table[pos // bs]][pos % bs] = req.all_token_ids[pos]

    @staticmethod
    def _copy(src: list[list[int | None]], dst: list[list[int | None]],
              pairs: list[tuple[int, int]]) -> None:
        # All sources are read before any destination is written, as one batched copy does.
        moved = [list(src[s]) for s, _ in pairs]
        for (_, d), data in zip(pairs, moved, strict=True):
            dst[d] = data

    # Copies move both halves, as the model runner copies the draft's K/V too.
    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._copy(self.gpu, self.cpu, pairs)
        self._copy(self.draft_gpu, self.draft_cpu, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._copy(self.cpu, self.gpu, pairs)
        self._copy(self.draft_cpu, self.draft_gpu, pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        self._copy(self.gpu, self.gpu, pairs)
        self._copy(self.draft_gpu, self.draft_gpu, pairs)

    def check_gpu(self, req: Request) -> None:
        bs = self.block_size
        got = [self.gpu[req.block_table[p // bs]][p % bs] for p in range(req.num_computed_tokens)]
        assert got == req.all_token_ids[: req.num_computed_tokens], (
            f"{req.request_id} reads back wrong KV"
        )
        n = req.num_draft_computed_tokens
        got = [self.draft_gpu[req.block_table[p // bs]][p % bs] for p in range(n)]
        assert got == req.all_token_ids[:n], f"{req.request_id} reads back wrong draft KV"

    def check_draft_cached(self, pool: BlockPool) -> None:
        """A block marked as holding the draft's K/V holds it for the tokens of its hash."""
        for block, marked in enumerate(pool.draft_cached):
            if marked:
                want = list(pool.block_tokens[block] or ())
                assert self.gpu[block] == want, f"draft-cached block {block}: wrong KV"
                assert self.draft_gpu[block] == want, f"draft-cached block {block}: wrong draft KV"

    def check_cpu(self, req: Request, cpu_blocks: list[int]) -> None:
        bs = self.block_size
        got = [self.cpu[cpu_blocks[p // bs]][p % bs] for p in range(req.num_computed_tokens)]
        assert got == req.all_token_ids[: req.num_computed_tokens], (
            f"{req.request_id} swapped KV is wrong"
        )
        n = req.num_draft_computed_tokens
        got = [self.draft_cpu[cpu_blocks[p // bs]][p % bs] for p in range(n)]
        assert got == req.all_token_ids[:n], f"{req.request_id} swapped draft KV is wrong"


TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=18)  # tiny alphabet: prefixes repeat
MAX_LEN = 28  # tokens per request, prompt and samples
MAX_LIVE = 5  # live requests at once
NUM_GPU_BLOCKS = 10
NUM_CPU_BLOCKS = 8
SEL = st.integers(0, 10**6)  # picks among the current requests (modulo their number)


class BlockPoolMachine(RuleBasedStateMachine):
    """Random add / allocate / compute / draft / fork / free / swap sequences on a small pool.

    A request's tokens are computed in two stages as in the engine: `allocate` reserves
    slots for a chunk (prefix hits first for a fresh request), `compute` writes the chunk,
    registers full blocks and, at the last known token, appends a sampled token. `draft`
    runs the draft model over a request's known tokens it lacks, as far as its slots go and
    at most one past the target (as a proposal runs it over the token the target computes
    next); swaps keep the draft's K/V with the target's.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_GPU_BLOCKS, BS)
        self.swap = SwapSpace(NUM_CPU_BLOCKS)
        self.kv = KVShadow(NUM_GPU_BLOCKS, NUM_CPU_BLOCKS, BS)
        self.on_gpu: list[Request] = []
        self.swapped: list[Request] = []
        self.pending: dict[str, int] = {}  # request_id -> allocated, not yet computed tokens
        self.history: list[list[int]] = []  # every prompt so far, to derive shared prefixes

    # Candidates for each rule; a rule is enabled only when it has one.
    def _idle(self) -> list[Request]:
        return [r for r in self.on_gpu if r.request_id not in self.pending]

    def _to_allocate(self) -> list[Request]:
        return [r for r in self._idle() if r.num_tokens_to_compute]

    def _to_compute(self) -> list[Request]:
        return [r for r in self.on_gpu if r.request_id in self.pending]

    def _to_fork(self) -> list[Request]:
        return [r for r in self._idle() if r.num_computed_tokens] if self._room() else []

    def _to_swap_out(self) -> list[Request]:
        return [r for r in self._idle() if r.block_table]

    def _room(self) -> bool:
        # Few live requests at a time, so the steps go to computing them.
        return len(self.on_gpu) + len(self.swapped) < MAX_LIVE

    def _add(self, tokens: list[int]) -> None:
        self.history.append(tokens)
        self.on_gpu.append(make_request(tokens))

    @initialize(prefix=TOKENS, suffixes=st.lists(st.tuples(TOKENS, st.booleans()),
                                                 min_size=1, max_size=3))  # fmt: skip
    def warm_cache(self, prefix: list[int], suffixes: list[tuple[list[int], bool]]) -> None:
        """Start from a used pool: requests sharing a prefix, computed (some drafted over
        too) and then freed."""
        for suffix, drafted in suffixes:
            req = make_request(prefix + suffix)
            cached = self.pool.find_cached_blocks(req)
            copies = self.pool.allocate_slots(req, req.num_tokens - len(cached) * BS, cached)
            if copies is None:
                break
            self.kv.write(req, req.num_computed_tokens, req.num_tokens)
            req.num_computed_tokens = req.num_tokens
            self.pool.cache_full_blocks(req)
            if drafted:
                start = req.num_draft_computed_tokens
                self.kv.write(req, start, req.num_tokens, draft=True)
                req.num_draft_computed_tokens = req.num_tokens
                self.pool.cache_draft_blocks(req, start)
            self.pool.free(req)
        self.history.append(prefix)

    @precondition(_room)
    @rule(tokens=TOKENS)
    def add(self, tokens: list[int]) -> None:
        self._add(tokens)

    @precondition(lambda self: self.history and self._room())
    @rule(sel=SEL, cut=st.integers(0, 5), suffix=TOKENS)
    def add_sharing_prefix(self, sel: int, cut: int, suffix: list[int]) -> None:
        self._add(pick(self.history, sel)[: cut * BS] + suffix)

    @precondition(lambda self: self._to_allocate())
    @rule(sel=SEL, chunk=st.integers(1, 12), then_compute=st.booleans(), token=st.integers(0, 1))
    def allocate(self, sel: int, chunk: int, then_compute: bool, token: int) -> None:
        self._allocate(pick(self._to_allocate(), sel), chunk, then_compute, token)

    def _allocate(self, req: Request, chunk: int, then_compute: bool, token: int) -> None:
        cached: list[int] = []
        if req.num_computed_tokens == 0 and not req.block_table:
            cached = self.pool.find_cached_blocks(req)
        num_new = min(chunk, req.num_tokens_to_compute - len(cached) * BS)
        before = pool_state(self.pool)
        before_req = (list(req.block_table), req.num_computed_tokens, req.num_hashed_blocks,
                      req.num_draft_computed_tokens)  # fmt: skip
        copies = self.pool.allocate_slots(req, num_new, cached)
        if copies is None:
            assert pool_state(self.pool) == before
            assert (req.block_table, req.num_computed_tokens, req.num_hashed_blocks,
                    req.num_draft_computed_tokens) == before_req  # fmt: skip
            event("allocate: pool short")
            return
        if cached:
            event("allocate: prefix hit")
            if req.num_draft_computed_tokens:
                event("allocate: prefix hit with the draft's K/V")
        if copies:
            event("allocate: copy on write")
        assert len(req.block_table) * BS >= req.num_computed_tokens + num_new
        for src, dst in copies:
            assert src != dst and self.pool.ref_counts[dst] == 1
        self.kv.copy(copies)
        self.pending[req.request_id] = num_new
        if then_compute:
            self._compute(req, token)

    @precondition(lambda self: self.pending)
    @rule(sel=SEL, token=st.integers(0, 1))
    def compute(self, sel: int, token: int) -> None:
        self._compute(pick(self._to_compute(), sel), token)

    def _compute(self, req: Request, token: int) -> None:
        n = self.pending.pop(req.request_id)
        start = req.num_computed_tokens
        self.kv.write(req, start, start + n)
        req.num_computed_tokens += n
        self.pool.cache_full_blocks(req)
        if req.num_computed_tokens == req.num_tokens and req.num_tokens < MAX_LEN:
            req.append_token(token)

    def _to_draft(self) -> list[Request]:
        # A write into a block still shared is copied first: the proposer waits for that.
        return [r for r in self.on_gpu if not self.pool._needs_copy_on_write(r)]

    @precondition(lambda self: self._to_draft())
    @rule(sel=SEL)
    def draft(self, sel: int) -> None:
        req = pick(self._to_draft(), sel)
        start = min(req.num_draft_computed_tokens, req.num_computed_tokens)
        end = min(req.num_tokens, req.num_computed_tokens + 1, len(req.block_table) * BS)
        if end <= start:
            return
        # The proposer reserves its slots first: a block it would write with other tokens
        # than its hash's (a sample forked inside it) leaves the cache there.
        assert self.pool.allocate_slots(req, 0) == []
        self.kv.write(req, start, end, draft=True)
        req.num_draft_computed_tokens = end
        self.pool.cache_draft_blocks(req, start)
        event("draft")

    @precondition(lambda self: self._to_fork())
    @rule(sel=SEL, decode_both=st.booleans(), token=st.integers(0, 1), back=st.integers(0, 6))
    def fork(self, sel: int, decode_both: bool, token: int, back: int) -> None:
        parent = pick(self._to_fork(), sel)
        # A parallel sample: a computed prefix of the parent (all of it, or less as the
        # engine forks at the prompt less its last token), then a token other than the
        # parent's, so a write into a still-shared block would show up in the parent's KV.
        done = max(parent.num_computed_tokens - back, 0)
        tokens = parent.all_token_ids[:done]
        if done < MAX_LEN:
            nxt = parent.all_token_ids[done] if done < parent.num_tokens else 0
            tokens.append(1 - nxt)
        child = make_request(tokens)
        self.pool.fork(parent, child, done)
        if back:
            event("fork: of a prefix")
        self.on_gpu.append(child)
        if decode_both:  # both samples take their next step together, as in one engine step
            for req in (child, parent):
                if req.num_tokens_to_compute:
                    self._allocate(req, 1, True, token)

    @precondition(lambda self: self.on_gpu)
    @rule(sel=SEL)
    def free(self, sel: int) -> None:
        req = pick(self.on_gpu, sel)
        self.pool.free(req)
        self.on_gpu.remove(req)
        self.pending.pop(req.request_id, None)
        assert req.block_table == []

    @rule()
    def reset_prefix_cache(self) -> None:
        cached = self.pool.num_cached_free_blocks
        free = self.pool.num_free_blocks
        assert self.pool.reset_prefix_cache() == cached
        if cached:
            event("reset prefix cache: dropped blocks")
        assert self.pool.num_cached_free_blocks == 0 and self.pool.num_free_blocks == free

    @precondition(lambda self: self._to_swap_out())
    @rule(sel=SEL, with_sharers=st.booleans())
    def swap_out(self, sel: int, with_sharers: bool) -> None:
        req = pick(self._to_swap_out(), sel)
        unit = [req]
        if with_sharers:  # as a parallel request's sequences go: together, sharing kept
            unit += [r for r in self._to_swap_out()
                     if r is not req and set(r.block_table) & set(req.block_table)]
        tables = [list(r.block_table) for r in unit]
        pairs = self.swap.swap_out(self.pool, unit)
        if pairs is None:
            assert [r.block_table for r in unit] == tables
            event("swap out: swap space full")
            return
        distinct = list(dict.fromkeys(b for t in tables for b in t))
        assert [g for g, _ in pairs] == distinct
        if len(distinct) < sum(map(len, tables)):
            event("swap out: shared blocks once")
        self.kv.swap_out(pairs)
        for r in unit:
            self.on_gpu.remove(r)
            self.swapped.append(r)

    @precondition(lambda self: self.swapped)
    @rule(sel=SEL, with_sharers=st.booleans())
    def swap_in(self, sel: int, with_sharers: bool) -> None:
        req = pick(self.swapped, sel)
        unit = [req]
        if with_sharers:
            mine = set(self.swap.tables[req])
            unit += [r for r in self.swapped if r is not req and mine & set(self.swap.tables[r])]
        if not self.swap.can_swap_in(self.pool, unit):
            event("swap in: no room")
            return
        event("swap in")
        cpu_tables = [list(self.swap.tables[r]) for r in unit]
        pairs = self.swap.swap_in(self.pool, unit)
        assert [c for c, _ in pairs] == list(dict.fromkeys(c for t in cpu_tables for c in t))
        self.kv.swap_in(pairs)
        for r in unit:
            self.swapped.remove(r)
            self.on_gpu.append(r)

    @invariant()
    def integrity(self) -> None:
        self.pool.check_integrity(self.on_gpu)
        self.swap.check_integrity()
        for req in self.on_gpu:
            self.kv.check_gpu(req)
        for req in self.swapped:
            assert req.block_table == []
            self.kv.check_cpu(req, self.swap.tables[req])
        self.kv.check_draft_cached(self.pool)
        assert set(self.swap.tables) == set(self.swapped)

    @invariant()
    def block_map_shows_each_block_state(self) -> None:
        """The dashboard's map (array operations over the ref counts and the cached-free
        LRU) equals a per-block reading of ref counts and hashes."""
        pool = self.pool
        want = "".join(
            BLOCK_SHARED if pool.ref_counts[b] > 1 else BLOCK_USED if pool.ref_counts[b] == 1
            else BLOCK_CACHED if pool.block_hash[b] is not None else BLOCK_FREE
            for b in range(pool.num_blocks)
        )  # fmt: skip
        assert block_map(pool) == want

    def teardown(self) -> None:
        for req in self.on_gpu:
            self.pool.free(req)
        for req in self.swapped:
            self.swap.discard(req)
        self.pool.check_integrity([])
        self.swap.check_integrity()
        assert self.pool.num_free_blocks == self.pool.num_blocks
        assert self.swap.num_free_blocks == self.swap.num_blocks
        assert sum(self.pool.ref_counts) == 0


def pick(items: list[Any], sel: int) -> Any:
    return items[sel % len(items)]


BlockPoolMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    # Rule draws that hit a disabled rule count as filtered; that is expected here.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBlockPoolMachine = BlockPoolMachine.TestCase
