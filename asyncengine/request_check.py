"""The one check a request passes before it is queued, for every entry point.

`LLMEngine.add_request` runs it on the step thread; `AsyncLLMEngine.add_request` and the
frontends run it on the event loop before submitting (it only reads sizes fixed at start-up,
so it is cheap and thread-safe), so a refused request never reaches the engine. Failures raise
the typed errors of `asyncengine.errors`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Sequence

from asyncengine.errors import (
    DuplicateRequestIdError,
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
)
from asyncengine.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the engine can ever hold, fixed when it starts."""

    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int


@dataclasses.dataclass(frozen=True, slots=True)
class QueueLimits:
    """How much may wait for a first token; a frontend's admission limits."""

    max_queued_requests: int
    max_queued_prompt_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class QueueState:
    """What waits for a first token now, and the limits it must stay within."""

    num_queued_requests: int
    num_queued_prompt_tokens: int
    limits: QueueLimits


def check_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    limits: RequestLimits,
    *,
    in_use: Container[str] = (),
    queue: QueueState | None = None,
) -> int:
    """Raise the typed error for the first problem found; return the request's max_tokens
    (its own, or all the room `max_model_len` leaves when it set none)."""
    check_request_id(request_id, in_use)
    params.validate()
    check_prompt_ids(prompt_token_ids, limits.vocab_size)
    max_tokens = check_length(len(prompt_token_ids), params.max_tokens, limits)
    check_parallel(params.n, len(prompt_token_ids), max_tokens, limits)
    if queue is not None:
        check_queue(queue, len(prompt_token_ids))
    return max_tokens


def check_request_id(request_id: str, in_use: Container[str]) -> None:
    if request_id in in_use:
        raise DuplicateRequestIdError(
            f"request_id {request_id!r} is already in flight", field="request_id"
        )


def check_prompt_ids(prompt_token_ids: Sequence[int], vocab_size: int) -> None:
    if not prompt_token_ids:
        raise InvalidRequestError("prompt is empty", field="prompt")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})",
            field="prompt_token_ids",
        )


def check_length(num_prompt: int, max_tokens: int | None, limits: RequestLimits) -> int:
    """The prompt and its output must fit `max_model_len` and the whole KV pool."""
    max_len = limits.max_model_len
    room = max_len - num_prompt
    if room < 1:
        raise PromptTooLongError(
            f"prompt has {num_prompt} tokens; max_model_len {max_len} leaves no room",
            field="prompt",
        )
    if max_tokens is None:
        max_tokens = room
    total = num_prompt + max_tokens
    if total > max_len:
        raise PromptTooLongError(
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
            f"({max_len})",
            field="max_tokens",
        )
    blocks = -(-total // limits.block_size)
    if blocks > limits.num_kv_blocks:
        raise PromptTooLongError(
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs {blocks} KV "
            f"blocks but the pool has only {limits.num_kv_blocks} (of {limits.block_size} "
            "tokens)",
            field="max_tokens",
        )
    return max_tokens


def parallel_blocks(n: int, num_prompt: int, max_tokens: int, block_size: int) -> int:
    """KV blocks n samples of one prompt hold at most: one sequence's, plus for each other
    sample all but the full blocks of the prompt it shares (the shared partial block is
    copied on its first write)."""
    per_seq = -(-(num_prompt + max_tokens) // block_size)
    shared = (num_prompt - 1) // block_size
    return per_seq + (n - 1) * (per_seq - shared)


def check_parallel(n: int, num_prompt: int, max_tokens: int, limits: RequestLimits) -> None:
    """All n samples of the prompt must fit the KV pool at once."""
    if n == 1:
        return
    blocks = parallel_blocks(n, num_prompt, max_tokens, limits.block_size)
    if blocks > limits.num_kv_blocks:
        raise InvalidRequestError(
            f"n = {n} samples of a {num_prompt}-token prompt with max_tokens {max_tokens} "
            f"need up to {blocks} KV blocks but the pool has only {limits.num_kv_blocks} (of "
            f"{limits.block_size} tokens)",
            field="n",
        )


def check_queue(queue: QueueState, num_prompt: int) -> None:
    """One more request must keep the waiting queue within its limits; a lone request is
    admitted whatever its prompt length, so a long prompt cannot be refused forever."""
    limits = queue.limits
    if queue.num_queued_requests >= limits.max_queued_requests or (
        queue.num_queued_requests > 0
        and queue.num_queued_prompt_tokens + num_prompt > limits.max_queued_prompt_tokens
    ):
        raise OverloadedError("server is overloaded: the waiting queue is full, retry later")
