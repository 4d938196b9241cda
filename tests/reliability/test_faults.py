"""Injected faults: a model step, the sampler, one request's detokenizer, the engine's add
path and the server's own message handling raise. The requests a fault touches get an
`error` event; every other request finishes with its greedy output; /healthz stays 200 while
the engine can serve and turns 503 once it cannot; no KV block leaks.

What a fault touches: a failing step (model or sampler) fails every request scheduled in
that step (the step cannot be pinned on one of them) and nothing else; a failing
detokenizer fails its own request only. Three failed steps in a row mean the device is gone:
the engine is marked dead.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.detokenizer import IncrementalDetokenizer
from asyncengine.errors import ErrorCode
from frontends import protocol as p

from .conftest import (
    UNIT,
    MakeEngine,
    assert_clean,
    collect_streams,
    generate_msg,
    http_get,
    metric,
    offline_greedy,
    recv,
    send,
    serving,
)

PROMPTS = [f"fault test prompt {i}" for i in range(8)]


async def _held_batch(engine: AsyncLLMEngine, ws: ClientConnection,
                      msgs: list[dict[str, Any]]) -> None:
    """Send `msgs` while the step thread is held, so that they are scheduled in order, as
    many per step as max_num_seqs allows."""
    gate = threading.Event()
    blocker = asyncio.ensure_future(engine.run_in_engine_thread(lambda _: gate.wait(30 * UNIT)))
    for msg in msgs:
        await send(ws, msg)
    while engine.num_queued_requests < len(msgs):
        await asyncio.sleep(0.01)
    gate.set()
    await blocker


def _fail_once(fn: Callable[..., Any], exc: BaseException,
               when: Callable[..., bool] = lambda *a: True) -> Callable[..., Any]:
    """`fn`, except that the first call for which `when(*args)` holds raises `exc`."""
    fired = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not fired and when(*args):
            fired.append(True)
            raise exc
        return fn(*args, **kwargs)

    return wrapper


async def _expect_split(ws: ClientConnection, failed: list[str], finished: list[str],
                        expected: dict[str, tuple[list[int], str]]) -> None:
    results = await collect_streams(ws, failed + finished)
    for rid in failed:
        end = results[rid][2]
        assert end["type"] == "error" and end["code"] == ErrorCode.ENGINE_ERROR, end
    for rid in finished:
        ids, text, end = results[rid]
        assert end["type"] == "done", (rid, end)
        assert (ids, text) == expected[rid], rid


async def _healthy(server: Any) -> bool:
    return (await http_get(server, "/healthz"))[0] == 200


async def test_a_failing_model_step_fails_its_batch_and_nothing_else(
    make_engine: MakeEngine, model_dir: Any, monkeypatch: pytest.MonkeyPatch,
    figures: dict[str, Any]
) -> None:
    engine = make_engine(max_num_seqs=4)
    runner = engine.engine.runner

    def poisoned(sched: Any, *_: Any) -> bool:
        return any(s.request.request_id.endswith(":poison") for s in sched.scheduled)

    monkeypatch.setattr(runner, "launch", _fail_once(
        runner.launch, RuntimeError("injected: device step failed"), poisoned))
    rids = ["poison", "a1", "a2", "a3", "b1", "b2", "b3", "b4"]
    expected = dict(zip(rids, offline_greedy(model_dir, PROMPTS, 16), strict=True))
    async with serving(engine) as server, connect(server.url) as ws:
        await _held_batch(engine, ws, [generate_msg(r, PROMPTS[i], 16)
                                       for i, r in enumerate(rids)])
        # The first step holds the first four (max_num_seqs): they fail together.
        await _expect_split(ws, rids[:4], rids[4:], expected)
        assert await _healthy(server) and not engine.errored
        assert await metric(server, "asyncengine_request_success_total",
                            finished_reason="error") == 4
        # ...and the next request is served as usual.
        await send(ws, generate_msg("after", PROMPTS[0], 16))
        assert (await collect_streams(ws, ["after"]))["after"][:2] == expected["poison"]
    await assert_clean(engine)
    figures.update(failed_requests=len(rids[:4]), finished_requests=len(rids[4:]) + 1)


async def test_a_failing_sampler_fails_its_batch_and_nothing_else(
    make_engine: MakeEngine, model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(max_num_seqs=4)
    sampler = engine.engine.runner.sampler
    monkeypatch.setattr(sampler, "forward", _fail_once(
        sampler.forward, RuntimeError("injected: sampler failed")))
    rids = ["s0", "s1", "s2", "s3", "g0", "g1", "g2", "g3"]
    expected = dict(zip(rids, offline_greedy(model_dir, PROMPTS, 12), strict=True))
    # The first batch holds a sampled request (the sampler runs; greedy-only batches skip it).
    msgs = [generate_msg(r, PROMPTS[i], 12) for i, r in enumerate(rids)]
    msgs[0]["params"].update(temperature=0.8, seed=42)
    async with serving(engine) as server, connect(server.url) as ws:
        await _held_batch(engine, ws, msgs)
        await _expect_split(ws, rids[:4], rids[4:], expected)
        assert await _healthy(server)
        # The sampler works again: a seeded request now completes.
        await send(ws, msgs[0])
        ids, _, end = (await collect_streams(ws, ["s0"]))["s0"]
        assert end["type"] == "done" and len(ids) == 12
    await assert_clean(engine)


async def test_a_failing_detokenizer_fails_only_its_request(
    engine: AsyncLLMEngine, model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    poison_ids = [7, 7, 7, 7, 7, 7, 7]
    original_init = IncrementalDetokenizer.__init__
    original_append = IncrementalDetokenizer.append

    def init(self: IncrementalDetokenizer, tokenizer: Any, prompt_token_ids: Any,
             **kw: Any) -> None:
        original_init(self, tokenizer, prompt_token_ids, **kw)
        self._poison_countdown = 3 if list(prompt_token_ids) == poison_ids else -1  # type: ignore[attr-defined]

    def append(self: IncrementalDetokenizer, token_ids: Any) -> str:
        countdown = self._poison_countdown  # type: ignore[attr-defined]
        if countdown == 0:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected: detokenizer failed")
        self._poison_countdown = countdown - 1  # type: ignore[attr-defined]
        return original_append(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", init)
    monkeypatch.setattr(IncrementalDetokenizer, "append", append)
    others = [f"d{i}" for i in range(6)]
    expected = dict(zip(others, offline_greedy(model_dir, PROMPTS[:6], 20), strict=True))
    async with serving(engine) as server, connect(server.url) as ws:
        msgs = [generate_msg(r, PROMPTS[i], 20) for i, r in enumerate(others)]
        msgs.insert(3, generate_msg("poison", poison_ids, 20))
        await _held_batch(engine, ws, msgs)  # one batch: the poison sits among the others
        results = await collect_streams(ws, ["poison", *others])
        ids, _, end = results["poison"]
        assert end["type"] == "error" and end["code"] == ErrorCode.ENGINE_ERROR
        assert "detokenizer failed" in end["message"] and len(ids) <= 3
        for rid in others:
            assert results[rid][2]["type"] == "done"
            assert results[rid][:2] == expected[rid], rid
        assert await _healthy(server)
    await assert_clean(engine)


async def test_an_exception_adding_one_request_does_not_kill_the_engine(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = engine.engine
    monkeypatch.setattr(llm, "add_request", _fail_once(
        llm.add_request, KeyError("injected"), lambda rid, *a: rid.endswith(":bad")))
    async with serving(engine) as server, connect(server.url) as ws:
        await send(ws, generate_msg("bad", "first", 4))
        await send(ws, generate_msg("good", "second", 4))
        results = await collect_streams(ws, ["bad", "good"])
        assert results["bad"][2]["code"] == ErrorCode.ENGINE_ERROR
        assert results["good"][2]["type"] == "done" and len(results["good"][0]) == 4
        assert await _healthy(server) and not engine.errored
    await assert_clean(engine)


async def test_a_server_bug_on_one_message_costs_that_message_only(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with serving(engine) as server, connect(server.url) as ws:
        original = server._tokenize

        async def tokenize(msg: p.Generate) -> list[int]:
            if msg.request_id == "boom":
                raise TypeError("injected: server bug")
            return await original(msg)

        monkeypatch.setattr(server, "_tokenize", tokenize)
        await send(ws, generate_msg("ok1", "before", 6))
        await send(ws, generate_msg("boom", "bug", 6))
        await send(ws, generate_msg("ok2", "after", 6))
        done: set[str] = set()
        errors: list[dict[str, Any]] = []
        while len(done) < 2:
            ev = await recv(ws)
            if ev["type"] == "error":
                errors.append(ev)
            elif ev["type"] == "done":
                done.add(ev["request_id"])
        assert done == {"ok1", "ok2"}
        assert errors == [{"type": "error", "code": ErrorCode.INTERNAL_ERROR,
                           "message": "internal server error", "request_id": None}]
        # the failed message reserved nothing: its id is free
        monkeypatch.setattr(server, "_tokenize", original)
        await send(ws, generate_msg("boom", "retry", 2))
        assert (await collect_streams(ws, ["boom"]))["boom"][2]["type"] == "done"
    assert any("unexpected error handling a message" in r.getMessage() for r in caplog.records)
    await assert_clean(engine)


async def test_repeated_step_failures_mark_the_engine_dead_and_health_says_so(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(sched: Any, prev: Any = None) -> Any:
        raise RuntimeError("injected: device lost")

    monkeypatch.setattr(engine.engine.runner, "launch", broken)
    limit = engine.max_consecutive_step_errors
    async with serving(engine) as server, connect(server.url) as ws:
        for i in range(limit):
            assert await _healthy(server), f"unhealthy after {i} failed steps"
            await send(ws, generate_msg(f"x{i}", "doomed", 4))
            end = (await collect_streams(ws, [f"x{i}"]))[f"x{i}"][2]
            assert end["type"] == "error" and end["code"] == ErrorCode.ENGINE_ERROR
        status, body = await http_get(server, "/healthz")
        assert engine.errored and status == 503 and "dead" in body
        assert not engine.stats().healthy
        assert (await http_get(server, "/metrics"))[0] == 200  # still observable
        await send(ws, generate_msg("late", "too late", 4))
        end = (await collect_streams(ws, ["late"]))["late"][2]
        assert end["type"] == "error" and end["code"] == ErrorCode.ENGINE_ERROR
