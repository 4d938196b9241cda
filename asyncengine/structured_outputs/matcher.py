"""`GrammarState`: one sequence's position in its grammar (an xgrammar `GrammarMatcher`).

It advances only over the sequence's output tokens, so it survives preemption (recompute
and swap keep the output) unchanged; each of a request's n samples has its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

if TYPE_CHECKING:
    from asyncengine.request import Request


class GrammarState:
    """Accepts a sequence's tokens one by one and says which tokens may come next."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_jump_forward_tokens = 0

    def accept(self, token_id: int) -> bool:
        """Advance over a token; False (state unchanged) when the grammar forbids it."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return bool(self.matcher.is_terminated())

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of a CPU int32 bitmask."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def jump_forward_tokens(self) -> list[int]:
        """Tokens the grammar forces next (no choice left), not yet accepted; may be empty."""
        return list(self.matcher.find_jump_forward_tokens())


def attach_grammar(seqs: list[Request], compiled: xgr.CompiledGrammar) -> None:
    """Give each sequence of a request its own matcher (n > 1: one per sample)."""
    for seq in seqs:
        seq.grammar = GrammarState(compiled)
