"""One request's state as it moves through the engine: tokens, progress, blocks, status.

A request with `SamplingParams.n > 1` is n `Request` sequences (one per sample, `index`
0..n-1) tied by a `ParentRequest`: the first prefills the prompt, the others are forked from
it and share its KV blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncengine.outputs import PromptLogprobs, RequestMetrics
from asyncengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from asyncengine.detokenizer import IncrementalDetokenizer
    from asyncengine.spec_decode.decoder import SpecState
    from asyncengine.structured_outputs.matcher import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass(eq=False)
class Request:
    """A request tracks only how many of its tokens are computed; there are no phases.

    Tokens `[0, num_computed_tokens)` have K/V in the cache. A step computes the next chunk;
    when it reaches the last known token the request gets logits and a new token.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens sampled by a step still in flight (asynchronous scheduling): counted as known,
    # their ids arrive when the step is resolved. At most one.
    num_pending_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # full blocks of block_table registered in the prefix cache
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    # Prompt logprobs (first sequence only; see `asyncengine.prompt_logprobs`): the entries
    # so far, the next prompt position to score, and whether a DELTA output carried them.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprob_pos: int = 0
    prompt_logprobs_sent: bool = False
    metrics: RequestMetrics = field(init=False)
    error: str | None = None
    # What was already handed out, for DELTA outputs.
    sent_text_len: int = 0
    sent_token_len: int = 0
    # Parallel sampling: which of the request's n samples this is, and the group it is in.
    index: int = 0
    parent: ParentRequest | None = field(default=None, repr=False)
    # Speculative decoding: drafts for the next step (not tokens of the request until the
    # target keeps them) and the proposer's adaptive state for this request.
    spec_token_ids: list[int] = field(default_factory=list)
    # The distributions its drafts were drawn from, float32 [len(drafts), vocab] on the
    # device (a draft model's drafts for a request that samples); None: point masses.
    spec_draft_probs: torch.Tensor | None = field(default=None, repr=False)
    spec_state: SpecState | None = field(default=None, repr=False)
    # Draft-model speculation: leading positions whose K/V the draft model holds in the
    # request's blocks (zero again whenever the request loses its blocks; a prefix-cache hit
    # starts it at the hit blocks that hold the draft's K/V, `BlockPool.draft_cached`, a
    # forked sample at its donor's within the shared positions).
    num_draft_computed_tokens: int = 0
    # Structured outputs: where its output stands in its grammar (None: unconstrained).
    grammar: GrammarState | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def siblings(self) -> list[Request]:
        """Every sequence of this request, this one included, in index order (itself alone
        unless it samples n > 1)."""
        return self.parent.seqs if self.parent is not None else [self]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens + self.num_pending_tokens - self.num_computed_tokens

    @property
    def reaches_max_tokens(self) -> bool:
        """True once the tokens in flight bring it to max_tokens: it needs no more steps."""
        return self.num_output_tokens + self.num_pending_tokens >= self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def sampling_needs_history(self) -> bool:
        """Whether its next token depends on the exact output so far: penalties, or EOS
        still banned by min_tokens. Such a request takes the full sampler, and under
        asynchronous scheduling its token in flight from the device
        (`model_runner._in_flight`); a grammar takes it from the step that sampled it (see
        `GrammarMasker`); drafts, grammar-forced ones included, are
        `SpecDecoder.wants_sync`'s."""
        p = self.params
        return (
            p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or self.num_output_tokens < p.min_tokens
        )

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


@dataclass(eq=False)
class ParentRequest:
    """The n sequences of one request with `n > 1`, in index order.

    Each has its own tokens, generator, detokenizer and finish status; the prompt's KV blocks
    are computed once and shared by reference (see `BlockPool.fork`).
    """

    request_id: str
    seqs: list[Request]

    @classmethod
    def link(cls, seqs: list[Request]) -> ParentRequest:
        """Tie the sequences of one request (indexes 0..n-1, in order) into a group."""
        if [s.index for s in seqs] != list(range(len(seqs))):
            raise ValueError("a request's sequences must have indexes 0..n-1 in order")
        group = cls(seqs[0].request_id, seqs)
        for seq in seqs:
            seq.parent = group
        return group

    @property
    def num_prompt_tokens(self) -> int:
        return self.seqs[0].num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def fork_point(self) -> int:
        """Tokens a forked sequence takes from its donor: the prompt less its last token,
        whose logits each sequence computes itself to sample its own first token."""
        return self.num_prompt_tokens - 1
