"""Applies the grammar masks of a step's constrained rows to its logits, before sampling.

The masks are filled on the CPU (xgrammar's matchers) after the step's forward has been
enqueued, so on a GPU they fill while it runs; they go to the device in one non-blocking
copy and xgrammar's kernel sets every forbidden token's logit to -inf. Rows without a
constraint are left alone. The logits are those the model computed, outside any CUDA graph.

With asynchronous scheduling a constrained request's previous token may still be in the
step in flight: its mask waits for that step's sampled ids only (they are copied to the host
ahead of this step's forward, which the device runs meanwhile) and its matcher accepts the
token here, one ahead of the engine, which later finds it accepted.

In a verify step a request with drafts d1..dk has k + 1 rows; row j gets the mask after
d1..dj, the matcher walking the drafts tentatively and rolling back (the drafts were
checked against the grammar when proposed). A request with drafts has no token in flight
(it is proposed for only then, and a verify step is resolved before the next schedule), so
its matcher stands exactly at its output.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from asyncengine.model_runner import InflightStep
    from asyncengine.request import Request


@dataclass
class MaskStats:
    """Host time spent on masks, summed over steps that had constrained rows."""

    steps: int = 0
    rows: int = 0
    fill_s: float = 0.0  # filling bitmasks on the CPU
    apply_s: float = 0.0  # copy and launch of the masking kernel (host side)


class GrammarMasker:
    """Owns the reused host bitmask buffer of one model runner."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.stats = MaskStats()
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def apply(self, logits: torch.Tensor, requests: Sequence[Request],
              prev: InflightStep | None = None,
              num_spec: Sequence[int] | None = None) -> torch.Tensor:
        """Mask the rows of constrained requests (row i is `requests[i]`; in a verify step
        request i has `num_spec[i] + 1` consecutive rows, one per draft plus one); returns the
        logits to sample from (float32 when a mask was applied). `prev`: the step in flight,
        whose sampled tokens some of these requests have not got on the host yet."""
        picked = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not picked:
            return logits
        spec = num_spec if num_spec is not None else [0] * len(requests)
        first = list(itertools.accumulate((k + 1 for k in spec), initial=0))
        t0 = time.perf_counter()
        bitmask = self._buffer(logits.shape[0])
        in_flight: list[int] | None = None
        rows: list[int] = []
        for i in picked:
            req = requests[i]
            grammar = req.grammar
            assert grammar is not None
            k = spec[i]
            if k:
                assert not req.num_pending_tokens, "drafts continue the request's known tokens"
                own = list(range(first[i], first[i] + k + 1))
                grammar.fill_draft_masks(bitmask, own, req.spec_token_ids[:k])
                rows += own
                continue
            if prev is not None and req.num_pending_tokens and id(req) in prev.rows:
                if in_flight is None:
                    in_flight = prev.result().token_ids
                grammar.catch_up(req.output_token_ids, in_flight[prev.rows[id(req)]])
            grammar.fill_mask(bitmask, first[i])
            rows.append(first[i])
        t1 = time.perf_counter()
        if logits.dtype != torch.float32:
            logits = logits.float()
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        import xgrammar as xgr  # loaded by then: a constrained request compiled its grammar

        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
        stats = self.stats
        stats.steps += 1
        stats.rows += len(rows)
        stats.fill_s += t1 - t0
        stats.apply_s += time.perf_counter() - t1
        return logits

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """The host bitmask for `num_rows` rows, safe to overwrite (its last copy landed)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        host = self._host
        if host is None or host.shape[0] < num_rows:
            cap = max(num_rows, 2 * host.shape[0] if host is not None else 16)
            import xgrammar as xgr

            host = xgr.allocate_token_bitmask(cap, self.vocab_size)
            if self.device.type == "cuda":
                host = host.pin_memory()
            self._host = host
        return host[:num_rows]
