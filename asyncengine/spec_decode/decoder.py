"""The engine's speculative decoding coordinator: who speculates this step and with how many
drafts, and what a verify step's verdicts do to the requests.

Before each schedule, `propose` asks the proposer for drafts for the running requests that
are decoding (prompt computed, no token in flight), up to `num_speculative_tokens`, fewer as
the batch grows (`SpeculativeConfig.num_drafts_for_batch`), never past max_tokens or
max_model_len. The scheduler budgets the drafts with the request's last token; the runner
gets the target's logits at all those positions and verifies them (`verify`).

After a verify step, `on_verified` rolls each request back to what was kept: its computed
tokens drop to the last known token plus the accepted drafts (the rejected drafts' K/V is
garbage) and the blocks reserved past that are freed. It also keeps the adaptive state:
a request whose drafts keep failing stops proposing for a while, and the pause doubles each
time it fails again (up to `MAX_COOLDOWN` steps), so a workload that gains nothing pays for a
verify step only now and then.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from asyncengine.block_pool import BlockPool
from asyncengine.request import Request
from asyncengine.spec_decode.config import SpeculativeConfig
from asyncengine.spec_decode.cost import StepCostMeter
from asyncengine.spec_decode.metrics import SpecDecodingMetrics
from asyncengine.spec_decode.verify import SpecVerdict

# Accepted tokens per verify step, smoothed; below this a request pauses speculation.
MIN_ACCEPTED_EMA = 0.25
FIRST_COOLDOWN = 4
MAX_COOLDOWN = 64


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        """Up to `num_drafts[i]` draft tokens continuing `requests[i]`'s tokens."""
        ...


@dataclass
class SpecState:
    """A request's recent luck with drafts."""

    accepted_ema: float = 1.0
    cooldown: int = 0  # steps left without proposing
    next_cooldown: int = FIRST_COOLDOWN


class SpecDecoder:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        pool: BlockPool,
        max_model_len: int,
        *,
        count_empty_proposals: bool = False,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.pool = pool
        self.max_model_len = max_model_len
        # With asynchronous scheduling a request that may speculate costs an overlap even
        # when nothing is found to propose; then empty proposals count as failures too.
        self.count_empty_proposals = count_empty_proposals
        self.metrics = SpecDecodingMetrics(config.num_speculative_tokens)
        self.cost = StepCostMeter()  # fed by the engine: `observe_step`
        self._batch_drafts = config.num_speculative_tokens

    # ------------------------------------------------------------- proposing
    @staticmethod
    def _serves(req: Request) -> bool:
        # Constrained requests wait for the grammar mask to cover verify rows.
        return getattr(req.params, "structured_outputs", None) is None

    @staticmethod
    def _state(req: Request) -> SpecState:
        if req.spec_state is None:
            req.spec_state = SpecState()
        return req.spec_state

    def propose(self, running: Sequence[Request]) -> None:
        """Set `spec_token_ids` of every running request for the coming schedule."""
        k = self._batch_drafts = self.config.num_drafts_for_batch(len(running))
        batch: list[Request] = []
        room: list[int] = []
        for req in running:
            req.spec_token_ids = []
            if k == 0 or req.num_pending_tokens or req.num_tokens_to_compute != 1:
                continue
            if not self._serves(req):
                continue
            state = self._state(req)
            if state.cooldown:
                state.cooldown -= 1
                continue
            n = min(
                k,
                req.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens,
            )
            if n > 0:
                batch.append(req)
                room.append(n)
        if not batch:
            return
        for req, n, drafts in zip(batch, room, self.proposer.propose(batch, room), strict=True):
            req.spec_token_ids = list(drafts[:n])
            if not drafts and self.count_empty_proposals:
                self._update(req, 0)

    def wants_sync(self, requests: Iterable[Request]) -> bool:
        """Whether a step holding these requests must be resolved before the next schedule:
        one of them may speculate then, and drafts continue the request's known tokens."""
        if self._batch_drafts == 0:
            return False
        return any(
            not r.is_finished
            and self._serves(r)
            and (r.spec_state is None or r.spec_state.cooldown == 0)
            for r in requests
        )

    # ------------------------------------------------------------- verdicts
    def on_verified(self, verdicts: Sequence[SpecVerdict]) -> None:
        """Apply a verify step's verdicts before its tokens are appended."""
        for v in verdicts:
            req = v.request
            req.spec_token_ids = []
            if req.is_finished:  # aborted while in flight: its blocks are gone
                continue
            self.metrics.observe(v.num_draft_tokens, v.num_accepted_tokens)
            req.num_computed_tokens -= v.num_draft_tokens - v.num_accepted_tokens
            # Kept: the computed tokens and the slot of the token the target just added.
            self.pool.free_tail(req, req.num_computed_tokens + 1)
            self._update(req, v.num_accepted_tokens)

    def observe_step(self, seconds: float, *, verify: bool) -> None:
        """One step's period as the engine saw it (tokens to tokens), by kind."""
        self.cost.observe(seconds, verify=verify)

    def _update(self, req: Request, num_accepted: int) -> None:
        state = self._state(req)
        state.accepted_ema = 0.5 * state.accepted_ema + 0.5 * num_accepted
        # A verify step costing r plain steps pays when it keeps more than r tokens: the
        # request pauses once its smoothed accepted drafts fall below r - 1.
        needed = max(MIN_ACCEPTED_EMA, self.cost.ratio - 1.0)
        if num_accepted >= needed:
            state.next_cooldown = FIRST_COOLDOWN
        if state.accepted_ema < needed:
            state.cooldown = state.next_cooldown
            state.next_cooldown = min(2 * state.next_cooldown, MAX_COOLDOWN)
            state.accepted_ema = 1.0  # the next try starts fresh
