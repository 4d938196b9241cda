"""Verification of drafted tokens against the target's distribution (Leviathan et al. 2023).

Each speculating request brings k drafts and gets k + 1 rows of target logits: row j is the
target's next-token distribution after the drafts before it. Row j decides draft j + 1:

- greedy rows accept it iff it is the target's argmax (with penalties over the output and the
  drafts before it), and emit that argmax either way;
- sampled rows accept it with probability min(1, p(d) / q(d)) and on rejection emit a token
  drawn from the normalized residual max(0, p - q), where q is the distribution the draft
  was drawn from (a draft model's drafts for a request that samples, kept with the drafts:
  `Request.spec_draft_probs`). A draft that is a point mass (n-gram drafts, grammar-forced
  drafts, a draft model's argmax drafts) accepts with probability p(d) and recovers from p
  with d removed. The emitted tokens then follow p exactly, for any q the draft was truly
  drawn from.

The last row of a request (no draft left) emits an ordinary sample from p, taken by the
engine's `Sampler` so it reads the same random stream as a step without speculation would.
Everything stays on the device; p is the sampler's own distribution (min_tokens ban,
penalties, temperature, top-k / top-p / min-p).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncengine.sampler import (
    SamplingMetadata,
    apply_penalties,
    exponential_noise,
    host_to_device,
)
from asyncengine_kernels.sampling import apply_top_k_top_p_min_p_ref


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """float32 [R, V]: softmax of float32 `logits` at each row's temperature, with what its
    top-k / top-p / min-p filters drop at zero (the target's p and a draft model's q)."""
    x = logits / temperature.unsqueeze(1)
    return apply_top_k_top_p_min_p_ref(x, top_k, top_p, min_p).softmax(dim=-1)


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """float32 [R, V]: the distribution the sampler draws a random row's token from."""
    x = logits.to(torch.float32, copy=True)
    if meta.has_min_tokens_ban:
        x.view(-1).index_fill_(0, meta.min_tokens_ban, float("-inf"))
    if not meta.no_penalties:
        x = apply_penalties(x, meta)
    return filtered_probs(x, meta.temperature, meta.top_k, meta.top_p, meta.min_p)


def accept_or_recover(
    probs: torch.Tensor,
    draft_ids: torch.Tensor,
    uniform: torch.Tensor,
    exp_noise: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(emitted ids [N], accepted [N]) for N rows, each with target probs `probs[i]` and a
    draft `draft_ids[i]` drawn from `draft_probs[i]` (None: a point mass on the draft).

    `uniform` holds U[0, 1) draws, `exp_noise` Exponential(1) draws [N, V] for sampling the
    residual by the exponential race (argmax of weight / noise)."""
    d = draft_ids.unsqueeze(1)
    p_d = probs.gather(1, d).squeeze(1)
    if draft_probs is None:
        accept_prob = p_d
        residual = probs.scatter(1, d, 0.0)
    else:
        q_d = draft_probs.gather(1, d).squeeze(1)
        accept_prob = torch.where(q_d > 0, p_d / q_d.clamp_min(1e-30), torch.ones_like(p_d))
        residual = (probs - draft_probs).clamp_min(0.0)
    accepted = uniform < accept_prob
    recovered = (residual / exp_noise).argmax(dim=-1)
    return torch.where(accepted, draft_ids, recovered), accepted


def verify_rows(
    logits: torch.Tensor,
    meta: SamplingMetadata,
    sampled: torch.Tensor,
    draft_ids: list[int],
    random_rows: list[bool],
    draft_probs: Sequence[tuple[int, torch.Tensor]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(emitted ids [R], accepted [R]) for every row of a verify step.

    `sampled` is the sampler's token for each row (argmax for greedy rows), `draft_ids[r]`
    the draft row r decides (-1: none, the row emits `sampled`), `random_rows[r]` whether the
    row samples (else greedy). Each `(r, q)` of `draft_probs` says that the drafts of rows
    r .. r + len(q) - 1 (sampled rows of one request) were drawn from q's rows [len(q), V];
    every other draft is a point mass."""
    device = logits.device
    drafts = host_to_device(draft_ids, torch.int64, device)
    accepted = sampled == drafts  # greedy rows; rows without a draft are never read
    out = sampled
    rows = [r for r, (d, rand) in enumerate(zip(draft_ids, random_rows, strict=True))
            if d >= 0 and rand]  # fmt: skip
    if not rows:
        return out, accepted
    idx = host_to_device(rows, torch.int64, device)
    # The whole step's distributions, then the rows that decide a sampled draft: subsetting
    # the metadata (flat min_tokens ban indices, per-row generators) is not worth its risk.
    probs = target_probs(logits, meta).index_select(0, idx)
    generators = {rows.index(r): g for r, g in meta.generators.items() if r in rows}
    uniform = torch.empty(len(rows), dtype=torch.float32, device=device)
    if len(generators) < len(rows):
        uniform.uniform_()
    for i, gen in generators.items():
        uniform[i : i + 1].uniform_(generator=gen)
    noise = exponential_noise(tuple(probs.shape), generators, device)
    drafted = drafts.index_select(0, idx)
    q = _draft_rows(probs, drafted, rows, draft_probs) if draft_probs else None
    emitted, ok = accept_or_recover(probs, drafted, uniform, noise, q)
    return out.index_copy(0, idx, emitted), accepted.index_copy(0, idx, ok)


def _draft_rows(
    probs: torch.Tensor,
    drafted: torch.Tensor,
    rows: list[int],
    draft_probs: Sequence[tuple[int, torch.Tensor]],
) -> torch.Tensor:
    """q for each of `rows`: the rows of `draft_probs` where given, a one-hot row on the
    draft elsewhere (min(1, p/q) and max(0, p - q) of a one-hot q are p(d) and p with d
    removed: the point-mass rule)."""
    q = torch.zeros_like(probs).scatter_(1, drafted.unsqueeze(1), 1.0)
    where = {r: i for i, r in enumerate(rows)}
    for first, rows_q in draft_probs:
        n = rows_q.shape[0]
        i = where.get(first)
        if i is None or i + n > len(rows) or rows[i + n - 1] != first + n - 1:
            raise ValueError(f"draft probabilities for rows {first}..{first + n - 1}, which "
                             "are not sampled rows with drafts")  # fmt: skip
        q[i : i + n] = rows_q
    return q
