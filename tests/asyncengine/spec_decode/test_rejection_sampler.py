"""Rejection sampling keeps the target's distribution exactly (chi-square on many draws)."""

from __future__ import annotations

import torch

from asyncengine.spec_decode.rejection_sampler import accept_or_recover

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
