"""A proposer for benchmarks and tests: drafts the target's own earlier greedy output, each
draft token wrong with a set probability.

With dummy weights nothing is accepted by chance, so the mechanics of speculation (verify
cost, rollback, speedup at a given acceptance) are measured by replaying a reference run of
the same requests: draft i of a step is the reference token at that output position with
probability `acceptance`, else a different token. Greedy verification then keeps each draft
exactly when it matches the reference, as long as the run has not diverged from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from asyncengine.request import Request


class ReplayProposer:
    def __init__(
        self,
        references: Mapping[tuple[int, ...], Sequence[int]],
        acceptance: float,
        vocab_size: int,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.references = {k: list(v) for k, v in references.items()}
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = []
        for req, k in zip(requests, num_drafts, strict=True):
            ref = self.references.get(tuple(req.prompt_token_ids))
            if ref is None:
                out.append([])
                continue
            pos = req.num_output_tokens
            drafts = ref[pos : pos + k]
            wrong = self.rng.random(len(drafts)) >= self.acceptance
            shift = self.rng.integers(1, self.vocab_size, len(drafts))
            out.append([
                int((t + s) % self.vocab_size) if w else t
                for t, w, s in zip(drafts, wrong, shift, strict=True)
            ])
        return out
