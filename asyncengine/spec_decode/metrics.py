"""Speculative decoding counters, with vLLM's meanings: drafts (verify steps of a request
that carried drafts), draft tokens, accepted tokens, and accepted tokens by draft position.
The acceptance rate and the mean acceptance length derive from them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingMetrics:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step emits per request on average: the accepted drafts plus the
        token the target adds (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
