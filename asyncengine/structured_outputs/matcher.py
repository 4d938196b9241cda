"""`GrammarState`: one sequence's position in its grammar (an xgrammar `GrammarMatcher`).

It advances only over the sequence's output tokens, so it survives preemption (recompute
and swap keep the output) unchanged; each of a request's n samples has its own. It may run
one token ahead of the host's copy of the output: with asynchronous scheduling the next
step's mask needs the token the step in flight sampled, before the engine appends it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

if TYPE_CHECKING:
    from asyncengine.request import Request


class GrammarState:
    """Accepts a sequence's tokens one by one and says which tokens may come next."""

    def __init__(self, compiled: xgr.CompiledGrammar, *, needs_host_tokens: bool = False
                 ) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0  # output tokens accepted so far
        # Jump-forward appends tokens when a step resolves: the next step must not be
        # launched before (no asynchronous overlap for this sequence).
        self.needs_host_tokens = needs_host_tokens

    def accept(self, token_id: int) -> bool:
        """Advance over a token; False (state unchanged) when the grammar forbids it."""
        ok = bool(self.matcher.accept_token(token_id))
        self.num_accepted += ok
        return ok

    def catch_up(self, output_token_ids: Sequence[int], next_token: int | None = None) -> None:
        """Accept the output tokens (then `next_token`) not accepted yet; a token the
        grammar forbids raises ValueError."""
        tokens = list(output_token_ids[self.num_accepted:])
        if next_token is not None and self.num_accepted <= len(output_token_ids):
            tokens.append(next_token)
        for t in tokens:
            if not self.accept(t):
                raise ValueError(f"token {t} is outside the request's grammar")

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return bool(self.matcher.is_terminated())

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of a CPU int32 bitmask. A finished
        grammar allows everything: its sequence ends when the step in flight resolves, and
        this row's sample is dropped."""
        if self.matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def jump_forward_tokens(self) -> list[int]:
        """Tokens the grammar forces next (no choice left), not yet accepted; may be empty."""
        return list(self.matcher.find_jump_forward_tokens())


def attach_grammar(seqs: list[Request], compiled: xgr.CompiledGrammar,
                   needs_host_tokens: bool = False) -> None:
    """Give each sequence of a request its own matcher (n > 1: one per sample)."""
    for seq in seqs:
        seq.grammar = GrammarState(compiled, needs_host_tokens=needs_host_tokens)
