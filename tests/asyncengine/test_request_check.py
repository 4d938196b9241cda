"""The request check: each refusal's typed error, code and field, and what it lets through."""

from __future__ import annotations

import pytest

from asyncengine.errors import (
    DuplicateRequestIdError,
    ErrorCode,
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
    RequestError,
)
from asyncengine.request_check import (
    QueueLimits,
    QueueState,
    RequestLimits,
    check_request,
    parallel_blocks,
)
from asyncengine.sampling_params import SamplingParams

LIMITS = RequestLimits(vocab_size=100, max_model_len=64, num_kv_blocks=3, block_size=16)


def refusal(prompt: list[int], params: SamplingParams | None = None, **kw: object) -> RequestError:
    with pytest.raises(RequestError) as info:
        check_request("r", prompt, params or SamplingParams(), LIMITS, **kw)  # type: ignore[arg-type]
    return info.value


def test_an_acceptable_request_passes_and_gets_its_max_tokens() -> None:
    assert check_request("r", [1, 2, 3], SamplingParams(max_tokens=5), LIMITS) == 5
    # No max_tokens: all the room max_model_len leaves (64 tokens take 4 blocks of 16).
    roomy = RequestLimits(vocab_size=100, max_model_len=64, num_kv_blocks=4, block_size=16)
    assert check_request("r", [1, 2, 3], SamplingParams(max_tokens=None), roomy) == 61


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "cls", "code", "field", "words"),
    [
        ([], 4, InvalidRequestError, ErrorCode.INVALID_REQUEST, "prompt", "empty"),
        ([1, 100], 4, InvalidRequestError, ErrorCode.INVALID_REQUEST, "prompt_token_ids",
         "token id 100 is outside the vocabulary [0, 100)"),
        ([1, -1], 4, InvalidRequestError, ErrorCode.INVALID_REQUEST, "prompt_token_ids",
         "token id -1"),
        ([1] * 64, None, PromptTooLongError, ErrorCode.PROMPT_TOO_LONG, "prompt",
         "leaves no room"),
        ([1] * 60, 5, PromptTooLongError, ErrorCode.PROMPT_TOO_LONG, "max_tokens",
         "exceeds max_model_len (64)"),
        # 40 + 20 tokens fit max_model_len but need 4 blocks of 16 of the 3 there are.
        ([1] * 40, 20, PromptTooLongError, ErrorCode.PROMPT_TOO_LONG, "max_tokens",
         "needs 4 KV blocks but the pool has only 3"),
    ],
)
def test_prompt_refusals(prompt: list[int], max_tokens: int | None, cls: type, code: ErrorCode,
                         field: str, words: str) -> None:
    err = refusal(prompt, SamplingParams(max_tokens=max_tokens))
    assert type(err) is cls and isinstance(err, ValueError)
    assert (err.code, err.field) == (code, field)
    assert words in err.message and str(err) == err.message


def test_parallel_samples_must_fit_the_pool_together() -> None:
    # 33 + 8 tokens: 3 blocks for one sample; the others share the prompt's 2 full blocks.
    assert parallel_blocks(1, 33, 8, 16) == 3
    assert parallel_blocks(4, 33, 8, 16) == 3 + 3 * 1
    assert parallel_blocks(2, 1, 8, 16) == 2  # a 1-token prompt: nothing to share
    limits = RequestLimits(vocab_size=100, max_model_len=64, num_kv_blocks=6, block_size=16)
    assert check_request("r", [1] * 33, SamplingParams(n=4, max_tokens=8), limits) == 8
    with pytest.raises(InvalidRequestError) as info:
        check_request("r", [1] * 33, SamplingParams(n=5, max_tokens=8), limits)
    err = info.value
    assert (err.code, err.field) == (ErrorCode.INVALID_REQUEST, "n")
    assert "n = 5 samples" in err.message and "need up to 7 KV blocks" in err.message
    params = SamplingParams()
    params.n = 0  # changed after construction, which validated it
    assert refusal([1, 2], params).field == "n"


def test_duplicate_request_id() -> None:
    err = refusal([1, 2], in_use={"r"})
    assert type(err) is DuplicateRequestIdError and isinstance(err, ValueError)
    assert (err.code, err.field) == (ErrorCode.DUPLICATE_REQUEST_ID, "request_id")
    assert check_request("s", [1, 2], SamplingParams(), LIMITS, in_use={"r"}) == 16


def test_sampling_params_are_checked_again() -> None:
    params = SamplingParams()
    params.top_p = 0.0  # changed after construction, which validated it
    err = refusal([1, 2], params)
    assert type(err) is InvalidRequestError
    assert (err.code, err.field) == (ErrorCode.INVALID_REQUEST, "top_p")


def test_bad_sampling_params_raise_on_construction_with_their_field() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(temperature=-1)
    assert (info.value.code, info.value.field) == (ErrorCode.INVALID_REQUEST, "temperature")


@pytest.mark.parametrize(
    ("queued", "queued_tokens", "prompt_len", "refused"),
    [
        (0, 0, 10, False),
        (1, 80, 10, False),  # 90 of 100 tokens
        (1, 95, 10, True),  # 105 tokens: over
        (2, 0, 10, True),  # 2 of 2 requests already
        (0, 0, 30, False),  # alone, a prompt is admitted whatever the token limit
    ],
)
def test_queue_limits(queued: int, queued_tokens: int, prompt_len: int, refused: bool) -> None:
    limits = RequestLimits(vocab_size=100, max_model_len=1000, num_kv_blocks=100, block_size=16)
    queue = QueueState(queued, queued_tokens, QueueLimits(max_queued_requests=2,
                                                          max_queued_prompt_tokens=25 + 75))
    if not refused:
        check_request("r", [1] * prompt_len, SamplingParams(), limits, queue=queue)
        return
    with pytest.raises(OverloadedError) as info:
        check_request("r", [1] * prompt_len, SamplingParams(), limits, queue=queue)
    err = info.value
    assert err.code == ErrorCode.OVERLOADED and err.field is None
    assert not isinstance(err, ValueError)  # the request is fine: retry later
