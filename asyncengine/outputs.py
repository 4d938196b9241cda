"""Request outputs returned by the engine, named and shaped as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log probability at a position, as vLLM's `Logprob`: `rank` counts the
    vocabulary's tokens at least as likely (1 = the most likely), `decoded_token` is its text
    (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token: None for the first (nothing predicts it), then {token id: Logprob} holding
# the prompt's own token and the top-k alternatives.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request: `index` tells the request's n samples apart
    (0..n-1), each with its own finish reason.

    `logprobs`, when requested, holds per generated token a dict of token id to log
    probability: the sampled token plus the top-N alternatives.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0


@dataclass
class RequestOutput:
    """The state of one request after a step (cumulative, delta or final, per its params).

    `outputs` holds a `CompletionOutput` per sample (DELTA: only the samples with news);
    `finished` once every sample has finished. `prompt_logprobs` (with
    `SamplingParams.prompt_logprobs`) comes whole: in every CUMULATIVE output, in the first
    DELTA output, in the FINAL_ONLY output.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = field(default=None)
    prompt_logprobs: PromptLogprobs | None = None
