"""Shared pieces of the reliability suite: the tiny model behind a real server on port 0,
the offline greedy oracle, the end-of-test KV audit, and raw-socket WebSocket helpers for
clients that misbehave below the protocol (resets, garbage frames, stopped readers).

Every timeout is a multiple of `UNIT`; every engine made here is audited when its test ends:
no request left in the engine and every KV block free.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import os
import socket
import struct
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from websockets.asyncio.client import ClientConnection

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.config import EngineArgs
from asyncengine.llm_engine import LLMEngine
from asyncengine.sampling_params import SamplingParams
from asyncengine_kernels import envs
from frontends.server import EngineServer, ServerConfig, serve_engine
from tests.frontends.conftest import wait_idle as _wait_idle

UNIT = envs.test_timeout_factor()  # seconds

ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=16,
    max_num_seqs=64, enforce_eager=True, seed=0,
)

MakeEngine = Callable[..., AsyncLLMEngine]


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run these tests on uvloop, the loop `asyncengine serve` runs on."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: the step thread, the event loop and the test's clients share two
    cores, and a second torch thread spinning against them makes each step ~40x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def model_dir(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir


# ------------------------------------------------------------------------ oracle
@functools.cache
def _offline_llm(model_dir: str) -> Any:
    from asyncengine.llm import LLM

    return LLM(model_dir, **ENGINE_ARGS)


def offline_greedy(model_dir: Path, prompts: list[str | list[int]], max_tokens: int,
                   **params: Any) -> list[tuple[list[int], str]]:
    """(token ids, text) of each prompt under offline greedy decoding: the oracle of what
    `generate_msg` asks for (`ignore_eos` unless overridden)."""
    llm = _offline_llm(str(model_dir))
    params.setdefault("ignore_eos", True)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text)
            for o in llm.generate(prompts, sp, use_tqdm=False)]


# ------------------------------------------------------------------------ engines
async def wait_idle(engine: AsyncLLMEngine, timeout: float = 20 * UNIT) -> None:
    """Wait until the engine holds no request (finished or aborted)."""
    await _wait_idle(engine, timeout)


async def kv_audit(engine: AsyncLLMEngine, timeout: float = 20 * UNIT) -> dict[str, int]:
    """Wait for idle, then check the pool's integrity and return the counts that must be 0."""
    await wait_idle(engine, timeout)

    def audit(e: LLMEngine) -> dict[str, int]:
        e.check_integrity()
        s = e.scheduler
        return {"blocks_leaked": e.pool.num_blocks - e.pool.num_free_blocks,
                "running": len(s.running), "waiting": len(s.waiting),
                "swapped": len(s.swapped), "engine_requests": len(s.requests)}

    return await engine.run_in_engine_thread(audit)


async def assert_clean(engine: AsyncLLMEngine, timeout: float = 20 * UNIT) -> None:
    """Every KV block free, nothing running/waiting/swapped, no stream left on the loop."""
    counts = await kv_audit(engine, timeout)
    assert counts == dict.fromkeys(counts, 0), counts
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.num_in_flight:  # streams close as their handlers unwind
        assert asyncio.get_running_loop().time() < deadline, engine.num_in_flight
        await asyncio.sleep(0.02)
    assert engine.num_queued_requests == 0 and engine.num_queued_prompt_tokens == 0


@pytest.fixture
async def make_engine(model_dir: Path) -> AsyncIterator[MakeEngine]:
    """`make_engine(**engine_arg_overrides)`: an AsyncLLMEngine over the tiny model; at the
    end of the test each live one is shut down and must have leaked nothing."""
    made: list[tuple[AsyncLLMEngine, LLMEngine]] = []

    def make(**overrides: Any) -> AsyncLLMEngine:
        llm = LLMEngine.from_engine_args(
            EngineArgs(model=str(model_dir), **{**ENGINE_ARGS, **overrides}))
        eng = AsyncLLMEngine(llm)
        made.append((eng, llm))
        return eng

    yield make
    for eng, llm in made:
        healthy = not eng.errored
        await eng.shutdown()
        if healthy:
            llm.check_integrity()
            assert llm.pool.num_free_blocks == llm.pool.num_blocks, "KV blocks leaked"
            assert not llm.has_unfinished_requests()


@pytest.fixture
async def engine(make_engine: MakeEngine) -> AsyncLLMEngine:
    return make_engine()


@contextlib.asynccontextmanager
async def serving(engine: AsyncLLMEngine, **config: Any) -> AsyncIterator[EngineServer]:
    """A server on an ephemeral loopback port for the block."""
    async with serve_engine(engine, ServerConfig(port=0, **config)) as server:
        yield server


# ------------------------------------------------------------------------ JSON over WS
async def recv(ws: ClientConnection, timeout: float = 20 * UNIT) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def send(ws: ClientConnection, obj: dict[str, Any]) -> None:
    await ws.send(json.dumps(obj))


def generate_msg(rid: str, prompt: str | list[int], max_tokens: int, **params: Any
                 ) -> dict[str, Any]:
    """A greedy `generate` frame (`ignore_eos` unless overridden, so lengths are exact)."""
    body: dict[str, Any] = {"type": "generate", "request_id": rid}
    body["prompt" if isinstance(prompt, str) else "prompt_token_ids"] = prompt
    body["params"] = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **params}
    return body


async def collect_streams(ws: ClientConnection, rids: list[str], timeout: float = 60 * UNIT,
                          ) -> dict[str, tuple[list[int], str, dict[str, Any]]]:
    """Read interleaved events until each of `rids` has its terminal event (done or error);
    returns token ids, text and the terminal event per request. Any other event fails."""
    ids: dict[str, list[int]] = {r: [] for r in rids}
    text = dict.fromkeys(rids, "")
    end: dict[str, dict[str, Any]] = {}
    async with asyncio.timeout(timeout):
        while len(end) < len(rids):
            ev = await recv(ws, timeout)
            rid = ev.get("request_id")
            assert rid in ids and rid not in end, ev
            if ev["type"] == "delta":
                ids[rid] += ev["token_ids"]
                text[rid] += ev["text"]
            elif ev["type"] in ("done", "error"):
                end[rid] = ev
            else:
                raise AssertionError(ev)
    return {r: (ids[r], text[r], end[r]) for r in rids}


# ------------------------------------------------------------------------ plain HTTP
async def http_get(server: EngineServer, path: str) -> tuple[int, str]:
    """(status, body) of a GET on the server's HTTP side (/healthz, /metrics)."""

    def fetch() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(server.http_url + path, timeout=10 * UNIT) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    return await asyncio.to_thread(fetch)


async def metric(server: EngineServer, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    _, body = await http_get(server, "/metrics")
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


# ------------------------------------------------------------------------ misbehaving
def hard_reset(ws: ClientConnection) -> None:
    """Vanish with a TCP RST: no closing handshake, no FIN."""
    sock = ws.transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ws.transport.abort()


def small_rcvbuf_socket(host: str, port: int, size: int = 2048) -> socket.socket:
    """A connected socket with a tiny receive window, so a client that stops reading
    pushes back on the server after a few frames."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
    sock.connect((host, port))
    sock.setblocking(False)
    return sock


def narrow_server_side(server: EngineServer, client_port: int, size: int = 2048) -> None:
    """Shrink the server's kernel send buffer for the client on `client_port`, as a slow
    network path would: what that client does not read then backs up inside the server."""
    for conn in server._connections:
        if conn.ws.remote_address[1] == client_port:
            sock = conn.ws.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            return
    raise AssertionError(f"no server connection from port {client_port}")


# ------------------------------------------------------------------------ raw frames
class RawWebSocket:
    """A hand-driven client connection: lets tests write frames no library would send."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, host: str, port: int, path: str = "/",
                   headers: dict[str, str] | None = None, rcvbuf: int | None = None,
                   ) -> tuple[RawWebSocket, bytes]:
        """Connect and send an upgrade request; returns the socket and the HTTP response head.
        `rcvbuf` shrinks the receive window first (for clients that will stop reading)."""
        if rcvbuf is None:
            reader, writer = await asyncio.open_connection(host, port)
        else:
            sock = small_rcvbuf_socket(host, port, rcvbuf)
            reader, writer = await asyncio.open_connection(sock=sock)
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket",
                 "Connection: Upgrade", f"Sec-WebSocket-Key: {key}",
                 "Sec-WebSocket-Version: 13"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = await read_http_head(reader)
        return cls(reader, writer), head

    @property
    def local_port(self) -> int:
        return int(self.writer.get_extra_info("sockname")[1])

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    def stop_reading(self) -> None:
        """Read nothing more from the socket (the stream reader would otherwise keep
        buffering on its own), so the server's sends back up."""
        self.writer.transport.pause_reading()

    def resume_reading(self) -> None:
        self.writer.transport.resume_reading()

    def send_json(self, obj: dict[str, Any]) -> None:
        self.writer.write(client_frame(0x1, json.dumps(obj).encode()))

    async def read_event(self, timeout: float = 20 * UNIT) -> dict[str, Any]:
        """The next text frame, decoded (fails on anything else)."""
        frame = await asyncio.wait_for(read_frame(self.reader), timeout)
        assert frame is not None and frame[0] == 0x1, frame
        return json.loads(frame[1])

    async def read_until_close(self, timeout: float = 10 * UNIT
                               ) -> tuple[int | None, list[dict[str, Any]]]:
        """Read frames until the server's close frame or EOF: (close code or None on a bare
        EOF, decoded text frames seen before it)."""
        events: list[dict[str, Any]] = []
        async with asyncio.timeout(timeout):
            while True:
                frame = await read_frame(self.reader)
                if frame is None:
                    return None, events
                opcode, payload = frame
                if opcode == 0x8:
                    code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
                    return code, events
                if opcode == 0x1:
                    events.append(json.loads(payload))

    def close(self) -> None:
        self.writer.transport.abort()


async def read_http_head(reader: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10 * UNIT)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        return getattr(exc, "partial", b"")


def client_frame(opcode: int, payload: bytes, *, fin: bool = True, rsv: int = 0,
                 masked: bool = True, length: int | None = None) -> bytes:
    """One client→server frame; every field can be made wrong on purpose."""
    head = bytearray([(0x80 if fin else 0) | (rsv & 0x7) << 4 | (opcode & 0xF)])
    n = len(payload) if length is None else length
    mask_bit = 0x80 if masked else 0
    if n < 126:
        head.append(mask_bit | n)
    elif n < 1 << 16:
        head.append(mask_bit | 126)
        head += struct.pack("!H", n)
    else:
        head.append(mask_bit | 127)
        head += struct.pack("!Q", n)
    if not masked:
        return bytes(head) + payload
    mask = os.urandom(4)
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes(head) + mask + body


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes] | None:
    """One server frame (unmasked) as (opcode, payload); None at EOF or reset."""
    try:
        b0, b1 = await reader.readexactly(2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack("!H", await reader.readexactly(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", await reader.readexactly(8))[0]
        return b0 & 0x0F, await reader.readexactly(n)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout: float = 10 * UNIT,
                     what: str = "condition") -> None:
    """Poll `check` until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------------ figures
@pytest.fixture
def figures(request: pytest.FixtureRequest,
            record_property: Callable[[str, Any], None]) -> Iterator[dict[str, Any]]:
    """A dict the test fills with the figures it measured. They go to the JUnit properties,
    to stdout, and, when $ASYNCENGINE_RELIABILITY_REPORT names a file, into that JSON file
    (keyed by test) for docs/reliability.md."""
    data: dict[str, Any] = {}
    yield data
    for key, value in data.items():
        record_property(key, value)
    print(f"\n[figures] {request.node.name}: {json.dumps(data, sort_keys=True)}")
    path = envs.reliability_report()
    if path and data:
        report = json.loads(path.read_text()) if path.is_file() else {}
        report[request.node.name] = data
        path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
