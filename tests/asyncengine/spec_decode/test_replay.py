"""The replay proposer: the reference's tokens, each position's draft wrong with a set
probability that every proposal covering the position agrees on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncengine.spec_decode.replay import ReplayProposer

PROMPT = (5, 6, 7)
REFERENCE = list(range(100, 2100))
VOCAB = 4096


def _request(num_output_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=list(PROMPT), num_output_tokens=num_output_tokens)


@pytest.mark.parametrize("acceptance", [0.0, 1.0])
def test_all_right_or_all_wrong(acceptance: float) -> None:
    proposer = ReplayProposer({PROMPT: REFERENCE}, acceptance, VOCAB)
    drafts = proposer.propose([_request(10)], [8])[0]
    right = [d == t for d, t in zip(drafts, REFERENCE[10:18], strict=True)]
    assert right == [acceptance == 1.0] * 8


def test_a_position_is_wrong_in_every_proposal_or_in_none() -> None:
    proposer = ReplayProposer({PROMPT: REFERENCE}, 0.7, VOCAB, seed=3)
    by_start = {start: proposer.propose([_request(start)], [6])[0] for start in range(40, 46)}
    for pos in range(45, 46 + 5):
        seen = {by_start[s][pos - s] for s in by_start if 0 <= pos - s < 6}
        assert len(seen) == 1  # the same draft whichever step proposed it
    # Another proposer with the same seed draws the same errors; another seed, others.
    again = ReplayProposer({PROMPT: REFERENCE}, 0.7, VOCAB, seed=3)
    other = ReplayProposer({PROMPT: REFERENCE}, 0.7, VOCAB, seed=4)
    first = proposer.propose([_request(0)], [len(REFERENCE)])[0]
    assert again.propose([_request(0)], [len(REFERENCE)])[0] == first
    assert other.propose([_request(0)], [len(REFERENCE)])[0] != first


def test_error_rate_follows_acceptance() -> None:
    proposer = ReplayProposer({PROMPT: REFERENCE}, 0.7, VOCAB, seed=1)
    drafts = proposer.propose([_request(0)], [len(REFERENCE)])[0]
    wrong = [d != t for d, t in zip(drafts, REFERENCE, strict=True)]
    assert sum(wrong) / len(wrong) == pytest.approx(0.3, abs=0.04)
    assert all(0 <= d < VOCAB for d in drafts)


def test_unknown_prompt_gets_no_drafts() -> None:
    proposer = ReplayProposer({PROMPT: REFERENCE}, 0.7, VOCAB)
    stranger = SimpleNamespace(prompt_token_ids=[1], num_output_tokens=0)
    assert proposer.propose([stranger], [4]) == [[]]
