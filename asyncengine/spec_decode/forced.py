"""Grammar-forced drafts: exact jump-forward for structured outputs.

Where a request's grammar allows exactly one continuation (a schema's keys and
punctuation), its tokens are known before the model runs. Appending them outright would
save a step per token but change the output: the forced text's split into token ids is
xgrammar's, not necessarily the one the model picks (`{` then `"` where the model emits
`{"`), and the model then sees a context it would never have made. Here they are drafts
instead: the target verifies them in one forward, with the grammar mask on every verify row,
and keeps each only where it would have produced it. Greedy output equals step-by-step
decoding by construction; sampled output follows the masked distribution exactly, as with
any draft.

A forced draft is the only text the grammar allows next, so it is rejected only where the
model would split the same text differently; it is not turned down by the batch size as
other drafts are (`SpeculativeConfig.num_drafts_for_batch`): the tokens it adds to a step
are tokens a later step would have computed anyway.
"""

from __future__ import annotations

from asyncengine.request import Request
from asyncengine.spec_decode.config import MAX_SPECULATIVE_TOKENS

# Forced drafts per verify step and request: a schema's fixed runs are rarely longer.
MAX_FORCED_DRAFTS = MAX_SPECULATIVE_TOKENS


def forced_drafts(req: Request, limit: int) -> list[int]:
    """Up to `limit` (and `MAX_FORCED_DRAFTS`) tokens the request's grammar forces next;
    [] for an unconstrained request or where the grammar leaves a choice."""
    if req.grammar is None or limit <= 0:
        return []
    return req.grammar.jump_forward_tokens()[: min(limit, MAX_FORCED_DRAFTS)]
