"""Security: who may connect and what leaks.

Loopback is the default bind; any other bind needs an API key; a wrong or missing key is
refused during the handshake, before the server does any work for the client; the key is
compared in constant time; browser pages from other origins are refused; frames and
per-connection requests are capped; prompt text never reaches the logs by default.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

import frontends.api_key as api_key_module
import frontends.server as server_module
from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.detokenizer import IncrementalDetokenizer
from asyncengine.errors import ErrorCode
from frontends import protocol as p
from frontends.cli import build_parser
from frontends.server import ServerConfig

from .conftest import (
    RawWebSocket,
    assert_clean,
    client_frame,
    collect_streams,
    generate_msg,
    http_get,
    recv,
    send,
    serving,
)

KEY = "k3y-for-tests-0123456789"


def test_loopback_is_the_default_bind() -> None:
    assert ServerConfig().host == "127.0.0.1"
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "10.0.0.1", "example.com",
                                  "fe80::1", "127.0.0.1.nip.io"])
def test_a_non_loopback_bind_requires_an_api_key(host: str) -> None:
    with pytest.raises(ValueError, match="API key"):
        ServerConfig(host=host).validate()
    with pytest.raises(ValueError, match="API key"):
        ServerConfig(host=host, api_key="").validate()
    ServerConfig(host=host, api_key=KEY).validate()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "localhost"])
def test_loopback_binds_need_no_key(host: str) -> None:
    ServerConfig(host=host).validate()


async def test_the_server_listens_on_loopback_only(engine: AsyncLLMEngine) -> None:
    async with serving(engine) as server:
        hosts = {s.getsockname()[0] for s in server._ws_server.sockets}  # type: ignore[union-attr]
        assert hosts == {"127.0.0.1"}


async def test_a_wrong_or_missing_key_is_refused_before_any_work(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch, figures: dict[str, Any]
) -> None:
    work: list[str] = []
    llm = engine.engine
    for name in ("tokenize", "apply_chat_template"):
        original = getattr(llm, name)
        monkeypatch.setattr(llm, name, lambda *a, _o=original, _n=name, **k: (
            work.append(_n), _o(*a, **k))[1])
    original_add = engine.add_request
    monkeypatch.setattr(engine, "add_request", lambda *a, **k: (
        work.append("add_request"), original_add(*a, **k))[1])
    attempts = [
        ({}, ""), ({"Authorization": "Bearer wrong"}, ""), ({"Authorization": "Basic " + KEY}, ""),
        ({"Authorization": "Bearer " + KEY[:-1]}, ""),
        ({"Authorization": "Bearer " + KEY + "x"}, ""),
        ({"Authorization": "Bearer "}, ""), ({}, "?api_key=wrong"), ({}, "?api_key="),
        ({}, "?api_key=" + KEY.upper()), ({"Authorization": "Bearer " + "é" * 40}, ""),
    ]
    # A connection handler's first act is to build its `_Connection`: count those.
    handler_calls = 0
    original_init = server_module._Connection.__init__

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal handler_calls
        handler_calls += 1
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(server_module._Connection, "__init__", counting_init)
    async with serving(engine, api_key=KEY) as server:
        for headers, query in attempts:
            with pytest.raises(InvalidStatus) as info:
                async with connect(server.url + "/" + query,
                                   additional_headers=headers or None):
                    pass
            assert info.value.response.status_code == 401
            assert KEY.encode() not in info.value.response.body
        # A client that ignores the refusal and pipelines a request behind its handshake.
        ws, head = await RawWebSocket.open(server.host, server.port)
        ws.write(client_frame(0x1, p.encode(p.Generate(request_id="sneak", prompt="hi"))))
        ws.writer.write_eof()
        assert head.startswith(b"HTTP/1.1 401"), head
        assert (await ws.read_until_close()) == (None, [])  # closed, nothing answered
        assert handler_calls == 0 and work == []
        assert engine.num_in_flight == 0
        # The right key, by header or by query string, is served.
        for headers, query in [({"Authorization": "Bearer " + KEY}, ""),
                               ({"Authorization": "bearer " + KEY}, ""), ({}, "?api_key=" + KEY)]:
            async with connect(server.url + "/" + query, additional_headers=headers or None) as c:
                await send(c, generate_msg("k", "with key", 2))
                assert (await collect_streams(c, ["k"]))["k"][2]["type"] == "done"
        assert handler_calls == 3 and "add_request" in work
        # Health checks stay open to load balancers without the key.
        assert (await http_get(server, "/healthz"))[0] == 200
    await assert_clean(engine)
    figures.update(refused_attempts=len(attempts) + 1, handler_calls_for_refused=0)


async def test_the_key_is_compared_in_constant_time(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every check goes through `hmac.compare_digest` on fixed-length digests, so neither the
    content nor the length of a guess changes how long the comparison takes."""
    calls: list[tuple[int, int]] = []
    real = api_key_module.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(api_key_module.hmac, "compare_digest", spy)
    async with serving(engine, api_key=KEY) as server:
        for guess in ["", "x", KEY[:5], KEY + "suffix" * 50, KEY]:
            try:
                async with connect(server.url, additional_headers={
                        "Authorization": "Bearer " + guess}):
                    pass
            except InvalidStatus as exc:
                assert exc.response.status_code == 401 and guess != KEY
    assert len(calls) == 5 and set(calls) == {(32, 32)}


@pytest.mark.parametrize(("allowed", "origin", "ok"), [
    (None, None, True),  # non-browser clients send no Origin
    (None, "http://localhost:3000", True),
    (None, "http://127.0.0.1:8080", True),
    (None, "https://[::1]", True),
    (None, "https://evil.example", False),
    (None, "http://localhost.evil.example", False),
    (None, "null", False),  # sandboxed frames and file:// pages
    (["https://app.example"], "https://app.example", True),
    (["https://app.example"], "http://localhost:3000", False),
    (["https://app.example"], None, True),
    (["*"], "https://anything.example", True),
])
async def test_browser_origins(engine: AsyncLLMEngine, allowed: list[str] | None,
                               origin: str | None, ok: bool) -> None:
    async with serving(engine, allowed_origins=allowed) as server:
        if ok:
            async with connect(server.url, origin=origin):  # type: ignore[arg-type]
                pass
        else:
            with pytest.raises(InvalidStatus) as info:
                async with connect(server.url, origin=origin):  # type: ignore[arg-type]
                    pass
            assert info.value.response.status_code == 403


async def test_frames_over_the_size_limit_close_the_connection_with_1009(
    engine: AsyncLLMEngine,
) -> None:
    async with serving(engine, max_size=4096) as server:
        async with connect(server.url) as ws:
            await send(ws, generate_msg("fits", "x " * 1000, 2))  # under the limit: served
            end = (await collect_streams(ws, ["fits"]))["fits"][2]
            assert end["type"] in ("done", "error")
            await ws.send("y" * 4097)
            with pytest.raises(ConnectionClosed):
                await recv(ws)
            assert ws.close_code == 1009
        async with connect(server.url) as ws:  # and the next client is fine
            await send(ws, generate_msg("n", "next", 2))
            assert (await collect_streams(ws, ["n"]))["n"][2]["type"] == "done"
    await assert_clean(engine)


async def test_requests_in_flight_per_connection_are_capped(engine: AsyncLLMEngine) -> None:
    async with serving(engine, max_requests_per_connection=3) as server, \
            connect(server.url) as ws:
        for i in range(5):
            await send(ws, generate_msg(f"r{i}", f"cap {i}", 40))
        refused = []
        while len(refused) < 2:
            ev = await recv(ws)
            if ev["type"] == "error":
                refused.append(ev)
        assert [e["request_id"] for e in refused] == ["r3", "r4"]
        assert all(e["code"] == ErrorCode.OVERLOADED for e in refused)
        for i in range(3):
            await send(ws, {"type": "cancel", "request_id": f"r{i}"})
        ended = set()
        while len(ended) < 3:
            ev = await recv(ws)
            if ev["type"] == "done":
                ended.add(ev["request_id"])
        # the cap counts requests in flight: once they end there is room again
        await send(ws, generate_msg("again", "room again", 2))
        assert (await collect_streams(ws, ["again"]))["again"][2]["type"] == "done"
    await assert_clean(engine)


SECRET = "zebra-quartz-7731"


async def _session_touching_every_path(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Send the secret through every path that could log it: a prompt, chat messages, a
    rejected request, a too-long prompt, an unknown type, a malformed frame, a failing
    request (with a logged traceback), a cancel and a vanishing client."""
    original_init = IncrementalDetokenizer.__init__
    original_append = IncrementalDetokenizer.append

    def init(self: IncrementalDetokenizer, tokenizer: Any, prompt_token_ids: Any,
             **kw: Any) -> None:
        original_init(self, tokenizer, prompt_token_ids, **kw)
        self._boom = tokenizer.decode(prompt_token_ids) == SECRET  # type: ignore[attr-defined]

    def append(self: IncrementalDetokenizer, token_ids: Any) -> str:
        if getattr(self, "_boom", False):
            raise RuntimeError("injected detokenizer fault")
        return original_append(self, token_ids)

    async with connect(server.url) as ws:
        await send(ws, generate_msg("a", f"tell me about {SECRET}", 4))
        await send(ws, {"type": "generate", "request_id": "b",
                        "messages": [{"role": "user", "content": SECRET}],
                        "params": {"max_tokens": 4}})
        await collect_streams(ws, ["a", "b"])
        await send(ws, {"type": "generate", "request_id": "c", "prompt": SECRET,
                        "params": {"top_p": 7}})
        await send(ws, generate_msg("d", (SECRET + " ") * 200, 200))
        await send(ws, {"type": SECRET, "request_id": "e", "prompt": SECRET})
        await ws.send('{"type": "generate", "prompt": "' + SECRET)
        await send(ws, {"type": "cancel", "request_id": SECRET})
        for _ in range(5):
            assert (await recv(ws))["type"] == "error"
        monkeypatch.setattr(IncrementalDetokenizer, "__init__", init)
        monkeypatch.setattr(IncrementalDetokenizer, "append", append)
        await send(ws, generate_msg("f", SECRET, 8))
        assert (await collect_streams(ws, ["f"]))["f"][2]["type"] == "error"
        monkeypatch.setattr(IncrementalDetokenizer, "append", original_append)
        await send(ws, generate_msg("g", SECRET, 200))
        await recv(ws)
        await send(ws, {"type": "cancel", "request_id": "g"})
        await collect_streams(ws, ["g"])
    ws = await connect(server.url)
    await send(ws, generate_msg("h", SECRET, 200))
    await recv(ws)
    ws.transport.abort()


def _logged_text(records: list[logging.LogRecord]) -> str:
    """The server side's log output, tracebacks included (the test's own websockets client
    logs its frames at DEBUG: that is the client's business, not the server's)."""
    formatter = logging.Formatter("%(name)s %(message)s")
    return "\n".join(formatter.format(r) for r in records
                     if not r.name.startswith("websockets.client"))


async def test_no_prompt_text_in_the_logs_by_default(
    engine: AsyncLLMEngine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    figures: dict[str, Any]
) -> None:
    caplog.set_level(logging.DEBUG)  # stricter than the default: everything is captured
    async with serving(engine) as server:
        await _session_touching_every_path(server, monkeypatch)
        await assert_clean(engine)
    text = _logged_text(caplog.records)
    assert caplog.records, "nothing was logged at all: the capture is not working"
    assert SECRET not in text
    figures.update(log_records_checked=len(caplog.records))


async def test_prompts_are_logged_only_when_asked(
    engine: AsyncLLMEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """The positive control of the test above: with `log_prompts` the text does show."""
    caplog.set_level(logging.DEBUG)
    async with serving(engine, log_prompts=True) as server, connect(server.url) as ws:
        await send(ws, generate_msg("a", f"tell me about {SECRET}", 2))
        await collect_streams(ws, ["a"])
    await asyncio.sleep(0)
    assert SECRET in _logged_text(caplog.records)
    await assert_clean(engine)
