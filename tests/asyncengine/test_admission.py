"""GrowthEstimate: the expected length of a request, the clip on large max_tokens, the floor
that finished requests set (aborts ignored), and the ratio's steps after preemptions and
held-back admissions."""

from __future__ import annotations

import itertools

import pytest

from asyncengine.admission import CLIP_MAX_NEW_TOKENS, GrowthEstimate
from asyncengine.request import Request, RequestStatus
from asyncengine.sampling_params import SamplingParams

_ids = itertools.count()


def request(num_prompt: int, max_tokens: int, num_output: int = 0) -> Request:
    r = Request(f"r{next(_ids)}", None, list(range(num_prompt)), SamplingParams(), max_tokens)
    for t in range(num_output):
        r.append_token(t)
    return r


def test_expected_length_is_known_tokens_plus_ratio_of_the_rest() -> None:
    g = GrowthEstimate(ratio=0.5)
    r = request(10, max_tokens=21, num_output=4)
    # 14 known tokens, 17 left of max_tokens, half of them rounded up.
    assert g.expected_total_tokens(r) == 14 + 9
    r.num_pending_tokens = 1  # a token in flight counts as known, and as made
    assert g.expected_total_tokens(r) == 15 + 8


def test_a_request_at_max_tokens_is_not_expected_to_grow() -> None:
    g = GrowthEstimate(ratio=1.0)
    r = request(3, max_tokens=2, num_output=2)
    assert g.expected_total_tokens(r) == 5


def test_large_max_tokens_are_clipped() -> None:
    g = GrowthEstimate(ratio=1.0)
    r = request(10, max_tokens=100_000)
    assert g.expected_total_tokens(r) == 10 + CLIP_MAX_NEW_TOKENS


def test_conservativeness_scales_the_ratio_up_to_one() -> None:
    assert GrowthEstimate(ratio=0.4, conservativeness=2.0).effective_ratio == pytest.approx(0.8)
    assert GrowthEstimate(ratio=0.7, conservativeness=3.0).effective_ratio == 1.0
    assert not GrowthEstimate(conservativeness=0.0).enabled


def test_reserved_blocks_count_only_what_requests_do_not_hold() -> None:
    g = GrowthEstimate(ratio=1.0)
    a = request(8, max_tokens=8)  # expected 16 tokens: 4 blocks of 4
    a.block_table = [0, 1]
    b = request(8, max_tokens=0)  # done growing, holds more than its tokens need
    b.block_table = [2, 3, 4]
    assert g.reserved_blocks([a, b], block_size=4) == 2


def test_finishes_set_a_floor_and_aborts_teach_nothing() -> None:
    g = GrowthEstimate(ratio=0.2, min_ratio=0.1, finish_weight=0.5)
    assert g.floor == 0.1
    g.observe_finish(request(4, max_tokens=10, num_output=2), RequestStatus.FINISHED_ABORTED)
    assert g.used is None and g.ratio == 0.2
    g.observe_finish(request(4, max_tokens=10, num_output=10), RequestStatus.FINISHED_LENGTH)
    assert g.used == 1.0 and g.ratio == 1.0  # the first finish is the average
    g.observe_finish(request(4, max_tokens=10, num_output=2), RequestStatus.FINISHED_STOPPED)
    assert g.used == pytest.approx(0.6)  # half weight to the new share, 0.2
    assert g.floor == pytest.approx(0.6)


def test_finishes_far_below_max_tokens_lower_the_ratio_at_once() -> None:
    # A chat server's requests: max_tokens is the rest of the context (clipped at 4,096),
    # and replies stop after a few hundred tokens.
    g = GrowthEstimate(ratio=0.7, min_ratio=0.05)
    g.observe_finish(request(4, max_tokens=8000, num_output=410), RequestStatus.FINISHED_STOPPED)
    assert g.used == pytest.approx(0.1, abs=1e-3)
    assert g.ratio == pytest.approx(1.5 * g.used)  # not 600 held-back steps later
    g.observe_finish(request(4, max_tokens=8000, num_output=40), RequestStatus.FINISHED_STOPPED)
    assert g.floor <= g.ratio <= 1.5 * g.used


def test_a_finish_far_below_a_huge_max_tokens_counts_against_the_clip() -> None:
    g = GrowthEstimate()
    g.observe_finish(request(4, max_tokens=10**6, num_output=CLIP_MAX_NEW_TOKENS // 4),
                     RequestStatus.FINISHED_STOPPED)
    assert g.used == pytest.approx(0.25)


def test_preemption_raises_the_ratio_and_held_back_steps_lower_it_to_the_floor() -> None:
    g = GrowthEstimate(ratio=0.5, min_ratio=0.1, decay=0.25, bump=0.3)
    g.observe_step(preempted=True, held_back=False)
    assert g.ratio == pytest.approx(0.8)
    g.observe_step(preempted=True, held_back=True)
    assert g.ratio == 1.0
    for _ in range(10):
        g.observe_step(preempted=False, held_back=True)
    assert g.ratio == pytest.approx(0.1)
    g.observe_step(preempted=False, held_back=False)  # nothing waited: nothing learnt
    assert g.ratio == pytest.approx(0.1)
    g.used = 0.4
    g.ratio = 0.5
    for _ in range(10):
        g.observe_step(preempted=False, held_back=True)
    assert g.ratio == pytest.approx(0.4)
