"""The asyncio client against a real server: streaming, concurrency, cancel, typed errors."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.sampling_params import SamplingParams
from frontends.client import (
    AsyncClient,
    DuplicateRequestIdError,
    EngineError,
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
    UnauthorizedError,
)
from frontends.server import EngineServer, ServerConfig, serve_engine

from .conftest import UNIT, all_blocks_free, offline_greedy


async def test_stream_then_final_chunk_with_usage(server: EngineServer, model_dir: Path) -> None:
    [expected] = offline_greedy(model_dir, ["Paris is the capital"], max_tokens=10)
    async with AsyncClient(server.url) as client:
        chunks = [c async for c in client.generate("Paris is the capital", max_tokens=10,
                                                  temperature=0.0)]
    *deltas, last = chunks
    assert deltas and all(not c.finished for c in deltas)
    assert "".join(c.text for c in deltas) == expected.text
    assert [t for c in deltas for t in c.token_ids] == expected.token_ids
    assert last.finish_reason == expected.finish_reason and last.text == ""
    assert last.usage is not None
    assert last.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert last.usage.completion_tokens == len(expected.token_ids)


async def test_concurrent_generations_over_one_connection(server: EngineServer,
                                                          model_dir: Path) -> None:
    prompts = [f"The number {i} is" for i in range(8)]
    expected = offline_greedy(model_dir, prompts, max_tokens=6)
    async with AsyncClient(server.url) as client:
        results = await asyncio.wait_for(asyncio.gather(
            *(client.complete(p, max_tokens=6, temperature=0.0) for p in prompts)), 30 * UNIT)
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert [r.text for r in results] == [e.text for e in expected]


async def test_parallel_samples_stream_with_their_index(server: EngineServer,
                                                        model_dir: Path) -> None:
    from .conftest import _offline_llm

    params = dict(n=3, temperature=1.0, seed=9, max_tokens=8, ignore_eos=True)
    [expected] = _offline_llm(str(model_dir)).generate(
        ["Once upon a time"], SamplingParams(**params), use_tqdm=False)
    async with AsyncClient(server.url) as client:
        chunks = [c async for c in client.generate("Once upon a time", **params)]
        res = await client.complete("Once upon a time", **params)
    *deltas, last = chunks
    assert {c.index for c in deltas} == {0, 1, 2}
    assert last.finish_reasons == ["length"] * 3 and last.finish_reason == "length"
    assert last.usage is not None and last.usage.completion_tokens == 24
    assert res.samples is not None
    assert [s.index for s in res.samples] == [0, 1, 2]
    assert [s.token_ids for s in res.samples] == [c.token_ids for c in expected.outputs]
    assert [s.text for s in res.samples] == [c.text for c in expected.outputs]
    assert res.token_ids == expected.outputs[0].token_ids
    for i in range(3):
        assert [t for c in deltas if c.index == i for t in c.token_ids] == \
            expected.outputs[i].token_ids


async def test_chat_messages(server: EngineServer, engine: AsyncLLMEngine) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    async with AsyncClient(server.url) as client:
        res = await client.complete(messages=messages, max_tokens=3, ignore_eos=True)
    assert res.usage.prompt_tokens == len(engine.engine.apply_chat_template(messages))
    assert len(res.token_ids) == 3 and res.finish_reason == "length"


async def test_leaving_the_loop_early_cancels(server: EngineServer,
                                              engine: AsyncLLMEngine) -> None:
    async with AsyncClient(server.url) as client:
        gen = client.generate("a long story", max_tokens=200, ignore_eos=True)
        async for _ in gen:
            break
        await gen.aclose()
        await all_blocks_free(engine)
        # the connection still works afterwards
        res = await client.complete("again", max_tokens=2, ignore_eos=True)
        assert len(res.token_ids) == 2


async def test_explicit_cancel_ends_with_abort(server: EngineServer,
                                               engine: AsyncLLMEngine) -> None:
    async with AsyncClient(server.url) as client:
        chunks = []
        async for chunk in client.generate("go", request_id="c1", max_tokens=200,
                                           ignore_eos=True):
            chunks.append(chunk)
            if len(chunks) == 1:
                await client.cancel("c1")
        assert chunks[-1].finish_reason == "abort"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens < 200
    await all_blocks_free(engine)


async def test_cancel_ends_every_parallel_sample(server: EngineServer,
                                                 engine: AsyncLLMEngine) -> None:
    async with AsyncClient(server.url) as client:
        chunks = []
        async for chunk in client.generate("go", request_id="c2", n=3, max_tokens=200,
                                           ignore_eos=True):
            chunks.append(chunk)
            if len(chunks) == 1:
                await client.cancel("c2")
        assert chunks[-1].finish_reasons == ["abort"] * 3
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens < 600
    await all_blocks_free(engine)


async def test_typed_errors(server: EngineServer, engine: AsyncLLMEngine) -> None:
    async with AsyncClient(server.url) as client:
        with pytest.raises(InvalidRequestError, match=r"\$\.params\.top_p") as info:
            await client.complete("x", top_p=2.0)
        assert info.value.code == "invalid_request"
        with pytest.raises(PromptTooLongError):
            await client.complete(prompt_token_ids=[3] * engine.max_model_len, max_tokens=1)
        with pytest.raises(DuplicateRequestIdError):
            async with asyncio.timeout(10 * UNIT):
                gen = client.generate("x", request_id="dup", max_tokens=50)
                await anext(gen)
                await client.complete("y", request_id="dup")
        await gen.aclose()
        # the connection survives every error
        assert len((await client.complete("ok", max_tokens=2, ignore_eos=True)).token_ids) == 2


async def test_overloaded_error(engine: AsyncLLMEngine) -> None:
    config = ServerConfig(port=0, max_requests_per_connection=1)
    async with serve_engine(engine, config) as server, AsyncClient(server.url) as client:
        gen = client.generate("x", max_tokens=100, ignore_eos=True)
        await anext(gen)
        with pytest.raises(OverloadedError):
            await client.complete("y", max_tokens=2)
        await gen.aclose()
    await all_blocks_free(engine)


async def test_engine_error_when_the_engine_dies(server: EngineServer,
                                                 engine: AsyncLLMEngine) -> None:
    def explode() -> None:
        raise RuntimeError("device lost")

    engine.engine.step = explode  # type: ignore[method-assign,assignment]
    async with AsyncClient(server.url) as client:
        with pytest.raises(EngineError):
            await client.complete("x", max_tokens=3)


async def test_unauthorized(engine: AsyncLLMEngine) -> None:
    config = ServerConfig(port=0, api_key="k3y")
    async with serve_engine(engine, config) as server:
        with pytest.raises(UnauthorizedError):
            async with AsyncClient(server.url, api_key="nope"):
                pass
        async with AsyncClient(server.url, api_key="k3y") as client:
            assert (await client.complete("x", max_tokens=1)).finish_reason in ("length", "stop")


async def test_stats_stream(server: EngineServer, engine: AsyncLLMEngine) -> None:
    async with AsyncClient(server.url) as client:
        await client.complete("warm up", max_tokens=4, ignore_eos=True)
        seen = []
        async with asyncio.timeout(10 * UNIT):
            async for stats in client.stats(interval=0.05):
                seen.append(stats)
                if len(seen) == 3:
                    break
        assert seen[-1].kv_blocks_total == engine.block_pool.num_blocks
        assert seen[-1].generation_tokens_total >= 4
        assert seen[-1].device.kind == "cpu" and seen[-1].healthy
        # unsubscribed on leaving: generations still route correctly afterwards
        assert len((await client.complete("x", max_tokens=2, ignore_eos=True)).token_ids) == 2


async def test_chat_session_keeps_history_and_streams(server: EngineServer) -> None:
    from frontends.chat import run_chat

    lines = iter(["hello", "/reset", "again", "/exit"])
    out = io.StringIO()
    history = await asyncio.wait_for(
        run_chat(server.url, system="be nice", max_tokens=4, temperature=0.0,
                 input_fn=lambda _: next(lines), output=out), 30 * UNIT)
    assert [m["role"] for m in history] == ["system", "user", "assistant"]
    assert history[1]["content"] == "again"
    assert "(history cleared)" in out.getvalue()
    assert out.getvalue().count("assistant> ") == 2


async def test_demo_load_keeps_requests_going(server: EngineServer,
                                              engine: AsyncLLMEngine) -> None:
    from frontends.demo_load import run_demo_load

    task = asyncio.create_task(run_demo_load(server.url, concurrency=3, max_tokens=(4, 24),
                                             cancel_fraction=0.5, pause_s=(0.0, 0.05)))
    async with asyncio.timeout(30 * UNIT):
        while (s := engine.stats()).num_requests_aborted < 1 or s.num_requests_finished < 3:
            await asyncio.sleep(0.05)  # some requests ran to the end, some were cancelled
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await all_blocks_free(engine)


async def test_prompt_logprobs_on_the_last_chunk(server: EngineServer) -> None:
    async with AsyncClient(server.url) as client:
        chunks = [c async for c in client.generate("Paris is the capital", max_tokens=2,
                                                  prompt_logprobs=1)]
    *deltas, last = chunks
    assert all(c.prompt_logprobs is None for c in deltas)
    assert last.prompt_logprobs is not None and last.prompt_logprobs[0] is None
    assert last.usage is not None and len(last.prompt_logprobs) == last.usage.prompt_tokens
    assert all(1 <= len(e) <= 2 and all(lp.rank >= 1 for lp in e.values())
               for e in last.prompt_logprobs[1:] if e is not None)  # fmt: skip
