"""`GrammarState`: one sequence's position in its grammar (an xgrammar `GrammarMatcher`).

It advances only over the sequence's output tokens, so it survives preemption (recompute
and swap keep the output) unchanged; each of a request's n samples has its own. It may run
one token ahead of the host's copy of the output: with asynchronous scheduling the next
step's mask needs the token the step in flight sampled, before the engine appends it.

Speculative drafts are walked through the matcher tentatively and rolled back at once
(`num_allowed`, `fill_draft_masks`): it advances over a draft only when a verify step kept
it and the engine appends it.
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

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0  # output tokens accepted so far

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
        """Tokens the grammar forces next (no choice left), not yet accepted; may be empty.
        They are xgrammar's split of the forced text, not necessarily the model's."""
        return list(self.matcher.find_jump_forward_tokens())

    def num_allowed(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar allows after the accepted tokens (the state
        is left as it was)."""
        n = 0
        for t in drafts:
            if not self.matcher.accept_token(t):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def fill_draft_masks(self, bitmask: torch.Tensor, rows: Sequence[int],
                         drafts: Sequence[int]) -> None:
        """The masks of a verify step's rows for this sequence: `rows[j]` gets the allowed
        tokens after `drafts[:j]` (len(rows) == len(drafts) + 1). Every draft must be allowed
        (`num_allowed`); the state is left as it was."""
        assert len(rows) == len(drafts) + 1
        accepted = 0
        try:
            for j, row in enumerate(rows):
                self.fill_mask(bitmask, row)
                if j < len(drafts):
                    if not self.matcher.accept_token(drafts[j]):
                        raise ValueError(f"draft {drafts[j]} is outside the request's grammar")
                    accepted += 1
        finally:
            if accepted:
                self.matcher.rollback(accepted)


def attach_grammar(seqs: list[Request], compiled: xgr.CompiledGrammar) -> None:
    """Give each sequence of a request its own matcher (n > 1: one per sample)."""
    for seq in seqs:
        seq.grammar = GrammarState(compiled)
