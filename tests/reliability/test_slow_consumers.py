"""Slow consumers: clients that read slowly, or stop reading, slow down neither the engine nor
other clients, lose no token, and cost the server bounded memory.

The design under test: each request's engine mailbox merges deltas while its consumer lags,
and each connection has a bounded send path (the socket's write buffer up to websockets'
write limit, then `max_pending_frames` queued frames, then producers wait), so a lagging
socket only makes its own requests' deltas bigger. Stalled clients here shrink both kernel
buffers (theirs and the server's, as a slow network would) so the backlog really reaches
the server instead of sitting in loopback buffers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.llm_engine import LLMEngine
from frontends.server import EngineServer

from .conftest import (
    UNIT,
    RawWebSocket,
    assert_clean,
    collect_streams,
    eventually,
    generate_msg,
    narrow_server_side,
    offline_greedy,
    recv,
    send,
    serving,
)

MAX_PENDING = 4  # frames a connection may have queued before its producers wait
WRITE_LIMIT = 32 * 1024  # websockets' default high-water mark of a connection's buffer
# What the server may hold for one stalled client: its write buffer, a few queued frames.
PER_CONNECTION_BOUND = WRITE_LIMIT + MAX_PENDING * 4096


def server_buffered_bytes(server: EngineServer) -> dict[int, int]:
    """Bytes the server holds per client port: queued frames plus the transport's buffer."""
    held = {}
    for conn in server._connections:
        total = sum(len(f) for f in conn.outq._queue)  # type: ignore[attr-defined]
        transport = conn.ws.transport
        if transport is not None and not transport.is_closing():
            total += transport.get_write_buffer_size()
        held[conn.ws.remote_address[1]] = total
    return held


def _idle(e: LLMEngine) -> bool:
    return not e.has_unfinished_requests()


async def _stalled_client(server: EngineServer, prompts: list[str], max_tokens: int,
                          tag: str) -> RawWebSocket:
    """A client that sends its requests and then reads nothing."""
    ws, head = await RawWebSocket.open(server.host, server.port, rcvbuf=2048)
    assert head.startswith(b"HTTP/1.1 101"), head
    ws.stop_reading()
    await eventually(lambda: ws.local_port in server_buffered_bytes(server))
    narrow_server_side(server, ws.local_port)
    for i, prompt in enumerate(prompts):
        ws.send_json(generate_msg(f"{tag}{i}", prompt, max_tokens))
    return ws


async def _drain(ws: RawWebSocket, n: int) -> tuple[dict[str, tuple[list[int], str]], int]:
    """Read until `n` streams are done: their outputs and the number of delta frames."""
    out: dict[str, tuple[list[int], str]] = {}
    frames = done = 0
    while done < n:
        ev = await ws.read_event()
        ids, text = out.get(ev["request_id"], ([], ""))
        if ev["type"] == "delta":
            frames += 1
            out[ev["request_id"]] = (ids + ev["token_ids"], text + ev["text"])
        else:
            assert ev["type"] == "done", ev
            assert ev["usage"]["completion_tokens"] == len(ids)
            done += 1
    return out, frames


async def _fast_client(url: str, prompts: list[str], max_tokens: int
                       ) -> tuple[float, dict[str, Any]]:
    async with connect(url) as ws:
        t0 = time.monotonic()
        rids = [f"f{i}" for i in range(len(prompts))]
        for rid, prompt in zip(rids, prompts, strict=True):
            await send(ws, generate_msg(rid, prompt, max_tokens))
        results = await collect_streams(ws, rids)
        return time.monotonic() - t0, results


async def _slow_reader(ws: ClientConnection, rids: list[str], delay: float
                       ) -> tuple[float, dict[str, tuple[list[int], str]]]:
    """Read one frame per `delay` seconds until every stream is done."""
    out: dict[str, tuple[list[int], str]] = {r: ([], "") for r in rids}
    done: set[str] = set()
    while len(done) < len(rids):
        await asyncio.sleep(delay)
        ev = await recv(ws, 60 * UNIT)
        rid = ev["request_id"]
        if ev["type"] == "delta":
            ids, text = out[rid]
            out[rid] = (ids + ev["token_ids"], text + ev["text"])
        else:
            assert ev["type"] == "done", ev
            done.add(rid)
    return time.monotonic(), out


async def test_slow_readers_slow_down_neither_the_engine_nor_other_clients(
    engine: AsyncLLMEngine, model_dir: Any, figures: dict[str, Any]
) -> None:
    fast_prompts = ["The quick brown fox", "Paris is the capital", "hello world", "a b c d"]
    slow_prompts = [f"slow reader {i}" for i in range(6)]
    stalled_prompts = [f"stalled {i}" for i in range(4)]
    expected_fast = offline_greedy(model_dir, fast_prompts, 48)  # type: ignore[arg-type]
    expected_slow = offline_greedy(model_dir, slow_prompts, 96)  # type: ignore[arg-type]
    expected_stalled = offline_greedy(model_dir, stalled_prompts, 240)  # type: ignore[arg-type]
    async with serving(engine, max_pending_frames=MAX_PENDING) as server:
        baseline, _ = await _fast_client(server.url, fast_prompts, 48)

        # Six clients reading one frame per 25 ms, two that read nothing at all.
        stalled = [await _stalled_client(server, stalled_prompts[2 * c:2 * c + 2], 240, "x")
                   for c in range(2)]
        slow_ws = [await connect(server.url, max_queue=1) for _ in slow_prompts]
        for c, ws in enumerate(slow_ws):
            await send(ws, generate_msg(f"s{c}", slow_prompts[c], 96))
        readers = [asyncio.create_task(_slow_reader(ws, [f"s{c}"], 0.025))
                   for c, ws in enumerate(slow_ws)]
        peak: dict[int, int] = {}

        async def sample() -> None:
            while True:
                for port, held in server_buffered_bytes(server).items():
                    peak[port] = max(peak.get(port, 0), held)
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        with_slow, fast_results = await _fast_client(server.url, fast_prompts, 48)
        # The engine finishes every stream while the slow readers are still reading and the
        # stalled clients have read nothing.
        await eventually(lambda: engine.run_in_engine_thread(_idle), 30 * UNIT, "engine idle")
        engine_done = time.monotonic()
        assert not any(r.done() for r in readers), "the slow readers were not slow"
        slow_results = await asyncio.gather(*readers)
        sampler.cancel()
        stalled_held = [peak.get(ws.local_port, 0) for ws in stalled]

        for i, prompt in enumerate(fast_prompts):
            ids, text, _ = fast_results[f"f{i}"]
            assert (ids, text) == expected_fast[i], prompt
        for c, (finished_at, outputs) in enumerate(slow_results):
            assert finished_at > engine_done
            assert outputs[f"s{c}"] == expected_slow[c]
        for c, ws in enumerate(stalled):
            ws.resume_reading()
            outputs, _ = await _drain(ws, 2)
            for j in range(2):
                assert outputs[f"x{j}"] == expected_stalled[2 * c + j]
            ws.close()
        # Bounded: whatever a client owes, the server holds at most its send path's worth.
        assert max(peak.values()) <= PER_CONNECTION_BOUND, peak
        assert min(stalled_held) > WRITE_LIMIT // 2, stalled_held  # they did back up
        # Other clients: eight lagging sockets do not hold the fast client back (a generous
        # bound: two shared cores also run the slow streams' own steps).
        assert with_slow < 3 * baseline + 2.0, (baseline, with_slow)
        for ws2 in slow_ws:
            await ws2.close()
    await assert_clean(engine)
    figures.update(fast_client_alone_s=round(baseline, 3),
                   fast_client_beside_slow_s=round(with_slow, 3),
                   peak_bytes_held_per_stalled_client=max(stalled_held),
                   per_connection_bound_bytes=PER_CONNECTION_BOUND)


async def test_a_client_that_stops_reading_loses_no_token(
    engine: AsyncLLMEngine, model_dir: Any, figures: dict[str, Any]
) -> None:
    """The engine finishes while the client reads nothing; the server then holds a bounded
    amount for it; when it reads again every token is there, the tail in merged deltas."""
    prompts = [f"stop reading {i}" for i in range(4)]
    max_tokens = 240
    expected = offline_greedy(model_dir, prompts, max_tokens)  # type: ignore[arg-type]
    async with serving(engine, max_pending_frames=MAX_PENDING) as server:
        ws = await _stalled_client(server, prompts, max_tokens, "p")
        await eventually(lambda: engine.run_in_engine_thread(_idle), 30 * UNIT, "engine idle")
        (conn,) = server._connections
        await eventually(lambda: server_buffered_bytes(server)[ws.local_port] > WRITE_LIMIT // 2,
                         what="the send path to back up")
        held = 0
        for _ in range(50):  # and it stays bounded while nobody reads
            held = max(held, server_buffered_bytes(server)[ws.local_port])
            assert conn.outq.qsize() <= MAX_PENDING
            await asyncio.sleep(0.01)
        assert held <= PER_CONNECTION_BOUND, held
        ws.resume_reading()
        outputs, frames = await _drain(ws, len(prompts))
        for i in range(len(prompts)):
            assert outputs[f"p{i}"] == expected[i]
        ws.close()
    await assert_clean(engine)
    tokens = len(prompts) * max_tokens
    assert frames < tokens  # the deltas were merged while the client did not read
    figures.update(tokens_while_not_reading=tokens, delta_frames_received=frames,
                   server_bytes_held_for_stalled_client=held)
