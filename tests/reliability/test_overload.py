"""Overload: past the queue limits requests are rejected at once with `overloaded`, before
they reach the engine; every accepted request still finishes, with its full output.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from websockets.asyncio.client import connect

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.errors import ErrorCode
from frontends.client import AsyncClient, OverloadedError

from .conftest import (
    UNIT,
    assert_clean,
    generate_msg,
    metric,
    offline_greedy,
    recv,
    send,
    serving,
)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def test_a_stalled_engine_sheds_load_at_once_and_serves_what_it_accepted(
    engine: AsyncLLMEngine, model_dir: Any, figures: dict[str, Any]
) -> None:
    """The engine thread is held (as by a long step) while 8 clients send 80 requests: the
    queue takes exactly its limit, the rest are refused in milliseconds, not after the step."""
    limit = 16
    prompts = [f"queued prompt {i}" for i in range(80)]
    expected = offline_greedy(model_dir, prompts, 8)  # type: ignore[arg-type]
    gate = threading.Event()
    blocker = asyncio.ensure_future(engine.run_in_engine_thread(lambda _: gate.wait(60 * UNIT)))
    async with serving(engine, max_queued_requests=limit) as server:
        sockets = [await connect(server.url) for _ in range(8)]
        sent_at: dict[str, float] = {}
        latencies: list[float] = []

        async def client(c: int, ws: Any) -> None:
            for j in range(10):
                rid = f"r{c * 10 + j}"
                sent_at[rid] = time.monotonic()
                await send(ws, generate_msg(rid, prompts[c * 10 + j], 8))

        await asyncio.gather(*(client(c, ws) for c, ws in enumerate(sockets)))
        while len(latencies) < len(prompts) - limit:  # the refusals arrive while held
            for ws in sockets:
                try:
                    ev = await asyncio.wait_for(ws.recv(), 0.05)
                except TimeoutError:
                    continue
                ev = json.loads(ev)
                assert ev["type"] == "error" and ev["code"] == ErrorCode.OVERLOADED, ev
                latencies.append(time.monotonic() - sent_at[ev["request_id"]])
                sent_at.pop(ev["request_id"])
        accepted = sorted(sent_at)
        assert len(accepted) == limit and engine.num_queued_requests == limit
        gate.set()
        await blocker
        for c, ws in enumerate(sockets):
            mine = [r for r in accepted if int(r[1:]) // 10 == c]
            ids: dict[str, list[int]] = {r: [] for r in mine}
            done = 0
            while done < len(mine):
                ev = await recv(ws)
                assert ev["request_id"] in ids, ev
                if ev["type"] == "delta":
                    ids[ev["request_id"]] += ev["token_ids"]
                else:
                    assert ev["type"] == "done" and ev["finish_reason"] == "length", ev
                    done += 1
            for r in mine:
                assert ids[r] == expected[int(r[1:])][0]
            await ws.close()
        assert await metric(server, "asyncengine_requests_rejected_total",
                             code=ErrorCode.OVERLOADED) == len(prompts) - limit
    await assert_clean(engine)
    assert max(latencies) < 2.0 * UNIT, max(latencies)
    figures.update(offered=len(prompts), accepted=limit, rejected=len(latencies),
                   reject_latency_p50_ms=round(1000 * _percentile(latencies, 0.5), 2),
                   reject_latency_max_ms=round(1000 * max(latencies), 2))


async def test_the_prompt_token_budget_of_the_queue_is_enforced(
    engine: AsyncLLMEngine,
) -> None:
    gate = threading.Event()
    blocker = asyncio.ensure_future(engine.run_in_engine_thread(lambda _: gate.wait(60 * UNIT)))
    async with serving(engine, max_queued_prompt_tokens=100) as server, \
            connect(server.url) as ws:
        for i in range(4):  # 40 tokens each: two fit in 100, a third would not
            await send(ws, generate_msg(f"t{i}", [5] * 40, 2))
        errors = [await recv(ws), await recv(ws)]
        assert {e["request_id"] for e in errors} == {"t2", "t3"}
        assert all(e["code"] == ErrorCode.OVERLOADED for e in errors)
        gate.set()
        await blocker
        finished = set()
        while len(finished) < 2:
            ev = await recv(ws)
            if ev["type"] == "done":
                finished.add(ev["request_id"])
        assert finished == {"t0", "t1"}
    await assert_clean(engine)


async def test_a_blast_of_clients_each_gets_done_or_overloaded(
    engine: AsyncLLMEngine, model_dir: Any, figures: dict[str, Any]
) -> None:
    """300 requests from 30 client-library connections against a queue of 24: no request is
    lost or left hanging, each accepted one completes exactly."""
    prompts = [f"blast {i % 6}" for i in range(300)]
    expected = offline_greedy(model_dir, prompts[:6], 12)  # type: ignore[arg-type]
    outcomes = {"done": 0, "overloaded": 0}
    latencies: list[float] = []
    async with serving(engine, max_queued_requests=24) as server:

        async def client(c: int) -> None:
            async with AsyncClient(server.url) as cl:

                async def one(i: int) -> None:
                    t0 = time.monotonic()
                    try:
                        out = await cl.complete(prompts[i], max_tokens=12, temperature=0.0,
                                                ignore_eos=True)
                    except OverloadedError:
                        latencies.append(time.monotonic() - t0)
                        outcomes["overloaded"] += 1
                        return
                    assert out.finish_reason == "length"
                    assert (out.token_ids, out.text) == expected[i % 6]
                    outcomes["done"] += 1

                await asyncio.gather(*(one(c * 10 + j) for j in range(10)))

        await asyncio.wait_for(asyncio.gather(*(client(c) for c in range(30))), 120 * UNIT)
    await assert_clean(engine)
    assert outcomes["done"] + outcomes["overloaded"] == 300
    assert outcomes["done"] >= 24 and outcomes["overloaded"] > 0
    figures.update(outcomes, reject_latency_max_ms=round(1000 * max(latencies), 2))
