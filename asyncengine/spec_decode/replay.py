"""A proposer for benchmarks and tests: drafts the target's own earlier greedy output, each
draft token wrong with a set probability.

With dummy weights nothing is accepted by chance, so the mechanics of speculation (verify
cost, rollback, speedup at a given acceptance) are measured by replaying a reference run of
the same requests: the draft for output position p is the reference token at p with
probability `acceptance`, else a different token. Whether position p's draft is wrong is
drawn once per reference and position, so every proposal that covers p agrees, and two
runs that produce the same tokens see the same verify steps (the benchmark replays a run's
own output until a run reproduces it). Greedy verification then keeps each draft exactly
when it matches the reference, as long as the run has not diverged from it.
"""

from __future__ import annotations

import zlib
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
        self.seed = seed
        self._errors: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def _errors_of(self, key: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Per output position of the reference under `key`: whether its draft is wrong, and
        the shift that makes it wrong."""
        if key not in self._errors:
            n = len(self.references[key])
            tag = zlib.crc32(np.asarray(key, dtype=np.int64).tobytes())
            rng = np.random.default_rng([self.seed, tag])
            self._errors[key] = (rng.random(n) >= self.acceptance,
                                 rng.integers(1, self.vocab_size, n))  # fmt: skip
        return self._errors[key]

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = []
        for req, k in zip(requests, num_drafts, strict=True):
            key = tuple(req.prompt_token_ids)
            ref = self.references.get(key)
            if ref is None:
                out.append([])
                continue
            pos = req.num_output_tokens
            drafts = ref[pos : pos + k]
            wrong, shift = self._errors_of(key)
            out.append([
                int((t + s) % self.vocab_size) if w else t
                for t, w, s in zip(drafts, wrong[pos : pos + k], shift[pos : pos + k], strict=True)
            ])
        return out
