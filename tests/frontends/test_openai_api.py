"""The OpenAI-compatible API driven by the official `openai` client, sync and async, streamed
and not, against the tiny model: outputs equal the offline engine's greedy ones, usage equals
the tokens streamed, each refusal is the client's typed exception, and a client that leaves
aborts its request (every KV block free again; the `engine` fixture checks it at the end)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncengine.async_engine import AsyncLLMEngine
from frontends.openai_api import OpenAIConfig, OpenAIServer, serve_openai
from frontends.server import ServerConfig, serve_engine

from .conftest import UNIT, _offline_llm, all_blocks_free, offline_greedy

MODEL = "tiny"
PROMPTS = ["The quick brown fox", "Once upon a time", "hello world"]


@pytest.fixture
async def api(engine: AsyncLLMEngine) -> AsyncIterator[OpenAIServer]:
    async with serve_openai(engine, OpenAIConfig(port=0, served_model_name=MODEL)) as srv:
        yield srv


def async_client(server: OpenAIServer, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0,
                              timeout=60 * UNIT)


def sync_client(server: OpenAIServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0,
                         timeout=60 * UNIT)


def chat_oracle(engine: AsyncLLMEngine, model_dir: Path, messages: list[dict[str, str]],
                max_tokens: int) -> Any:
    """The offline engine's greedy answer to `messages` under the chat template."""
    from asyncengine.sampling_params import SamplingParams

    ids = engine.engine.apply_chat_template(messages)
    [out] = _offline_llm(str(model_dir)).generate(
        [ids], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return ids, out.outputs[0]


# ----------------------------------------------------------------------- completions
@pytest.mark.parametrize("stream", [False, True])
async def test_completions_equal_offline_greedy(api: OpenAIServer, model_dir: Path,
                                                stream: bool) -> None:
    expected = offline_greedy(model_dir, PROMPTS, max_tokens=12)
    client = async_client(api)

    async def one(prompt: str) -> tuple[str, str | None, Any]:
        if not stream:
            r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                temperature=0)
            assert r.model == MODEL and r.object == "text_completion"
            return r.choices[0].text, r.choices[0].finish_reason, r.usage
        text, finish, usage = "", None, None
        async for chunk in await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                stream_options={"include_usage": True}):
            if chunk.usage is not None:
                assert chunk.choices == []
                usage = chunk.usage
                continue
            assert usage is None, "the usage chunk comes last"
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish, usage

    results = await asyncio.gather(*(one(p) for p in PROMPTS))
    for (text, finish, usage), exp in zip(results, expected, strict=True):
        assert text == exp.text and finish == exp.finish_reason
        assert usage.prompt_tokens == len(exp.prompt_token_ids)
        assert usage.completion_tokens == len(exp.token_ids)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


async def test_streamed_usage_equals_the_tokens_streamed(api: OpenAIServer,
                                                         model_dir: Path) -> None:
    [exp] = offline_greedy(model_dir, ["count the tokens"], max_tokens=20)
    tokens: list[str] = []
    usage = None
    stream = await async_client(api).completions.create(
        model=MODEL, prompt="count the tokens", max_tokens=20, temperature=0, logprobs=0,
        stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.logprobs is not None
            tokens += choice.logprobs.tokens
            assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens)
    assert usage is not None
    assert len(tokens) == usage.completion_tokens == len(exp.token_ids)


async def test_continuous_usage_counts_every_chunk(api: OpenAIServer, model_dir: Path) -> None:
    [exp] = offline_greedy(model_dir, ["per chunk"], max_tokens=10)
    counts = []
    async for chunk in await async_client(api).completions.create(
            model=MODEL, prompt="per chunk", max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}):
        counts.append(chunk.usage.completion_tokens)
    assert counts == sorted(counts) and counts[-1] == len(exp.token_ids)


async def test_a_batch_of_prompts_gives_one_choice_each(api: OpenAIServer,
                                                        model_dir: Path) -> None:
    expected = offline_greedy(model_dir, PROMPTS, max_tokens=6)
    client = async_client(api)
    r = await client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6,
                                        temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [e.text for e in expected]
    assert r.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    texts = ["", "", ""]
    async for chunk in await client.completions.create(
            model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [e.text for e in expected]


async def test_n_choices_per_prompt_with_their_indices(api: OpenAIServer,
                                                       model_dir: Path) -> None:
    """n samples of each prompt: choice index = prompt index * n + sample index, as in vLLM;
    greedy samples all equal the offline answer, seeded ones equal a lone request at seed + i."""
    expected = offline_greedy(model_dir, PROMPTS[:2], max_tokens=6)
    client = async_client(api)
    r = await client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6,
                                        temperature=0, n=3)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [e.text for e in expected for _ in range(3)]
    assert r.usage.completion_tokens == sum(len(e.token_ids) for e in expected) * 3
    texts: dict[int, str] = {}
    async for chunk in await client.completions.create(
            model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=0, n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(6)] == [c.text for c in r.choices]

    sampled = await client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                              temperature=1.0, seed=11, n=2)
    lone = [
        (await client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                         temperature=1.0, seed=11 + i)).choices[0].text
        for i in range(2)
    ]
    assert [c.text for c in sampled.choices] == lone
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=5,
        temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


async def test_token_id_prompts_echo_stop_and_seed(api: OpenAIServer, engine: AsyncLLMEngine,
                                                   model_dir: Path) -> None:
    [exp] = offline_greedy(model_dir, ["hello world"], max_tokens=8)
    client = async_client(api)
    ids = exp.prompt_token_ids
    r = await client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == exp.text
    r = await client.completions.create(model=MODEL, prompt="hello world", max_tokens=8,
                                        temperature=0, echo=True)
    assert r.choices[0].text == "hello world" + exp.text
    stop = exp.text[2:4]
    [cut] = offline_greedy(model_dir, ["hello world"], max_tokens=8, stop=[stop])
    r = await client.completions.create(model=MODEL, prompt="hello world", max_tokens=8,
                                        temperature=0, stop=[stop])
    assert r.choices[0].text == cut.text and r.choices[0].finish_reason == "stop"
    sampled = [
        (await client.completions.create(
            model=MODEL, prompt="hello world", max_tokens=8, temperature=1.0, seed=7,
            extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1,
                        "ignore_eos": True, "min_tokens": 8})).choices[0]
        for _ in range(2)
    ]
    assert sampled[0].text == sampled[1].text and sampled[0].finish_reason == "length"


async def test_completion_logprobs(api: OpenAIServer) -> None:
    r = await async_client(api).completions.create(model=MODEL, prompt="hello", max_tokens=4,
                                                   temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 4
    for token, tops, sampled in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs,
                                    strict=True):
        assert 1 <= len(tops) <= 4 and all(v <= 0.0 for v in tops.values())
        assert tops[token] == sampled == pytest.approx(max(tops.values()))  # greedy: the best
    assert lp.text_offset == sorted(lp.text_offset)


# ----------------------------------------------------------------------- chat
@pytest.mark.parametrize("stream", [False, True])
async def test_chat_uses_the_template_and_equals_offline_greedy(
        api: OpenAIServer, engine: AsyncLLMEngine, model_dir: Path, stream: bool) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids, exp = chat_oracle(engine, model_dir, messages, max_tokens=10)
    client = async_client(api)
    if not stream:
        r = await client.chat.completions.create(model=MODEL, messages=messages,
                                                 max_completion_tokens=10, temperature=0)
        msg = r.choices[0].message
        assert msg.role == "assistant" and msg.content == exp.text
        assert r.choices[0].finish_reason == exp.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids),
                                                                      len(exp.token_ids))
        return
    chunks = [c async for c in await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True})]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == exp.text
    assert chunks[-2].choices[0].finish_reason == exp.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(exp.token_ids)
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


async def test_chat_logprobs_and_text_parts(api: OpenAIServer) -> None:
    r = await async_client(api).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for tok in content:
        assert len(tok.top_logprobs) == 2 and tok.top_logprobs[0].logprob == tok.logprob
        assert bytes(tok.bytes).decode() == tok.token


async def test_sync_client_streamed_and_not(api: OpenAIServer, engine: AsyncLLMEngine,
                                            model_dir: Path) -> None:
    [exp] = offline_greedy(model_dir, ["Once upon a time"], max_tokens=8)
    messages = [{"role": "user", "content": "hello"}]
    _, chat_exp = chat_oracle(engine, model_dir, messages, max_tokens=8)

    def run() -> tuple[str, str, str, str]:
        with sync_client(api) as client:
            whole = client.completions.create(model=MODEL, prompt="Once upon a time",
                                              max_tokens=8, temperature=0).choices[0].text
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                stream=True))
            chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                  temperature=0).choices[0].message.content
            chat_streamed = "".join(c.choices[0].delta.content or "" for c in
                                    client.chat.completions.create(
                                        model=MODEL, messages=messages, max_tokens=8,
                                        temperature=0, stream=True))
            return whole, streamed, chat, chat_streamed

    whole, streamed, chat, chat_streamed = await asyncio.to_thread(run)
    assert whole == streamed == exp.text
    assert chat == chat_streamed == chat_exp.text


# ----------------------------------------------------------------------- models, errors
async def test_models_lists_the_served_name(api: OpenAIServer, engine: AsyncLLMEngine) -> None:
    client = async_client(api)
    models = [m async for m in client.models.list()]
    assert [m.id for m in models] == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("other")


@pytest.mark.parametrize(("kwargs", "param", "code"), [
    ({"n": 0}, "n", "invalid_request"),
    ({"temperature": -1}, "temperature", "invalid_request"),
    ({"top_p": 0}, "top_p", "invalid_request"),
    ({"max_tokens": 0}, "max_tokens", "invalid_request"),
    ({"max_tokens": 10_000}, "max_tokens", "prompt_too_long"),
    ({"prompt": "x" * 2000}, "prompt", "prompt_too_long"),
    ({"prompt": [1, 10**6]}, "prompt", "invalid_request"),
    ({"prompt": ""}, "prompt", "invalid_request"),
    ({"logprobs": 99}, "logprobs", "invalid_request"),
    ({"extra_body": {"top_k": -5}}, "top_k", "invalid_request"),
    ({"extra_body": {"min_tokens": 9}}, "min_tokens", "invalid_request"),
    ({"stop": [""]}, "stop", "invalid_request"),
    ({"extra_body": {"max_tokens": "ten"}}, "max_tokens", "invalid_request"),
    ({"suffix": "x"}, "suffix", "invalid_request"),
])
async def test_bad_completion_parameters_are_400_naming_them(
        api: OpenAIServer, kwargs: dict[str, Any], param: str, code: str) -> None:
    args: dict[str, Any] = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        await async_client(api).completions.create(**args)
    err = info.value.body
    assert info.value.status_code == 400
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")
    assert err["message"]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"max_completion_tokens": 10_000}, "max_completion_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 2000}]}, "messages"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    # tool_choice defaults to auto, which needs a --tool-call-parser this server lacks.
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://x"}}]}]}, "messages[0].content"),
])
async def test_bad_chat_parameters_are_400_naming_them(
        api: OpenAIServer, kwargs: dict[str, Any], param: str) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        await async_client(api).chat.completions.create(**args)
    assert info.value.body["param"] == param


async def test_unknown_model_is_404(api: OpenAIServer) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await async_client(api).completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert info.value.body["param"] == "model" and info.value.body["code"] == "not_found"


async def test_api_key_is_a_bearer_token(engine: AsyncLLMEngine) -> None:
    config = OpenAIConfig(port=0, served_model_name=MODEL, api_key="sesame")
    async with serve_openai(engine, config) as srv:
        with pytest.raises(openai.AuthenticationError) as info:
            await async_client(srv, "wrong").completions.create(model=MODEL, prompt="x",
                                                                 max_tokens=2)
        assert info.value.body["code"] == "unauthorized"
        with pytest.raises(openai.AuthenticationError):
            await async_client(srv, "wrong").models.list()
        r = await async_client(srv, "sesame").completions.create(model=MODEL, prompt="x",
                                                                  max_tokens=2)
        assert r.usage.completion_tokens >= 1
        async with httpx2.AsyncClient(base_url=srv.url) as http:
            r = await http.post("/v1/completions", json={"prompt": "x"})  # no key at all
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["type"] == "authentication_error"
            assert (await http.get("/health")).status_code == 200  # no key needed
            assert (await http.get("/metrics")).status_code == 200
    with pytest.raises(ValueError, match="non-loopback"):
        OpenAIConfig(host="0.0.0.0").validate()


async def test_a_full_queue_is_429_with_retry_after(engine: AsyncLLMEngine) -> None:
    gate = threading.Event()
    # Hold the step thread so that accepted requests stay queued.
    blocker = asyncio.ensure_future(engine.run_in_engine_thread(lambda _: gate.wait(30 * UNIT)))
    config = OpenAIConfig(port=0, served_model_name=MODEL, max_queued_requests=2)
    async with serve_openai(engine, config) as srv:
        client = async_client(srv)
        queued = [asyncio.ensure_future(client.completions.create(
            model=MODEL, prompt="queued", max_tokens=2)) for _ in range(2)]
        while engine.num_queued_requests < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as info:
            await client.completions.create(model=MODEL, prompt="refused", max_tokens=2)
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.body["code"] == "overloaded"
        gate.set()
        await blocker
        for r in await asyncio.gather(*queued):
            assert r.usage.completion_tokens == 2
        async with httpx2.AsyncClient(base_url=srv.url) as http:
            body = (await http.get("/metrics")).text
        rejected = {s.labels.get("code"): s.value for f in text_string_to_metric_families(body)
                    if f.name == "asyncengine_http_requests_rejected" for s in f.samples
                    if s.name.endswith("_total")}
        assert rejected.get("overloaded") == 1


async def test_raw_http_errors_keep_openai_shape(api: OpenAIServer) -> None:
    async with httpx2.AsyncClient(base_url=api.url) as http:
        for method, path, body, status in [
            ("POST", "/v1/completions", b"{not json", 400),
            ("POST", "/v1/completions", b"[]", 400),
            ("POST", "/v1/completions", b'{"max_tokens": 2}', 400),
            ("POST", "/v1/chat/completions", b'{"messages": "hi"}', 400),
            ("GET", "/v1/completions", None, 405),
            ("GET", "/v1/nothing", None, 404),
        ]:
            r = await http.request(method, path, content=body)
            assert r.status_code == status, (path, body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
        r = await http.post("/v1/completions", content=b'{"max_tokens": 2}')
        assert r.json()["error"]["param"] == "prompt"
        r = await http.post("/v1/completions",
                            content=b'{"prompt": "x", "max_tokens": 2, "temperature": "hot"}')
        assert r.json()["error"]["param"] == "temperature"
        r = await http.post("/v1/completions", content=b"x" * (api.config.max_body_size + 1))
        assert r.status_code == 413


async def test_a_failure_after_the_stream_began_is_an_error_chunk(
        api: OpenAIServer, engine: AsyncLLMEngine) -> None:
    stream = await async_client(api).completions.create(
        model=MODEL, prompt="hello", max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    chunks = 0
    with pytest.raises(openai.APIError) as info:
        async for _ in stream:
            chunks += 1
            if chunks == 1:
                await engine.shutdown()  # the engine stops under a running stream
    assert chunks >= 1 and info.value.body["code"] == "engine_error"
    async with httpx2.AsyncClient(base_url=api.url) as http:
        assert (await http.get("/health")).status_code == 503


# ----------------------------------------------------------------------- disconnects
@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_aborts_its_request(api: OpenAIServer,
                                                       engine: AsyncLLMEngine,
                                                       stream: bool) -> None:
    body = {"model": MODEL, "prompt": "never mind", "max_tokens": 200, "ignore_eos": True,
            "stream": stream}
    async with httpx2.AsyncClient(base_url=api.url, timeout=60 * UNIT) as http:
        if stream:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # the first token came: leave
        else:
            task = asyncio.ensure_future(http.post("/v1/completions", json=body))
            while engine.num_in_flight == 0:
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    # Aborted long before its 200 tokens, and every block is free again.
    await all_blocks_free(engine, timeout=20 * UNIT)
    assert engine.stats().generation_tokens_total < 200


# ----------------------------------------------------------------------- one engine, two APIs
async def test_http_and_websocket_share_the_engine_and_its_metrics(
        engine: AsyncLLMEngine) -> None:
    from websockets.asyncio.client import connect

    from .test_server import collect, send

    async with serve_engine(engine, ServerConfig(port=0)) as ws_server, \
            serve_openai(engine, OpenAIConfig(port=0, served_model_name=MODEL),
                         metrics=ws_server.metrics) as srv:
        r = await async_client(srv).completions.create(model=MODEL, prompt="over http",
                                                       max_tokens=5, extra_body={
                                                           "ignore_eos": True})
        async with connect(ws_server.url) as ws:
            await send(ws, {"type": "generate", "request_id": "w", "prompt": "over ws",
                            "params": {"max_tokens": 7, "ignore_eos": True}})
            await collect(ws, "w")
        assert r.usage.completion_tokens == 5
        stats = engine.stats()
        assert stats.generation_tokens_total == 12 and stats.num_requests_finished == 2
        async with httpx2.AsyncClient() as http:
            bodies = [(await http.get(f"{url}/metrics")).text
                      for url in (srv.url, ws_server.http_url)]
        for body in bodies:
            generated = [s.value for f in text_string_to_metric_families(body)
                         for s in f.samples if s.name == "asyncengine_generation_tokens_total"]
            assert generated == [12]


async def test_health_follows_the_engine(api: OpenAIServer, engine: AsyncLLMEngine) -> None:
    async with httpx2.AsyncClient(base_url=api.url) as http:
        assert (await http.get("/health")).status_code == 200
        api.api.draining = True
        assert (await http.get("/health")).status_code == 503
        with pytest.raises(openai.InternalServerError) as info:
            await async_client(api).completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "engine_error"
        api.api.draining = False
    await all_blocks_free(engine)
