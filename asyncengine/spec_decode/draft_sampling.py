"""How the draft model picks each draft: the argmax for a greedy request, a sample from the
draft's own distribution q for a request that samples, with q kept for verification.

For a request that samples, q is the draft's logits under the request's temperature and
top-k / top-p / min-p, computed as the target's p is (`rejection_sampler.filtered_probs`).
The target's penalties and min_tokens ban are left out of q: rejection sampling keeps the
target's distribution for any q the draft was truly drawn from, so they could only raise the
acceptance. The draft is drawn from q by the exponential race (argmax of q / noise), and q's
rows are kept on the device, float32 [num_drafts, vocab] per request
(`Request.spec_draft_probs`), for the verify step to accept with min(1, p/q) and recover from
max(0, p - q). Greedy requests keep argmax drafts (point masses) and hold no q.

A constrained request (structured outputs) drafts by argmax even when it samples: its drafts
are cut at the first one the grammar forbids, and cutting keeps the output exact only for
point masses (a forbidden point mass is rejected for sure and recovers from p itself, which
the cut row samples; a cut sampled draft would emit a sample of p where the residual
max(0, p - q) was due).

A seeded request (`SamplingParams.seed`) draws the noise of one proposal from a generator
seeded with its own seed and the position of its first draft (`draft_seed`): its drafts are
reproducible run to run, whatever else the batch holds and whenever it proposes, and the
request's own generator (the target's sampling and verification) draws nothing for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncengine.request import Request
from asyncengine.sampler import exponential_noise, host_to_device
from asyncengine.spec_decode.rejection_sampler import filtered_probs

_MASK64 = (1 << 64) - 1


def samples_drafts(req: Request) -> bool:
    """Whether the draft model samples this request's drafts (else: argmax)."""
    return not req.params.is_greedy and req.grammar is None


def draft_seed(seed: int, position: int) -> int:
    """A seed for the draft noise of a proposal starting at `position` of a request whose
    generator has `seed` (a 64-bit mix, so neighbouring seeds and positions, such as parallel
    samples seeded seed + index, get unrelated streams)."""
    x = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # 63 bits: any generator takes it


class DraftSampling:
    """One proposal's sampling for its requests that sample: their parameters on the device,
    their seeded generators, and the q of every draft drawn (float32 [S, max drafts, V] for
    the S requests that sample)."""

    def __init__(
        self,
        reqs: Sequence[Request],
        counts: Sequence[int],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        sampled = [i for i, r in enumerate(reqs) if samples_drafts(r)]
        self.slot: list[int | None] = [None] * len(reqs)
        for s, i in enumerate(sampled):
            self.slot[i] = s
        params = [reqs[i].params for i in sampled]
        self.device = device
        self.temperature = host_to_device([float(p.temperature) for p in params],
                                          torch.float32, device)  # fmt: skip
        self.top_k = host_to_device(
            [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params], torch.int32, device
        )
        self.top_p = host_to_device([float(p.top_p) for p in params], torch.float32, device)
        self.min_p = host_to_device([float(p.min_p) for p in params], torch.float32, device)
        self.generators: list[torch.Generator | None] = []
        for i in sampled:
            gen = reqs[i].generator
            if gen is not None:
                seed = draft_seed(gen.initial_seed(), reqs[i].num_tokens)
                gen = torch.Generator(device).manual_seed(seed)
            self.generators.append(gen)
        self.probs = torch.empty((len(sampled), max(counts), vocab_size),
                                 dtype=torch.float32, device=device)  # fmt: skip

    @classmethod
    def build(
        cls,
        reqs: Sequence[Request],
        counts: Sequence[int],
        vocab_size: int,
        device: torch.device,
    ) -> DraftSampling | None:
        """None when every request drafts by argmax."""
        if not any(samples_drafts(r) for r in reqs):
            return None
        return cls(reqs, counts, vocab_size, device)

    def pick(self, logits: torch.Tensor, rows: Sequence[int], j: int) -> torch.Tensor:
        """Draft j (0-based) of the proposal's requests `rows`, from their draft logits
        [len(rows), V]: the argmax, or for those that sample a draw from q (kept)."""
        tokens = logits.argmax(dim=-1)
        local = [a for a, r in enumerate(rows) if self.slot[r] is not None]
        if not local:
            return tokens
        slots: list[int] = [self.slot[rows[a]] for a in local]  # type: ignore[misc]
        local_idx = host_to_device(local, torch.int64, self.device)
        slot_idx = host_to_device(slots, torch.int64, self.device)
        q = filtered_probs(
            logits.index_select(0, local_idx).to(torch.float32),
            self.temperature.index_select(0, slot_idx),
            self.top_k.index_select(0, slot_idx),
            self.top_p.index_select(0, slot_idx),
            self.min_p.index_select(0, slot_idx),
        )  # fmt: skip
        gens = {a: g for a, s in enumerate(slots) if (g := self.generators[s]) is not None}
        noise = exponential_noise(tuple(q.shape), gens, self.device)
        self.probs[:, j].index_copy_(0, slot_idx, q)
        return tokens.index_copy(0, local_idx, (q / noise).argmax(dim=-1))

    def probs_of(self, i: int, n: int) -> torch.Tensor | None:
        """q of request i's first n drafts, [n, V] (None: it drafted by argmax)."""
        s = self.slot[i]
        return None if s is None else self.probs[s, :n]
