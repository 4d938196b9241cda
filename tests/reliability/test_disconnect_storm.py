"""Disconnect storms: hundreds of concurrent streamed requests while a random half of the
clients vanish mid-stream in every way a client can: a clean close, a TCP reset, a transport
abort, a reset right after sending (requests still queued), or simply no longer reading.

Afterwards the engine must hold nothing (every KV block free, nothing running, waiting or
swapped, no stream left on the loop, the server rid of every dead connection) and every
surviving request's output must equal offline greedy decoding, token for token.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from asyncengine.async_engine import AsyncLLMEngine

from .conftest import (
    UNIT,
    MakeEngine,
    assert_clean,
    collect_streams,
    eventually,
    generate_msg,
    hard_reset,
    kv_audit,
    offline_greedy,
    recv,
    send,
    serving,
    small_rcvbuf_socket,
)

SEED = 7
ROUNDS = 2
CONNECTIONS = 64
PER_CONNECTION = 4
MAX_TOKENS = 32
VANISH_MODES = ("close", "reset", "abort", "stop_reading", "reset_at_once")
_WORDS = ["red", "fox", "sky", "tea", "sun", "map", "owl", "ink", "jam", "kit", "log", "net"]


def _prompt(rng: random.Random, i: int) -> str:
    return f"{i}: " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 6)))


async def _open(url: str, host: str, port: int, mode: str | None) -> ClientConnection:
    if mode == "stop_reading":  # a tiny window and a one-message queue: backs up at once
        return await connect(url, sock=small_rcvbuf_socket(host, port), max_queue=1)
    # A websockets client whose message queue is full stops reading, so its close() never
    # sees the server's close frame and waits out close_timeout: keep that short.
    return await connect(url, close_timeout=1)


async def _vanish(ws: ClientConnection, mode: str) -> None:
    if mode == "close":
        await ws.close()
    elif mode in ("reset", "reset_at_once"):
        hard_reset(ws)
    elif mode == "abort":
        ws.transport.abort()
    # "stop_reading": the client just stops calling recv() and stays connected


async def storm_round(engine: AsyncLLMEngine, model_dir: Any, server: Any, seed: int
                      ) -> dict[str, int]:
    """One storm; returns its counts. Stalled (non-reading) clients are checked, then dropped."""
    rng = random.Random(seed)
    modes: list[str | None] = [None] * CONNECTIONS
    for c in rng.sample(range(CONNECTIONS), CONNECTIONS // 2):
        modes[c] = rng.choice(VANISH_MODES)
    prompts = [[_prompt(rng, c * PER_CONNECTION + j) for j in range(PER_CONNECTION)]
               for c in range(CONNECTIONS)]
    results: dict[int, dict[str, tuple[list[int], str, dict[str, Any]]]] = {}
    stalled: list[ClientConnection] = []

    async def client(c: int) -> None:
        mode = modes[c]
        ws = await _open(server.url, server.host, server.port, mode)
        rids = [f"s{c}.{j}" for j in range(PER_CONNECTION)]
        for rid, prompt in zip(rids, prompts[c], strict=True):
            await send(ws, generate_msg(rid, prompt, MAX_TOKENS))
        if mode is None:
            results[c] = await collect_streams(ws, rids)
            await ws.close()
            return
        if mode != "reset_at_once":
            seen = 0
            target = rng.randint(1, 2 * PER_CONNECTION)
            while seen < target:  # vanish somewhere in the middle of the streams
                ev = await recv(ws)
                seen += ev["type"] == "delta"
        if mode == "stop_reading":
            stalled.append(ws)
        await _vanish(ws, mode)

    await asyncio.wait_for(asyncio.gather(*(client(c) for c in range(CONNECTIONS))),
                           120 * UNIT)

    # The stalled clients still hold their sockets: the engine must not wait for them.
    counts_while_stalled = await kv_audit(engine)
    assert counts_while_stalled == dict.fromkeys(counts_while_stalled, 0), counts_while_stalled
    for ws in stalled:
        hard_reset(ws)
    await eventually(lambda: not server._connections, 20 * UNIT, "dead connections to go")
    await assert_clean(engine)
    stats = engine.stats()  # the snapshot taken when the engine went idle
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
    assert stats.kv_blocks_used == 0

    survivors = [c for c in range(CONNECTIONS) if modes[c] is None]
    flat = [prompts[c][j] for c in survivors for j in range(PER_CONNECTION)]
    expected = offline_greedy(model_dir, flat, MAX_TOKENS)  # type: ignore[arg-type]
    lost = 0
    for n, (c, j) in enumerate((c, j) for c in survivors for j in range(PER_CONNECTION)):
        ids, text, end = results[c][f"s{c}.{j}"]
        assert end["type"] == "done" and end["finish_reason"] == "length", end
        assert end["usage"]["completion_tokens"] == len(ids) == MAX_TOKENS
        lost += (ids, text) != expected[n]
    assert lost == 0, f"{lost} surviving requests differ from offline greedy"
    vanished = [m for m in modes if m is not None]
    return {"requests": CONNECTIONS * PER_CONNECTION, "requests_lost": lost,
            "surviving_requests": len(flat),
            "clients_vanished": len(vanished),
            "requests_abandoned": len(vanished) * PER_CONNECTION,
            **{f"vanished_{m}": vanished.count(m) for m in VANISH_MODES}}


async def test_disconnect_storm_leaks_nothing_and_survivors_match_greedy(
    make_engine: MakeEngine, model_dir: Any, figures: dict[str, Any]
) -> None:
    # A pool too small for every stream at once, so that the storm also runs through
    # recompute preemptions (aborts of preempted requests too).
    engine = make_engine(num_kv_blocks=48, schedule_conservativeness=0, max_num_seqs=64)
    totals: dict[str, int] = {}
    async with serving(engine) as server:
        for r in range(ROUNDS):
            for key, value in (await storm_round(engine, model_dir, server, SEED + r)).items():
                totals[key] = totals.get(key, 0) + value
        # and the server serves as before
        async with connect(server.url) as ws:
            await send(ws, generate_msg("after", "after the storm", 8))
            ids, _, end = (await collect_streams(ws, ["after"]))["after"]
            assert end["type"] == "done" and len(ids) == 8
    counts = await kv_audit(engine)
    preemptions = engine.stats().num_preemptions
    assert totals["clients_vanished"] == ROUNDS * CONNECTIONS // 2
    assert preemptions > 0  # the storm also ran through recompute preemption
    figures.update(totals, blocks_leaked=counts["blocks_leaked"], preemptions=preemptions)


async def test_requests_vanishing_while_queued_never_reach_a_step(
    make_engine: MakeEngine
) -> None:
    """Clients reset while their requests wait behind a stalled step: the requests are
    aborted in the queue and never run (no tokens generated for them)."""
    import threading

    engine = make_engine()
    async with serving(engine) as server:
        gate = threading.Event()
        blocker = asyncio.ensure_future(
            engine.run_in_engine_thread(lambda _: gate.wait(30 * UNIT)))
        sockets = []
        for c in range(16):
            ws = await connect(server.url)
            for j in range(4):
                await send(ws, generate_msg(f"q{j}", f"queued {c} {j}", 16))
            sockets.append(ws)
        await eventually(lambda: engine.num_queued_requests == 64, what="64 queued requests")
        for ws in sockets:
            hard_reset(ws)
        await eventually(lambda: engine.num_in_flight == 0, what="streams to close")
        gate.set()
        await blocker
        await assert_clean(engine)
        generated = await engine.run_in_engine_thread(
            lambda e: e.get_stats(include_requests=False).generation_tokens_total)
        assert generated == 0
        async with connect(server.url) as ws:
            await send(ws, generate_msg("x", "still here", 2))
            assert (await collect_streams(ws, ["x"]))["x"][2]["type"] == "done"
