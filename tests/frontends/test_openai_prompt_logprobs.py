"""Prompt logprobs through the OpenAI API: `echo` with `logprobs` (the prompt's token
logprobs first, as lm-evaluation-harness reads them), `max_tokens: 0` with echo, vLLM's
`prompt_logprobs` field on completions and chat, streamed and not, equal to the offline
engine's; and the refusals naming their field."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.sampling_params import SamplingParams
from frontends.openai_api import OpenAIConfig, OpenAIServer, serve_openai

from .conftest import UNIT, _offline_llm

MODEL = "tiny"


@pytest.fixture
async def api(engine: AsyncLLMEngine) -> AsyncIterator[OpenAIServer]:
    async with serve_openai(engine, OpenAIConfig(port=0, served_model_name=MODEL)) as srv:
        yield srv


async def post(api: OpenAIServer, path: str, body: dict[str, Any]) -> httpx2.Response:
    async with httpx2.AsyncClient(base_url=api.url, timeout=60 * UNIT) as http:
        return await http.post(path, json={"model": MODEL, **body})


def offline(model_dir: Path, prompt: str | list[int], k: int) -> Any:
    """The offline engine's greedy output with prompt logprobs (the oracle)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    return _offline_llm(str(model_dir)).generate([prompt], params, use_tqdm=False)[0]


async def test_echo_with_logprobs_leads_with_the_prompts(api: OpenAIServer,
                                                         model_dir: Path) -> None:
    """lm-evaluation-harness's loglikelihood request: token-id prompts in a batch,
    `echo`, `logprobs: 1`, `max_tokens: 1`."""
    prompts = [[5, 17, 99, 3, 250, 41], [7, 7, 300]]
    r = await post(api, "/v1/completions", {"prompt": prompts, "echo": True, "logprobs": 1,
                                            "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ids, choice in zip(prompts, choices, strict=True):
        want = offline(model_dir, ids, 1)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for pos in range(1, len(ids)):
            entry = want.prompt_logprobs[pos]
            assert lp["token_logprobs"][pos] == pytest.approx(entry[ids[pos]].logprob, abs=1e-6)
            top = lp["top_logprobs"][pos]
            # Keyed by text (tokens that decode alike share a key, the prompt token's kept).
            assert top[lp["tokens"][pos]] == lp["token_logprobs"][pos]
            assert 1 <= len(top) <= 2
            values = [v.logprob for v in entry.values()]
            assert all(min(abs(v - w) for w in values) < 1e-6 for v in top.values())
        # The generated token comes last; offsets run through the echoed text.
        assert lp["text_offset"] == sorted(lp["text_offset"])
        assert choice["prompt_logprobs"] is None  # only when asked by its own name


@pytest.mark.parametrize("stream", [False, True])
async def test_max_tokens_zero_echoes_the_prompt_alone(api: OpenAIServer, model_dir: Path,
                                                       stream: bool) -> None:
    prompt = "The quick brown fox"
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0, "stream": stream}
    r = await post(api, "/v1/completions", body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        lp: dict[str, list[Any]] = {"tokens": [], "token_logprobs": []}
        for c in chunks:
            for key in lp:
                lp[key] += (c["choices"][0]["logprobs"] or {}).get(key, [])
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = r.json()["choices"][0]
        text, lp, finish = choice["text"], choice["logprobs"], choice["finish_reason"]
        assert r.json()["usage"]["completion_tokens"] == 0
    want = offline(model_dir, prompt, 2)
    ids = want.prompt_token_ids
    assert text == prompt and finish == "length"
    assert len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(
        [e[t].logprob for t, e in zip(ids[1:], want.prompt_logprobs[1:], strict=True)],
        abs=1e-6)


async def test_prompt_logprobs_field_on_completions_and_chat(api: OpenAIServer,
                                                             model_dir: Path) -> None:
    r = await post(api, "/v1/completions", {"prompt": "hello world", "max_tokens": 2,
                                            "prompt_logprobs": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    field = r.json()["choices"][0]["prompt_logprobs"]
    want = offline(model_dir, "hello world", 3)
    assert field[0] is None and len(field) == len(want.prompt_token_ids)
    for tid, got, entry in zip(want.prompt_token_ids[1:], field[1:],
                               want.prompt_logprobs[1:], strict=True):  # fmt: skip
        assert str(tid) in got and 3 <= len(got) <= 4
        assert got[str(tid)]["logprob"] == pytest.approx(entry[tid].logprob, abs=1e-6)
        assert got[str(tid)]["rank"] == entry[tid].rank
        assert {int(t) for t in got} <= set(entry)
    r = await post(api, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "prompt_logprobs": 0, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    carrying = [c["prompt_logprobs"] for c in chunks if c.get("prompt_logprobs")]
    assert len(carrying) == 1 and carrying[0][0] is None
    assert all(len(e) == 1 for e in carrying[0][1:])  # the token alone: k = 0
    r = await post(api, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 1})
    assert len(r.json()["prompt_logprobs"]) == len(carrying[0])


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "echo": False}, "max_tokens"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": "3"}, "prompt_logprobs"),
])
async def test_bad_values_are_400_naming_the_field(api: OpenAIServer, body: dict[str, Any],
                                                   param: str) -> None:
    r = await post(api, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    r = await post(api, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 50})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
