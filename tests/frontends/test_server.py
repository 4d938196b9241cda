"""The WebSocket server over real sockets on port 0, with the tiny model behind it."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.sampling_params import SamplingParams
from frontends import protocol as p
from frontends.server import EngineServer, ServerConfig, serve_engine

from .conftest import UNIT, all_blocks_free, offline_greedy

PROMPTS = ["The quick brown fox", "Once upon a time", "hello world", "a b c d e f"]


async def recv(ws: ClientConnection, timeout: float = 10 * UNIT) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def send(ws: ClientConnection, obj: dict[str, Any]) -> None:
    await ws.send(json.dumps(obj))


async def collect_many(
    ws: ClientConnection, rids: list[str]
) -> dict[str, tuple[list[int], str, dict[str, Any]]]:
    """Read interleaved events until every request in `rids` is done."""
    ids: dict[str, list[int]] = {r: [] for r in rids}
    text = dict.fromkeys(rids, "")
    done: dict[str, dict[str, Any]] = {}
    while len(done) < len(rids):
        ev = await recv(ws)
        rid = ev.get("request_id")
        assert rid in ids and rid not in done, ev
        if ev["type"] == "delta":
            ids[rid] += ev["token_ids"]
            text[rid] += ev["text"]
        elif ev["type"] == "done":
            done[rid] = ev
        else:
            raise AssertionError(ev)
    return {r: (ids[r], text[r], done[r]) for r in rids}


async def collect(ws: ClientConnection, rid: str) -> tuple[list[int], str, dict[str, Any]]:
    """Read one request's events until its `done`: token ids, text and the done event."""
    return (await collect_many(ws, [rid]))[rid]


def http_get(server: EngineServer, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(server.http_url + path, timeout=10 * UNIT) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


async def get(server: EngineServer, path: str) -> tuple[int, str, str]:
    return await asyncio.to_thread(http_get, server, path)


async def test_streamed_text_equals_offline_greedy(server: EngineServer, model_dir: Any) -> None:
    expected = offline_greedy(model_dir, PROMPTS, max_tokens=12)
    async with connect(server.url) as ws:
        for i, prompt in enumerate(PROMPTS):
            await send(ws, {"type": "generate", "request_id": f"g{i}", "prompt": prompt,
                            "params": {"temperature": 0, "max_tokens": 12}})
        results = await collect_many(ws, [f"g{i}" for i in range(len(PROMPTS))])
        for i in range(len(PROMPTS)):
            ids, text, done = results[f"g{i}"]
            assert ids == expected[i].token_ids
            assert text == expected[i].text
            assert done["finish_reason"] == expected[i].finish_reason
            assert done["usage"] == {"prompt_tokens": len(expected[i].prompt_token_ids),
                                     "completion_tokens": len(ids)}


async def test_fifty_concurrent_requests_over_several_connections(
    server: EngineServer, engine: AsyncLLMEngine, model_dir: Any
) -> None:
    n_conn, per_conn = 5, 10
    prompts = [f"request number {i}" for i in range(n_conn * per_conn)]
    expected = offline_greedy(model_dir, prompts, max_tokens=8)

    async def one_connection(c: int) -> None:
        async with connect(server.url) as ws:
            rids = [f"r{c * per_conn + j}" for j in range(per_conn)]
            for rid in rids:
                i = int(rid[1:])
                await send(ws, {"type": "generate", "request_id": rid, "prompt": prompts[i],
                                "params": {"temperature": 0, "max_tokens": 8}})
            results = await collect_many(ws, rids)
            for rid in rids:
                assert results[rid][0] == expected[int(rid[1:])].token_ids

    await asyncio.wait_for(asyncio.gather(*(one_connection(c) for c in range(n_conn))),
                           60 * UNIT)
    await all_blocks_free(engine)


async def test_cancel_mid_stream_frees_blocks(server: EngineServer,
                                              engine: AsyncLLMEngine) -> None:
    async with connect(server.url) as ws:
        await send(ws, {"type": "generate", "request_id": "long", "prompt": "tell me a story",
                        "params": {"max_tokens": 200, "ignore_eos": True}})
        first = await recv(ws)
        assert first["type"] == "delta"
        await send(ws, {"type": "cancel", "request_id": "long"})
        while (ev := await recv(ws))["type"] == "delta":
            pass
        assert ev["type"] == "done" and ev["finish_reason"] == "abort"
        assert ev["usage"]["completion_tokens"] < 200
        await all_blocks_free(engine)
        # the connection goes on; cancelling again is `not_found`
        await send(ws, {"type": "cancel", "request_id": "long"})
        ev = await recv(ws)
        assert ev == {"type": "error", "code": "not_found", "request_id": "long",
                      "message": ev["message"]}


async def test_disconnect_mid_stream_frees_blocks(server: EngineServer,
                                                  engine: AsyncLLMEngine) -> None:
    async with connect(server.url) as ws:
        for i in range(3):
            await send(ws, {"type": "generate", "request_id": f"d{i}", "prompt": "go on",
                            "params": {"max_tokens": 200, "ignore_eos": True}})
        assert (await recv(ws))["type"] == "delta"
    await all_blocks_free(engine)
    assert engine.num_in_flight == 0


@pytest.mark.parametrize(("frame", "code", "needle", "rid"), [
    ("{not json", "invalid_request", "malformed JSON", None),
    ('{"type": "teleport", "request_id": "u"}', "unknown_type", "teleport", "u"),
    ('{"type": "generate", "request_id": "w", "prompt": "x", "params": {"max_tokens": "8"}}',
     "invalid_request", "Expected `int`, got `str` - at `$.params.max_tokens`", "w"),
    ('{"type": "generate", "request_id": "o", "prompt": "x", "params": {"top_p": 1.5}}',
     "invalid_request", "at `$.params.top_p`", "o"),
    ('{"type": "generate", "request_id": "v", "prompt_token_ids": [1, 99999999]}',
     "invalid_request", "outside the vocabulary [0, ", "v"),
    ('{"type": "generate", "request_id": "v", "prompt_token_ids": [1, 99999999]}',
     "invalid_request", "- at `$.prompt_token_ids`", "v"),
    ('{"type": "generate", "request_id": "m", "prompt": "x", "params": {"max_tokens": 300}}',
     "prompt_too_long", "exceeds max_model_len (256) - at `$.params.max_tokens`", "m"),
])
async def test_bad_messages_get_errors_and_the_connection_goes_on(
    server: EngineServer, frame: str, code: str, needle: str, rid: str | None
) -> None:
    async with connect(server.url) as ws:
        await ws.send(frame)
        ev = await recv(ws)
        assert ev["type"] == "error" and ev["code"] == code and ev["request_id"] == rid
        assert needle in ev["message"]
        await send(ws, {"type": "generate", "request_id": "ok", "prompt": "still here",
                        "params": {"max_tokens": 3, "ignore_eos": True}})
        ids, _, done = await collect(ws, "ok")
        assert len(ids) == 3 and done["finish_reason"] == "length"


async def test_prompt_over_max_model_len_is_rejected(server: EngineServer,
                                                     engine: AsyncLLMEngine) -> None:
    max_len = engine.max_model_len
    async with connect(server.url) as ws:
        await send(ws, {"type": "generate", "request_id": "big",
                        "prompt_token_ids": [5] * max_len, "params": {"max_tokens": 1}})
        ev = await recv(ws)
        assert ev["type"] == "error" and ev["code"] == "prompt_too_long"
        assert ev["request_id"] == "big" and "max_model_len" in ev["message"]
        await send(ws, {"type": "generate", "request_id": "fits",
                        "prompt_token_ids": [5] * 4, "params": {"max_tokens": max_len - 4}})
        assert (await recv(ws))["type"] in ("delta", "done")
        await send(ws, {"type": "cancel", "request_id": "fits"})
    await all_blocks_free(engine)


async def test_duplicate_request_id_on_one_connection(server: EngineServer) -> None:
    async with connect(server.url) as ws:
        gen = {"type": "generate", "request_id": "same", "prompt": "x",
               "params": {"max_tokens": 50, "ignore_eos": True}}
        await send(ws, gen)
        await send(ws, gen)
        while (ev := await recv(ws))["type"] == "delta":
            pass
        assert ev["type"] == "error" and ev["code"] == "duplicate_request_id"
        await send(ws, {"type": "cancel", "request_id": "same"})


async def test_chat_messages_use_the_chat_template(server: EngineServer,
                                                   engine: AsyncLLMEngine) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    prompt_ids = engine.engine.apply_chat_template(messages)
    async with connect(server.url) as ws:
        await send(ws, {"type": "generate", "request_id": "c", "messages": messages,
                        "params": {"max_tokens": 4, "ignore_eos": True}})
        _, _, done = await collect(ws, "c")
        assert done["usage"]["prompt_tokens"] == len(prompt_ids)


async def test_overload_is_rejected_at_once(engine: AsyncLLMEngine) -> None:
    gate = threading.Event()
    # Hold the step thread so that accepted requests stay queued.
    blocker = asyncio.ensure_future(engine.run_in_engine_thread(lambda _: gate.wait(30 * UNIT)))
    config = ServerConfig(port=0, max_queued_requests=2)
    async with serve_engine(engine, config) as server, connect(server.url) as ws:
        for i in range(3):
            await send(ws, {"type": "generate", "request_id": f"q{i}", "prompt": "queued",
                            "params": {"max_tokens": 2, "ignore_eos": True}})
        ev = await recv(ws)
        assert ev["type"] == "error" and ev["code"] == "overloaded" and ev["request_id"] == "q2"
        gate.set()
        await blocker
        done = set()
        while len(done) < 2:
            ev = await recv(ws)
            if ev["type"] == "done":
                done.add(ev["request_id"])
        assert done == {"q0", "q1"}
        _, _, body = await get(server, "/metrics")
        rejected = {s.labels.get("code"): s.value
                    for f in text_string_to_metric_families(body)
                    if f.name == "asyncengine_requests_rejected" for s in f.samples}
        assert rejected.get("overloaded") == 1


async def test_per_connection_cap(engine: AsyncLLMEngine) -> None:
    config = ServerConfig(port=0, max_requests_per_connection=1)
    async with serve_engine(engine, config) as server, connect(server.url) as ws:
        await send(ws, {"type": "generate", "request_id": "a", "prompt": "x",
                        "params": {"max_tokens": 100, "ignore_eos": True}})
        await send(ws, {"type": "generate", "request_id": "b", "prompt": "y",
                        "params": {"max_tokens": 2}})
        while (ev := await recv(ws))["type"] == "delta":
            pass
        assert ev["type"] == "error" and ev["code"] == "overloaded" and ev["request_id"] == "b"
        await send(ws, {"type": "cancel", "request_id": "a"})
    await all_blocks_free(engine)


async def test_metrics_count_what_happened(server: EngineServer) -> None:
    async with connect(server.url) as ws:
        total_prompt = total_gen = 0
        for i in range(3):
            await send(ws, {"type": "generate", "request_id": f"m{i}", "prompt": "count me",
                            "params": {"max_tokens": 5, "ignore_eos": True}})
            ids, _, done = await collect(ws, f"m{i}")
            total_prompt += done["usage"]["prompt_tokens"]
            total_gen += len(ids)
    status, ctype, body = await get(server, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(body) for s in f.samples}
    model = (("model_name", server.engine.model_name),)
    assert samples[("asyncengine_prompt_tokens_total", model)] == total_prompt
    assert samples[("asyncengine_generation_tokens_total", model)] == total_gen == 15
    assert samples[("asyncengine_time_to_first_token_seconds_count", model)] == 3
    assert samples[("asyncengine_e2e_request_latency_seconds_count", model)] == 3
    assert samples[("asyncengine_inter_token_latency_seconds_count", model)] == 12
    finished = (("finished_reason", "length"), *model)
    assert samples[("asyncengine_request_success_total", tuple(sorted(finished)))] == 3
    for gauge in ("num_requests_running", "num_requests_waiting", "num_requests_swapped",
                  "kv_cache_usage_perc", "kv_cache_reserved_perc", "prefix_cache_hit_rate"):
        assert (f"asyncengine_{gauge}", model) in samples
    assert ("asyncengine_num_preemptions_total", model) in samples


async def test_healthz_and_dead_engine(server: EngineServer, engine: AsyncLLMEngine) -> None:
    assert (await get(server, "/healthz"))[:1] == (200,)

    def explode(_: Any) -> list[Any]:
        raise RuntimeError("device lost")

    engine.engine.step = explode  # type: ignore[method-assign]
    async with connect(server.url) as ws:
        await send(ws, {"type": "generate", "request_id": "x", "prompt": "boom",
                        "params": {"max_tokens": 3}})
        ev = await recv(ws)
        assert ev["type"] == "error" and ev["code"] == "engine_error"
        assert engine.errored
        status, _, body = await get(server, "/healthz")
        assert status == 503 and "dead" in body
        await send(ws, {"type": "generate", "request_id": "y", "prompt": "again",
                        "params": {"max_tokens": 3}})
        ev = await recv(ws)
        assert ev["code"] == "engine_error" and ev["request_id"] == "y"


async def test_non_loopback_bind_without_key_is_refused(engine: AsyncLLMEngine) -> None:
    with pytest.raises(ValueError, match="API key"):
        async with serve_engine(engine, ServerConfig(host="0.0.0.0", port=0)):
            pass


async def test_api_key_is_checked_at_connect(engine: AsyncLLMEngine) -> None:
    config = ServerConfig(port=0, api_key="s3cret")
    async with serve_engine(engine, config) as server:
        for headers, url in [(None, server.url),
                             ({"Authorization": "Bearer wrong"}, server.url),
                             (None, server.url + "/?api_key=wrong")]:
            with pytest.raises(InvalidStatus) as info:
                async with connect(url, additional_headers=headers):
                    pass
            assert info.value.response.status_code == 401
        async with connect(server.url, additional_headers={"Authorization": "Bearer s3cret"}):
            pass
        async with connect(server.url + "/?api_key=s3cret") as ws:
            await send(ws, {"type": "generate", "request_id": "k", "prompt": "x",
                            "params": {"max_tokens": 2, "ignore_eos": True}})
            assert len((await collect(ws, "k"))[0]) == 2
        assert (await get(server, "/healthz"))[0] == 200


async def test_origin_allow_list(engine: AsyncLLMEngine) -> None:
    config = ServerConfig(port=0, allowed_origins=["https://ok.example"])
    async with serve_engine(engine, config) as server:
        with pytest.raises(InvalidStatus) as info:
            async with connect(server.url, origin="https://evil.example"):  # type: ignore[arg-type]
                pass
        assert info.value.response.status_code == 403
        async with connect(server.url, origin="https://ok.example"):  # type: ignore[arg-type]
            pass


async def test_oversized_frame_closes_with_1009(engine: AsyncLLMEngine) -> None:
    config = ServerConfig(port=0, max_size=1024)
    async with serve_engine(engine, config) as server, connect(server.url) as ws:
        await send(ws, {"type": "generate", "request_id": "huge", "prompt": "x" * 4096})
        with pytest.raises(ConnectionClosed):
            await recv(ws)
        assert ws.close_code == 1009


async def test_drain_finishes_in_flight_requests_then_closes(engine: AsyncLLMEngine) -> None:
    server = EngineServer(engine, ServerConfig(port=0))
    await server.start()
    async with connect(server.url) as ws:
        await send(ws, {"type": "generate", "request_id": "last", "prompt": "finish me",
                        "params": {"max_tokens": 20, "ignore_eos": True}})
        first = await recv(ws)
        assert first["type"] == "delta"
        drain = asyncio.create_task(server.drain(timeout=30 * UNIT))
        await asyncio.sleep(0)
        status, _, _ = await get(server, "/healthz")
        assert status == 503
        with pytest.raises(InvalidStatus) as info:
            async with connect(server.url):
                pass
        assert info.value.response.status_code == 503
        events = []
        with pytest.raises(ConnectionClosed):
            while True:
                events.append(await recv(ws))
        assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "length"
        # The first delta may carry several tokens (deltas merge while the reader lags).
        assert sum(len(e.get("token_ids", [])) for e in [first, *events]) == 20
        assert ws.close_code == 1001
        await drain
    with pytest.raises(OSError):
        async with connect(server.url, open_timeout=2 * UNIT):
            pass


async def test_slow_reader_does_not_stall_other_connections(engine: AsyncLLMEngine) -> None:
    config = ServerConfig(port=0, max_pending_frames=2)
    async with serve_engine(engine, config) as server:
        # A client that never reads: its requests stall at the send buffer, not the engine.
        # A tiny receive window makes the server's sends back up after a few frames.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        sock.connect((server.host, server.port))
        sleeper = await connect(server.url, sock=sock, max_queue=1)
        for i in range(8):
            await send(sleeper, {"type": "generate", "request_id": f"s{i}",
                                 "prompt": "never read",
                                 "params": {"max_tokens": 200, "ignore_eos": True}})
        async with asyncio.timeout(20 * UNIT):
            # wait until the writer is blocked on the socket with its buffer full
            while not any(c.outq.qsize() >= config.max_pending_frames
                          for c in server._connections):
                await asyncio.sleep(0.01)
        async with connect(server.url) as ws:
            await send(ws, {"type": "generate", "request_id": "fast", "prompt": "read me",
                            "params": {"max_tokens": 30, "ignore_eos": True}})
            ids, _, done = await collect(ws, "fast")
            assert len(ids) == 30 and done["finish_reason"] == "length"
        sleeper.transport.abort()  # the stuck client vanishes without a closing handshake
        await all_blocks_free(engine)


async def test_engine_ids_are_per_connection(server: EngineServer) -> None:
    async with connect(server.url) as a, connect(server.url) as b:
        for ws in (a, b):
            await send(ws, {"type": "generate", "request_id": "shared", "prompt": "x",
                            "params": {"max_tokens": 3, "ignore_eos": True}})
        for ws in (a, b):
            assert len((await collect(ws, "shared"))[0]) == 3


def test_sampling_params_defaults_match() -> None:
    # the wire defaults are the engine's defaults
    sp = p.GenerateParams().to_sampling_params()
    ref = SamplingParams()
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        assert getattr(sp, name) == getattr(ref, name)


def test_sigterm_drains_in_flight_requests_under_uvloop(llm_engine: Any) -> None:
    import os
    import signal

    import uvloop

    from asyncengine.async_engine import AsyncLLMEngine as Engine
    from frontends.cli import run_async
    from frontends.client import AsyncClient
    from frontends.server import run_server

    async def scenario() -> list[Any]:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        engine = Engine(llm_engine)
        listening: asyncio.Future[EngineServer] = asyncio.get_running_loop().create_future()

        async def on_started(srv: EngineServer) -> None:
            listening.set_result(srv)
            await asyncio.Event().wait()

        serving = asyncio.create_task(run_server(engine, ServerConfig(port=0),
                                                 on_started=on_started))
        srv = await asyncio.wait_for(listening, 10 * UNIT)
        async with AsyncClient(srv.url) as client:
            gen = client.generate("drain me", max_tokens=20, ignore_eos=True)
            chunks = [await anext(gen)]
            os.kill(os.getpid(), signal.SIGTERM)  # handled by run_server: drain, then return
            chunks += [c async for c in gen]
        await asyncio.wait_for(serving, 30 * UNIT)
        await engine.shutdown()
        return chunks

    chunks = run_async(scenario())
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == 20
    assert llm_engine.pool.num_free_blocks == llm_engine.pool.num_blocks


async def test_prompt_logprobs_come_with_done(server: EngineServer, model_dir: Any) -> None:
    """`params.prompt_logprobs` scores the prompt; `done` carries it whole, equal to the
    offline engine's; a request that does not ask gets no such field; a bad k is an error
    naming its path."""
    from .conftest import _offline_llm

    prompt = "The quick brown fox"
    [want] = _offline_llm(str(model_dir)).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
        use_tqdm=False)
    async with connect(server.url) as ws:
        await send(ws, {"type": "generate", "request_id": "lp", "prompt": prompt,
                        "params": {"temperature": 0, "max_tokens": 2, "prompt_logprobs": 2}})
        _, _, done = await collect(ws, "lp")
        got = done["prompt_logprobs"]
        assert got[0] is None and len(got) == len(want.prompt_token_ids)
        for tid, entry, ref in zip(want.prompt_token_ids[1:], got[1:], want.prompt_logprobs[1:],
                                   strict=True):  # fmt: skip
            assert {int(t) for t in entry} == set(ref)
            assert entry[str(tid)]["logprob"] == pytest.approx(ref[tid].logprob, abs=1e-6)
            assert entry[str(tid)]["rank"] == ref[tid].rank
            assert entry[str(tid)]["decoded_token"] == ref[tid].decoded_token
        await send(ws, {"type": "generate", "request_id": "plain", "prompt": prompt,
                        "params": {"max_tokens": 2}})
        assert "prompt_logprobs" not in (await collect(ws, "plain"))[2]
        await send(ws, {"type": "generate", "request_id": "bad", "prompt": prompt,
                        "params": {"prompt_logprobs": 21}})
        err = await recv(ws)
        assert err["type"] == "error" and "$.params.prompt_logprobs" in err["message"]
