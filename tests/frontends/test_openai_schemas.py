"""Request bodies, their sampling params and error fields; outputs mapped to choices; the
status and shape of each refusal. No server: the pieces the HTTP tests build on."""

from __future__ import annotations

import msgspec
import pytest

from asyncengine.errors import (
    ErrorCode,
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
)
from asyncengine.outputs import CompletionOutput
from frontends.openai_api.errors import ApiError
from frontends.openai_api.responses import ChatMapper, CompletionMapper
from frontends.openai_api.schemas import decode_chat, decode_completion


def test_nulls_mean_defaults_and_vllm_fields_reach_sampling_params() -> None:
    req = decode_completion(b'{"prompt": "x", "temperature": null, "top_p": null, "n": null,'
                            b' "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,'
                            b' "ignore_eos": true, "min_tokens": 2, "max_tokens": 9,'
                            b' "user": "u", "unknown_field": [1]}')
    p = req.sampling_params()
    assert (p.temperature, p.top_p, p.n, p.max_tokens) == (1.0, 1.0, 1, 9)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos, p.min_tokens) == (
        5, 0.1, 1.2, True, 2)
    assert decode_completion(b'{"prompt": "x", "max_tokens": null}').sampling_params() \
        .max_tokens is None  # all the room max_model_len leaves
    assert decode_chat(b'{"messages": []}').sampling_params().max_tokens is None


@pytest.mark.parametrize(("prompt", "expected"), [
    ('"hi"', ["hi"]),
    ("[1, 2, 3]", [[1, 2, 3]]),
    ('["a", "b"]', ["a", "b"]),
    ("[[1], [2, 3]]", [[1], [2, 3]]),
])
def test_prompt_forms(prompt: str, expected: list[object]) -> None:
    assert decode_completion(f'{{"prompt": {prompt}}}'.encode()).prompts() == expected


@pytest.mark.parametrize("prompt", ["[]", '[1, "a"]', "[[1], []]", "[true]", "[1.5]", "[{}]"])
def test_bad_prompt_forms_name_prompt(prompt: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode_completion(f'{{"prompt": {prompt}}}'.encode()).prompts()
    assert info.value.field == "prompt"


@pytest.mark.parametrize(("body", "field"), [
    (b'{"prompt": "x", "max_tokens": "3"}', "max_tokens"),
    (b'{"prompt": "x", "stream_options": {"include_usage": 3}}',
     "stream_options.include_usage"),
    (b'{"max_tokens": 3}', "prompt"),
    (b'{"prompt": "x", "stop": [1]}', "stop[0]"),
    (b"[]", None),
    (b"{", None),
    (b"[" * 100_000 + b"]" * 100_000, None),
])
def test_decode_errors_name_the_field(body: bytes, field: str | None) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode_completion(body)
    assert info.value.field == field


def test_chat_names_its_own_fields_in_engine_errors() -> None:
    req = decode_chat(b'{"messages": [{"role": "user", "content": "x"}], '
                      b'"max_completion_tokens": 5, "logprobs": true, "top_logprobs": 3}')
    assert req.sampling_params().max_tokens == 5 and req.sampling_params().logprobs == 3
    assert req.param_name("max_tokens") == "max_completion_tokens"
    assert req.param_name("logprobs") == "top_logprobs"
    assert req.param_name("prompt") == req.param_name("prompt_token_ids") == "messages"
    parts = decode_chat(b'{"messages": [{"role": "user", "content": '
                        b'[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}')
    assert parts.template_messages() == [{"role": "user", "content": "a\nb"}]
    with pytest.raises(InvalidRequestError, match="stream_options") as info:
        decode_chat(b'{"messages": [], "stream_options": {}}').sampling_params()
    assert info.value.field == "stream_options"


def _out(text: str, ids: list[int], finish: str | None = None, index: int = 0,
         logprobs: list[dict[int, float]] | None = None) -> CompletionOutput:
    return CompletionOutput(index=index, text=text, token_ids=ids, finish_reason=finish,
                            logprobs=logprobs)


def test_choices_of_several_prompts_and_samples_share_one_usage() -> None:
    # Two prompts of 3 and 4 tokens, two samples each: four choices, prompts counted once.
    m = CompletionMapper("cmpl-1", "m", [3, 4], str, None, n=2, echo=["p0", "p1"])
    first = m.chunk(3, _out("a", [1]))
    assert first.choices[0].index == 3 and first.choices[0].text == "p1a"
    m.chunk(3, _out("b", [2, 3], "length"))
    m.chunk(0, _out("c", [4], "stop"))
    final = m.final()
    assert [c.text for c in final.choices] == ["p0c", "p0", "p1", "p1ab"]
    assert [c.finish_reason for c in final.choices] == ["stop", None, None, "length"]
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (7, 4)
    usage = m.usage_chunk()
    assert usage.choices == [] and usage.usage.total_tokens == 11


def test_logprobs_keep_the_sampled_token_when_texts_collide() -> None:
    text = {1: "x", 2: "x", 3: "y"}.__getitem__  # ids 1 and 2 decode alike
    m = CompletionMapper("cmpl-1", "m", [1], text, 3)
    chunk = m.chunk(0, _out("xy", [1, 3], logprobs=[{1: -0.5, 2: -0.1, 3: -2.0},
                                                     {3: -0.2, 1: -1.0}]))
    lp = chunk.choices[0].logprobs
    assert lp.tokens == ["x", "y"] and lp.token_logprobs == [-0.5, -0.2]
    assert lp.top_logprobs[0] == {"x": -0.5, "y": -2.0} and lp.text_offset == [0, 1]
    chat = ChatMapper("chatcmpl-1", "m", [1], text, 1)
    [tok] = chat.chunk(0, _out("y", [3], logprobs=[{3: -0.2, 1: -1.0}])).choices[0] \
        .logprobs.content
    assert (tok.token, tok.logprob, tok.bytes) == ("y", -0.2, [121])
    assert [(t.token, t.logprob) for t in tok.top_logprobs] == [("y", -0.2)]
    assert chat.final().choices[0].logprobs.content == [tok]


@pytest.mark.parametrize(("exc", "status", "kind", "headers"), [
    (InvalidRequestError("bad", field="top_p"), 400, "invalid_request_error", {}),
    (PromptTooLongError("long", field="max_tokens"), 400, "invalid_request_error", {}),
    (OverloadedError("full"), 429, "rate_limit_error", {"Retry-After": "1"}),
])
def test_refusals_map_to_status_type_and_headers(exc: InvalidRequestError | OverloadedError,
                                                 status: int, kind: str,
                                                 headers: dict[str, str]) -> None:
    err = ApiError.from_request_error(exc)
    body = msgspec.to_builtins(err.body())
    assert err.status == status and err.headers == headers
    assert body == {"error": {"message": exc.message, "type": kind, "param": exc.field,
                              "code": str(exc.code)}}
    assert ApiError.of(ErrorCode.UNAUTHORIZED, "k").headers == {"WWW-Authenticate": "Bearer"}
