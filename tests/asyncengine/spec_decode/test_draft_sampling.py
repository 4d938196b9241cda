"""The draft model's picks: a request that samples draws its draft from q (chi-square) and
keeps q; greedy and constrained requests draft by argmax and keep nothing; a seeded
request's drafts repeat run to run whatever its batch holds."""

from __future__ import annotations

import itertools

import torch

from asyncengine.request import Request
from asyncengine.sampling_params import SamplingParams
from asyncengine.spec_decode.draft_sampling import DraftSampling, draft_seed, samples_drafts
from tests.asyncengine.spec_decode.test_rejection_sampler import chi2_pvalue

V = 12
CPU = torch.device("cpu")
_ids = itertools.count()


def request(params: SamplingParams, seed: int | None = None, num_tokens: int = 5) -> Request:
    req = Request(f"r{next(_ids)}", None, list(range(3, 3 + num_tokens)), params, 8)
    if seed is not None:
        req.generator = torch.Generator().manual_seed(seed)
    return req


def expected_q(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """softmax(logits / T) over the top-k tokens, written out independently."""
    x = logits / temperature
    keep = x.topk(top_k).indices
    masked = torch.full_like(x, float("-inf"))
    masked[keep] = x[keep]
    return masked.softmax(dim=-1)


def test_sampled_drafts_follow_q_and_q_is_kept() -> None:
    n = 40_000
    logits_row = torch.randn(V, generator=torch.Generator().manual_seed(1)) * 1.5
    params = SamplingParams(temperature=0.7, top_k=6)
    reqs = [request(params) for _ in range(n)]
    sampling = DraftSampling.build(reqs, [2] * n, V, CPU)
    assert sampling is not None
    torch.manual_seed(0)
    picks = sampling.pick(logits_row.expand(n, V), list(range(n)), 0)
    q = expected_q(logits_row, 0.7, 6)
    assert chi2_pvalue(torch.bincount(picks, minlength=V).double(), q) > 1e-3
    kept = sampling.probs_of(3, 1)
    assert kept is not None and kept.shape == (1, V) and kept.dtype == torch.float32
    torch.testing.assert_close(kept[0], q)
    # A second draft position fills the second row of each request's q.
    sampling.pick(logits_row.flip(0).expand(2, V), [0, 5], 1)
    torch.testing.assert_close(sampling.probs_of(5, 2)[1], expected_q(logits_row.flip(0), 0.7, 6))


def test_greedy_and_constrained_requests_draft_argmax_without_q() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    greedy = request(SamplingParams(temperature=0))
    constrained = request(SamplingParams(temperature=1.0))
    constrained.grammar = object()  # type: ignore[assignment]
    sampled = request(SamplingParams(temperature=1.0), seed=4)
    assert (samples_drafts(greedy), samples_drafts(constrained), samples_drafts(sampled)) == (
        False, False, True,
    )  # fmt: skip
    assert DraftSampling.build([greedy, constrained], [3, 3], V, CPU) is None
    reqs = [greedy, sampled, constrained, greedy]
    sampling = DraftSampling.build(reqs, [3, 2, 3, 1], V, CPU)
    assert sampling is not None
    # q rows only for the one request that samples.
    assert sampling.probs.shape == (1, 3, V)
    picks = sampling.pick(logits, [0, 1, 2, 3], 0)
    argmax = logits.argmax(dim=-1)
    assert picks[[0, 2, 3]].tolist() == argmax[[0, 2, 3]].tolist()
    assert sampling.probs_of(0, 3) is None and sampling.probs_of(2, 3) is None
    assert sampling.probs_of(1, 2).shape == (2, V)


def draws(reqs: list[Request], logits: torch.Tensor, steps: int = 3) -> list[list[int]]:
    sampling = DraftSampling.build(reqs, [steps] * len(reqs), V, CPU)
    assert sampling is not None
    rows = list(range(len(reqs)))
    return torch.stack([sampling.pick(logits, rows, j) for j in range(steps)], 1).tolist()


def test_seeded_drafts_repeat_whatever_the_batch() -> None:
    flat = torch.zeros(V)  # uniform q: every draw is the noise's alone
    params = SamplingParams(temperature=1.0)
    alone = draws([request(params, seed=11)], flat.expand(1, V))[0]
    torch.manual_seed(123)  # the unseeded neighbour's draws must not matter
    batch = [request(params), request(params, seed=11), request(params, seed=12)]
    got = draws(batch, flat.expand(3, V))
    assert got[1] == alone
    # Another seed, or the same seed at another position, draws other drafts (with 12
    # tokens and 3 drafts, three equal lists by chance are unlikely at a fixed seed).
    assert got[2] != alone
    later = draws([request(params, seed=11, num_tokens=6)], flat.expand(1, V))[0]
    assert later != alone
    # The request's own generator (the target's stream) is left untouched.
    fresh = torch.Generator().manual_seed(11)
    assert torch.equal(batch[1].generator.get_state(), fresh.get_state())


def test_draft_seed_spreads_neighbours() -> None:
    seeds = {draft_seed(s, p) for s in range(50) for p in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= s < 2**63 for s in seeds)
    assert draft_seed(7, 9) == draft_seed(7, 9)
