"""Rejection sampling keeps the target's distribution exactly (chi-square on many draws), for
point-mass drafts and for drafts sampled from a draft distribution q kept with them."""

from __future__ import annotations

import pytest
import torch

from asyncengine.request import Request
from asyncengine.sampler import SamplingMetadata
from asyncengine.sampling_params import SamplingParams
from asyncengine.spec_decode.draft_sampling import DraftSampling
from asyncengine.spec_decode.rejection_sampler import accept_or_recover, target_probs, verify_rows

N = 200_000


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def draws(probs: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = probs.expand(N, -1)
    uniform = torch.rand(N, generator=gen)
    noise = torch.empty(p.shape).exponential_(generator=gen)
    return accept_or_recover(p, draft, uniform, noise, None if q is None else q.expand(N, -1))


def test_point_mass_draft_keeps_target_distribution() -> None:
    probs = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.3])
    for d in range(5):
        out, accepted = draws(probs, torch.full((N,), d), None, seed=d)
        assert chi2_pvalue(torch.bincount(out, minlength=5), probs) > 1e-3
        # The draft is kept with probability p(d).
        assert abs(accepted.double().mean().item() - probs[d].item()) < 0.005


def test_sampled_draft_keeps_target_distribution() -> None:
    gen = torch.Generator().manual_seed(7)
    probs = torch.softmax(torch.randn(12, generator=gen) * 2, dim=0)
    q = torch.softmax(torch.randn(12, generator=gen) * 2, dim=0)
    drafts = torch.multinomial(q, N, replacement=True, generator=gen)
    out, accepted = draws(probs, drafts, q, seed=3)
    assert chi2_pvalue(torch.bincount(out, minlength=12), probs) > 1e-3
    # Leviathan et al.: the acceptance rate is sum(min(p, q)).
    assert abs(accepted.double().mean().item() - torch.minimum(probs, q).sum().item()) < 0.005


def test_chi2_detects_a_wrong_distribution() -> None:
    probs = torch.tensor([0.2, 0.3, 0.5])
    out, _ = draws(probs, torch.full((N,), 2), None, seed=1)
    assert chi2_pvalue(torch.bincount(out, minlength=3), torch.tensor([0.25, 0.25, 0.5])) < 1e-6


# ------------------------------------------------------------ verify_rows with draft probs
V = 10
ROWS = 60_000


def sampled_meta(n: int, params: SamplingParams) -> SamplingMetadata:
    return SamplingMetadata.build([params] * n, [[1]] * n, [[]] * n, [None] * n, [], V, "cpu")


def test_verify_rows_with_draft_probs_keeps_target_distribution() -> None:
    """Drafts drawn by the draft model's sampling from a q unlike p (another model's logits
    under the same temperature and top-k, so the supports differ too): the emitted tokens
    follow p, and the acceptance rate is sum(min(p, q))."""
    gen = torch.Generator().manual_seed(5)
    target_row = torch.randn(V, generator=gen) * 2
    draft_row = torch.randn(V, generator=gen) * 2
    params = SamplingParams(temperature=0.9, top_k=6)
    meta = sampled_meta(ROWS, params)
    p = target_probs(target_row.unsqueeze(0), sampled_meta(1, params))[0]
    reqs = [Request(str(i), None, [1], params, 4) for i in range(ROWS)]
    sampling = DraftSampling.build(reqs, [1] * ROWS, V, torch.device("cpu"))
    assert sampling is not None
    torch.manual_seed(9)
    drafts = sampling.pick(draft_row.expand(ROWS, V), list(range(ROWS)), 0)
    q = sampling.probs[:, 0]
    assert not torch.equal(q[0] > 0, p > 0), "the test wants supports that differ"
    logits = target_row.expand(ROWS, V)
    sampled = torch.zeros(ROWS, dtype=torch.int64)  # only rows without a draft read it
    out, accepted = verify_rows(logits, meta, sampled, drafts.tolist(), [True] * ROWS,
                                [(0, q)])  # fmt: skip
    assert chi2_pvalue(torch.bincount(out, minlength=V), p) > 1e-3
    rate = accepted.double().mean().item()
    assert abs(rate - torch.minimum(p, q[0]).sum().item()) < 0.01
    # The same drafts verified as point masses accept with p(d): sum(p q), less.
    _, as_points = verify_rows(logits, meta, sampled, drafts.tolist(), [True] * ROWS)
    point_rate = as_points.double().mean().item()
    assert abs(point_rate - (p * q[0]).sum().item()) < 0.01
    assert point_rate < rate - 0.05


def test_verify_rows_accepts_every_draft_of_q_equal_to_p() -> None:
    gen = torch.Generator().manual_seed(6)
    n = 2_000
    logits = torch.randn(n, V, generator=gen)
    meta = sampled_meta(n, SamplingParams(temperature=1.3, top_p=0.9))
    q = target_probs(logits, meta)
    drafts = torch.multinomial(q, 1, generator=gen).squeeze(1)
    sampled = torch.zeros(n, dtype=torch.int64)
    out, accepted = verify_rows(logits, meta, sampled, drafts.tolist(), [True] * n, [(0, q)])
    assert bool(accepted.all())
    assert torch.equal(out, drafts)


def test_one_hot_draft_probs_verify_as_point_masses() -> None:
    """Rows of a request with q next to point-mass rows: a one-hot q decides exactly as the
    point-mass rule (same random draws, same verdicts)."""
    gen = torch.Generator().manual_seed(8)
    n = 500
    logits = torch.randn(n, V, generator=gen)
    meta = sampled_meta(n, SamplingParams(temperature=1.0))
    drafts = torch.randint(0, V, (n,), generator=gen)
    one_hot = torch.nn.functional.one_hot(drafts[100:300], V).float()
    sampled = torch.zeros(n, dtype=torch.int64)
    torch.manual_seed(1)
    want = verify_rows(logits, meta, sampled, drafts.tolist(), [True] * n)
    torch.manual_seed(1)
    got = verify_rows(logits, meta, sampled, drafts.tolist(), [True] * n, [(100, one_hot)])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert 0 < int(want[1].sum()) < n


def test_draft_probs_of_rows_without_a_sampled_draft_are_refused() -> None:
    logits = torch.randn(4, V)
    meta = sampled_meta(4, SamplingParams(temperature=1.0))
    sampled = torch.zeros(4, dtype=torch.int64)
    q = torch.full((2, V), 1 / V)
    with pytest.raises(ValueError, match=r"rows 2\.\.3"):
        # Row 3 has no draft (a request's last row): no q may describe it.
        verify_rows(logits, meta, sampled, [1, 2, 3, -1], [True] * 4, [(2, q)])
