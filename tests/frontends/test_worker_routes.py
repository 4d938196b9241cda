"""The worker routes vllm-router calls, each on its own against the tiny model: vLLM's
tokenize/detokenize shapes, the load count, a prefix-cache flush that is safe while requests
run (outputs unchanged, pool whole), the version, and which routes need the API key."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.llm_engine import LLMEngine
from frontends.openai_api import OpenAIConfig, OpenAIServer, serve_openai
from frontends.openai_api.worker_routes import asyncengine_version

from .conftest import UNIT, all_blocks_free, offline_greedy

MODEL = "tiny"


@pytest.fixture
async def api(engine: AsyncLLMEngine) -> AsyncIterator[OpenAIServer]:
    async with serve_openai(engine, OpenAIConfig(port=0, served_model_name=MODEL)) as srv:
        yield srv


@pytest.fixture
async def http(api: OpenAIServer) -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(base_url=api.url, timeout=30 * UNIT) as client:
        yield client


async def test_tokenize_a_prompt(http: httpx2.AsyncClient, engine: AsyncLLMEngine) -> None:
    tokenizer = engine.tokenizer
    r = await http.post("/tokenize", json={"model": MODEL, "prompt": "hello world"})
    assert r.status_code == 200
    body = r.json()
    want = tokenizer.encode("hello world")
    assert body == {"count": len(want), "max_model_len": engine.max_model_len,
                    "tokens": want, "token_strs": None}
    r = await http.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False,
                                           "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tokenizer.encode("hello world", add_special_tokens=False)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])


async def test_tokenize_messages_applies_the_chat_template(http: httpx2.AsyncClient,
                                                           engine: AsyncLLMEngine) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = await http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200
    assert r.json()["tokens"] == engine.engine.apply_chat_template(messages)
    r = await http.post("/tokenize", json={"messages": messages,
                                           "add_generation_prompt": False})
    want = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                                tokenize=True, return_dict=True)
    assert r.json()["tokens"] == list(want["input_ids"])
    assert r.json()["count"] < len(engine.engine.apply_chat_template(messages))


async def test_detokenize_round_trips(http: httpx2.AsyncClient, engine: AsyncLLMEngine) -> None:
    ids = engine.tokenizer.encode("The quick brown fox")
    r = await http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": engine.tokenizer.decode(ids)}
    assert "quick brown fox" in r.json()["prompt"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
async def test_bad_bodies_name_the_field(http: httpx2.AsyncClient, path: str,
                                         body: dict[str, object], param: str) -> None:
    r = await http.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


async def test_get_load_counts_requests_in_flight(http: httpx2.AsyncClient,
                                                  engine: AsyncLLMEngine) -> None:
    assert (await http.get("/get_load")).json() == {"load": 0}
    body = {"model": MODEL, "prompt": "count me", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data: {"):
                break  # the request is running now
        assert (await http.get("/get_load")).json() == {"load": 1}
    await all_blocks_free(engine)
    assert (await http.get("/get_load")).json() == {"load": 0}


def _cached_free(e: LLMEngine) -> int:
    return e.pool.num_cached_free_blocks


async def test_flush_cache_drops_cached_blocks(http: httpx2.AsyncClient,
                                               engine: AsyncLLMEngine) -> None:
    prompt = "a shared system prompt long enough to fill a few blocks of the KV cache " * 2
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    assert (await http.post("/v1/completions", json=body)).status_code == 200
    await all_blocks_free(engine)
    cached = await engine.run_in_engine_thread(_cached_free)
    assert cached > 0
    r = await http.post("/flush_cache")
    assert r.status_code == 200 and r.json() == {"status": "ok", "flushed_blocks": cached}
    assert await engine.run_in_engine_thread(_cached_free) == 0
    # vLLM's name for the same thing.
    assert (await http.post("/v1/completions", json=body)).status_code == 200
    await all_blocks_free(engine)
    r = await http.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["flushed_blocks"] > 0


async def test_flush_while_requests_run_changes_no_output(http: httpx2.AsyncClient,
                                                          engine: AsyncLLMEngine,
                                                          model_dir: Path) -> None:
    """Flushes between steps under load: every output still equals offline greedy, and
    the pool is whole and entirely free at the end."""
    prefix = "one prefix shared by every request, long enough to span blocks: "
    prompts = [prefix + str(i) for i in range(6)]
    expected = offline_greedy(model_dir, prompts, max_tokens=24)

    async def one(prompt: str) -> str:
        r = await http.post("/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    async def flusher(done: asyncio.Event) -> int:
        flushes = 0
        while not done.is_set():
            assert (await http.post("/flush_cache")).status_code == 200
            flushes += 1
            await asyncio.sleep(0.005)
        return flushes

    done = asyncio.Event()
    flushing = asyncio.create_task(flusher(done))
    texts = [await one(p) for p in prompts[:2]]  # the second can hit the first's prefix
    texts += await asyncio.gather(*(one(p) for p in prompts[2:]))
    done.set()
    assert await flushing > 1
    assert texts == [e.text for e in expected]
    await all_blocks_free(engine)


async def test_version(http: httpx2.AsyncClient) -> None:
    r = await http.get("/version")
    assert r.status_code == 200 and r.json() == {"version": asyncengine_version()}


async def test_routes_behind_the_api_key(engine: AsyncLLMEngine) -> None:
    config = OpenAIConfig(port=0, served_model_name=MODEL, api_key="sesame")
    async with serve_openai(engine, config) as srv, \
            httpx2.AsyncClient(base_url=srv.url, timeout=30 * UNIT) as http:
        for path in ("/tokenize", "/detokenize", "/flush_cache", "/reset_prefix_cache"):
            assert (await http.post(path, json={})).status_code == 401, path
        assert (await http.get("/get_load")).status_code == 200
        assert (await http.get("/version")).status_code == 200
        r = await http.post("/tokenize", json={"prompt": "hi"},
                            headers={"Authorization": "Bearer sesame"})
        assert r.status_code == 200 and r.json()["count"] > 0


async def test_flush_refused_while_shutting_down(api: OpenAIServer,
                                                 http: httpx2.AsyncClient) -> None:
    api.api.draining = True
    r = await http.post("/flush_cache")
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    api.api.draining = False
