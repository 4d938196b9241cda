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
a request whose drafts keep failing stops proposing for a while. Its accepted drafts are
smoothed slowly, so that the misses a good acceptance rate still has (at 0.7, three drafts in
ten are wrong) seldom pause it; back from a pause it gets less credit, and each pause that
follows a streak with no paying step is twice as long (up to `MAX_COOLDOWN` steps). A
workload that gains nothing so pays for a verify step only now and then.

Constrained requests (structured outputs): with jump-forward on, the tokens the grammar
forces next are their drafts (`forced`), ahead of the proposer's; the proposer's drafts are
cut at the first one the grammar forbids, so no forbidden draft is ever verified. Forced
drafts are counted apart (`forced_metrics`) and leave the pauses alone; their number per
request adapts instead (`FIRST_FORCED_CAP`): a rejected forced draft is one the model splits
differently, and the drafts after it were wasted rows. Without a
`speculative_config` (`config` None) only forced drafts are proposed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from asyncengine.block_pool import BlockPool
from asyncengine.request import Request
from asyncengine.spec_decode.config import SpeculativeConfig
from asyncengine.spec_decode.cost import StepCostMeter
from asyncengine.spec_decode.forced import MAX_FORCED_DRAFTS, forced_drafts
from asyncengine.spec_decode.metrics import SpecDecodingMetrics
from asyncengine.spec_decode.verify import SpecVerdict

# Accepted tokens per verify step, smoothed; below this a request pauses speculation.
MIN_ACCEPTED_EMA = 0.25
# Weight of the newest verify step in that mean. At 0.5 two misses in a row paused a request
# drafting at acceptance 0.7 (9 % of its step pairs), at 0.25 five or six do.
ACCEPTED_SMOOTHING = 0.25
# Where the mean starts, above what a verify step needs: a fresh request is given five
# misses in a row on an H200 (a verify step costs about 1.4 plain ones there), one back from
# a pause two. Simulated at k = 4 (tests/asyncengine/spec_decode/test_cost.py), this keeps
# 99 % of the verify steps at acceptance 0.7 and 76 % at 0.5, and costs about 2.5 % of a
# 256-token run at acceptance 0.
FIRST_CREDIT = 1.0
RETRY_CREDIT = 0.25
FIRST_COOLDOWN = 4
MAX_COOLDOWN = 64
# Forced drafts per request start at this many, double while all are kept, and drop to one
# past the kept ones on a rejection: the model may split forced text its own way.
FIRST_FORCED_CAP = 4
# How often a request's proposals found drafts, smoothed with this weight; the next verify
# step is bet on (`next_step_verifies`) only at or above `BET_MIN_DRAFTED`. On the GPU a
# lost bet is a 7B forward on padding, and a plain step run in the verify graph costs about
# 0.8 ms more than in its own (H200, 2026-12-06): worth a bet's 0.1 ms only when proposals
# seldom come back empty.
DRAFTED_SMOOTHING = 0.25
BET_MIN_DRAFTED = 0.9


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        """Up to `num_drafts[i]` draft tokens continuing `requests[i]`'s tokens. A proposer
        that samples its drafts sets `Request.spec_draft_probs` to the distributions it drew
        them from (else they are point masses)."""
        ...


@dataclass
class SpecState:
    """A request's recent luck with drafts."""

    accepted_ema: float | None = None  # None: a fresh start (`_update` seeds it)
    cooldown: int = 0  # steps left without proposing
    next_cooldown: int = FIRST_COOLDOWN
    retry: bool = False  # back from a pause: its mean starts at `RETRY_CREDIT`
    forced: bool = False  # its current drafts are grammar-forced
    forced_cap: int = FIRST_FORCED_CAP  # forced drafts it may get next
    drafted_ema: float = 1.0  # how often its proposals found drafts, smoothed


class SpecDecoder:
    def __init__(
        self,
        config: SpeculativeConfig | None,
        proposer: Proposer | None,
        pool: BlockPool,
        max_model_len: int,
        *,
        count_empty_proposals: bool = False,
        jump_forward: bool = False,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.pool = pool
        self.max_model_len = max_model_len
        # With asynchronous scheduling a request that may speculate costs an overlap even
        # when nothing is found to propose; then empty proposals count as failures too.
        self.count_empty_proposals = count_empty_proposals
        self.jump_forward = jump_forward
        self.metrics = SpecDecodingMetrics(config.num_speculative_tokens if config else 0)
        self.forced_metrics = SpecDecodingMetrics(MAX_FORCED_DRAFTS)
        self.cost = StepCostMeter()  # fed by the engine: `observe_step`
        self._batch_drafts = config.num_speculative_tokens if config else 0

    # ------------------------------------------------------------- proposing
    @staticmethod
    def _state(req: Request) -> SpecState:
        if req.spec_state is None:
            req.spec_state = SpecState()
        return req.spec_state

    def propose(self, running: Sequence[Request]) -> None:
        """Set `spec_token_ids` of every running request for the coming schedule."""
        k = 0
        if self.config is not None and self.proposer is not None:
            k = self.config.num_drafts_for_batch(len(running))
        self._batch_drafts = k
        batch: list[Request] = []
        room: list[int] = []
        for req in running:
            req.spec_token_ids = []
            req.spec_draft_probs = None
            if req.spec_state is not None:
                req.spec_state.forced = False
            in_flight = req.num_pending_tokens > 0
            if not in_flight and req.num_tokens_to_compute != 1:
                continue  # still in its prompt
            # Never past max_tokens (the target adds a token) nor max_model_len.
            n = min(req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens)
            if self.jump_forward and req.grammar is not None and not in_flight:
                state = self._state(req)
                req.spec_token_ids = forced_drafts(req, min(n, state.forced_cap))
                state.forced = bool(req.spec_token_ids)
                if req.spec_token_ids:
                    continue
            if k == 0:
                continue
            state = self._state(req)
            if state.cooldown:
                # A pause counts the request's decode steps, those that overlap its previous
                # step too: a paused request is not resolved before the next schedule, so
                # its token is usually in flight here.
                state.cooldown -= 1
                continue
            if in_flight:
                continue  # drafts continue known tokens: `wants_sync` resolves it next time
            if min(k, n) > 0:
                batch.append(req)
                room.append(min(k, n))
        if not batch:
            return
        assert self.proposer is not None
        for req, n, drafts in zip(batch, room, self.proposer.propose(batch, room), strict=True):
            drafts = list(drafts[:n])
            # Verify only what the grammar allows. Cutting at a forbidden draft is exact for
            # point masses only, so draft models draft constrained requests by argmax.
            if req.grammar is not None:
                drafts = drafts[: req.grammar.num_allowed(drafts)]
            req.spec_token_ids = drafts
            state = self._state(req)
            state.drafted_ema += DRAFTED_SMOOTHING * (bool(drafts) - state.drafted_ema)
            if not drafts and self.count_empty_proposals:
                self._update(req, 0)

    def wants_sync(self, requests: Iterable[Request]) -> bool:
        """Whether a step holding these requests must be resolved before the next schedule:
        one of them may speculate then, and drafts continue the request's known tokens."""
        if self.jump_forward and any(r.grammar is not None and not r.is_finished
                                     for r in requests):
            return True  # forced drafts follow from the grammar's state after its last token
        if self._batch_drafts == 0:
            return False
        return any(
            not r.is_finished and (r.spec_state is None or r.spec_state.cooldown == 0)
            for r in requests
        )

    def next_step_verifies(self, scheduled: Sequence[tuple[Request, int]]) -> bool:
        """Whether the step after this verify step (requests with their draft counts) is
        likely the same verify step again: every request drafted, and its proposals seldom
        come back empty, none constrained, none able to reach its length limits in two
        steps, and none that a verdict keeping no draft would pause.
        `ModelRunner.prelaunch_next` bets on it."""
        if not scheduled or self.proposer is None or self.jump_forward:
            return False
        needed = self._needed_accepted()
        for req, k in scheduled:
            if k == 0 or req.grammar is not None:
                return False
            if (req.num_output_tokens + 2 * (k + 1) >= req.max_tokens
                    or req.num_tokens + 2 * (k + 1) >= self.max_model_len):  # fmt: skip
                return False
            state = self._state(req)
            if state.forced or state.drafted_ema < BET_MIN_DRAFTED:
                return False
            if _smoothed_accepted(state, 0, needed) < needed:
                return False
        return True

    # ------------------------------------------------------------- verdicts
    def on_verified(self, verdicts: Sequence[SpecVerdict]) -> None:
        """Apply a verify step's verdicts before its tokens are appended."""
        for v in verdicts:
            req = v.request
            req.spec_token_ids = []
            req.spec_draft_probs = None
            if req.is_finished:  # aborted while in flight: its blocks are gone
                continue
            state = self._state(req)
            forced = state.forced
            metrics = self.forced_metrics if forced else self.metrics
            metrics.observe(v.num_draft_tokens, v.num_accepted_tokens)
            if forced:
                state.forced_cap = (
                    min(2 * state.forced_cap, MAX_FORCED_DRAFTS)
                    if v.num_accepted_tokens == v.num_draft_tokens
                    else v.num_accepted_tokens + 1
                )
            req.num_computed_tokens -= v.num_draft_tokens - v.num_accepted_tokens
            # Kept: the computed tokens and the slot of the token the target just added.
            self.pool.free_tail(req, req.num_computed_tokens + 1)
            if not forced:
                self._update(req, v.num_accepted_tokens)

    @property
    def max_verify_rows(self) -> int:
        """The rows of the largest verify step CUDA graphs are captured for: the proposer's
        drafts within the per-step cap, and one request's grammar-forced drafts (a batch of
        constrained requests with forced drafts past that runs eagerly)."""
        rows = self.config.max_verify_rows if self.config is not None else 0
        return max(rows, MAX_FORCED_DRAFTS + 1 if self.jump_forward else 0)

    def observe_step(self, seconds: float, *, verify: bool) -> None:
        """One step's period as the engine saw it (tokens to tokens), by kind."""
        self.cost.observe(seconds, verify=verify)

    def _needed_accepted(self) -> float:
        """A verify step costing r plain steps pays when it keeps more than r tokens: the
        request pauses once its smoothed accepted drafts fall below r - 1."""
        return max(MIN_ACCEPTED_EMA, self.cost.ratio - 1.0)

    def _update(self, req: Request, num_accepted: int) -> None:
        state = self._state(req)
        needed = self._needed_accepted()
        if num_accepted >= needed:
            state.next_cooldown = FIRST_COOLDOWN
        # A retry's credit is spent by its first step (`retry` is set only with no mean).
        state.accepted_ema, state.retry = _smoothed_accepted(state, num_accepted, needed), False
        if state.accepted_ema < needed:
            state.cooldown = state.next_cooldown
            state.next_cooldown = min(2 * state.next_cooldown, MAX_COOLDOWN)
            state.accepted_ema, state.retry = None, True


def _smoothed_accepted(state: SpecState, num_accepted: int, needed: float) -> float:
    """The request's smoothed accepted drafts after a verify step keeping `num_accepted`; a
    fresh start, or the first step after a pause, starts its mean above `needed`."""
    ema = state.accepted_ema
    if ema is None:
        ema = needed + (RETRY_CREDIT if state.retry else FIRST_CREDIT)
    return ema + ACCEPTED_SMOOTHING * (num_accepted - ema)
