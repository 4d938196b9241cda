"""Protocol fuzzing against a live server.

Over ten thousand hypothesis-generated and mutated client messages (random text and bytes,
deep nesting, huge strings, wrong types, binary frames, unknown types, duplicate and unknown
request ids, cancels of finished requests) go over a few connections while a control client
streams greedy generations next to them. Every message must get its defined answer (an
`error` event, or the stream / `done` a valid message asks for) before the next one; frames
that break the WebSocket protocol itself must end their connection with a defined close code.
The server must stay up, the control client's output must equal offline greedy, and the
engine must end with every KV block free.

How answers are matched: after each fuzz message the client sends a marker (a `cancel` of a
request id nobody uses); the server handles a connection's messages in order, so everything
it answers between two markers' `not_found` errors belongs to the message in between, apart
from the events of streams already running, which are routed by request id.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.errors import ErrorCode
from asyncengine_kernels import envs
from frontends import protocol as p
from frontends.server import EngineServer

from .conftest import (
    UNIT,
    RawWebSocket,
    assert_clean,
    client_frame,
    eventually,
    generate_msg,
    offline_greedy,
    read_http_head,
    recv,
    send,
    serving,
)

SEED = envs.fuzz_seed()
MIN_MESSAGES = 10_000
TARGET_MESSAGES = 10_400
MAX_SIZE = 256 * 1024  # the fuzzed server's frame limit
NUM_CONNECTIONS = 4
MARK = "\u2063mark"  # request ids of the markers; no fuzz message uses this prefix

Frame = tuple[bool, str | bytes]  # (binary?, payload)

# ------------------------------------------------------------------- hypothesis messages
_leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
         | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
_json = st.recursive(
    _leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=8), inner, max_size=4), max_leaves=8)
_rid = (st.text(min_size=1, max_size=8) | st.sampled_from(["a", "b", "dup", "x"])
        | st.just("") | st.text(min_size=257, max_size=260) | _json)
_params = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(-1, 4) | st.integers(5, 2**22) | _json,
    "min_tokens": st.integers(-1, 3) | _json,
    "temperature": st.floats(-1.0, 120.0) | st.sampled_from([0.0, 0.7]) | _json,
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-3, 2**21),
    "min_p": st.floats(-1.0, 2.0), "repetition_penalty": st.floats(-1.0, 12.0),
    "presence_penalty": st.floats(-3.0, 3.0), "frequency_penalty": st.floats(-3.0, 3.0),
    "seed": st.none() | st.integers(-1, 2**64),
    "stop": st.none() | st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=20),
    "stop_token_ids": st.lists(st.integers(-1, 2**32), max_size=70),
    "ignore_eos": st.booleans() | _json, "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "bogus": _json,
})
_chat = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | st.text(max_size=40),
     "content": st.text(max_size=24)}, optional={"name": _json}), max_size=4)
_generate = st.fixed_dictionaries({"type": st.just("generate"), "request_id": _rid}, optional={
    "prompt": st.text(max_size=32) | _json,
    "messages": _chat | _json,
    "prompt_token_ids": st.lists(st.integers(-2, 600), max_size=8) | _json,
    "params": _params | _json,
    "extra": _json,
})
_cancel = st.fixed_dictionaries({"type": st.just("cancel"), "request_id": _rid},
                                optional={"extra": _json})
_subscribe = st.fixed_dictionaries({"type": st.just("stats.subscribe")},
                                   optional={"interval": st.floats(-1.0, 5000.0) | _json})
_unsubscribe = st.fixed_dictionaries({"type": st.just("stats.unsubscribe")},
                                     optional={"request_id": _rid})
_unknown = st.fixed_dictionaries({"type": st.text(max_size=16) | _json},
                                 optional={"request_id": _rid, "prompt": _json})
_valid_generate = st.fixed_dictionaries({
    "type": st.just("generate"), "request_id": st.sampled_from(["a", "b", "dup"]) | st.text(
        min_size=1, max_size=8), "prompt": st.text(min_size=1, max_size=20),
    "params": st.fixed_dictionaries({"max_tokens": st.integers(1, 4)}, optional={
        "temperature": st.floats(0.0, 2.0), "top_k": st.integers(-1, 50),
        "top_p": st.floats(0.01, 1.0), "seed": st.integers(0, 1000),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3)}),
})
_objects = st.one_of(_generate, _valid_generate, _cancel, _subscribe, _unsubscribe, _unknown,
                     _json)


def _text(obj: Any) -> Frame:
    return False, json.dumps(obj, allow_nan=True)


def _binary(obj: Any) -> Frame:
    return True, json.dumps(obj, allow_nan=True).encode()


_frames = st.one_of(
    _objects.map(_text), _objects.map(_text), _objects.map(_text),
    _objects.map(_binary),
    st.text(max_size=48).map(lambda s: (False, s)),
    st.binary(max_size=48).map(lambda b: (True, b)),
)


def hypothesis_frames(n: int) -> list[Frame]:
    """About `n` frames drawn by hypothesis (deterministic for a given SEED); drawn as
    lists, which costs far less per frame than one example each."""
    out: list[Frame] = []

    @hypothesis_seed(SEED)
    @settings(max_examples=max(1, n // 22), database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.lists(_frames, min_size=15, max_size=30))
    def draw(frames: list[Frame]) -> None:
        out.extend(frames)

    draw()
    return out


# ------------------------------------------------------------------- mutated messages
_WEIRD: list[Any] = [None, True, -1, 0, 2**64, 1e309, -0.0, "", "x" * 300, [], {}, [[[]]],
                     {"type": "generate"}, "\u0000", "\ud800", "\u202e", 3.5, [1, "a", None]]
_NEAR_TYPES = ["generat", "GENERATE", "generate ", "cancel\u0000", "stats", "stats.Subscribe",
               "", "delta", "done", "error", "stats.unsubscribe.x", "generate\n"]


class Mutator:
    """Valid messages of every kind, broken on purpose in structure, in text or in sequence.

    Also emits the sequence cases: duplicate request ids in flight, cancels of finished and
    of unknown requests, and a few valid cheap generations to be cancelled or not."""

    def __init__(self, seed: int, tag: str) -> None:
        self.rng = random.Random(seed)
        self.tag = tag
        self.n = 0
        self.sent: list[str] = []  # request ids of valid generations sent so far

    def valid(self) -> dict[str, Any]:
        r = self.rng
        self.n += 1
        rid = f"{self.tag}-{self.n}"
        kind = r.randrange(6)
        if kind == 0:
            prompt = r.choice(["hello world", "a b c", "Paris is"])
            return generate_msg(rid, prompt, r.randint(1, 3))
        if kind == 1:
            return {"type": "generate", "request_id": rid,
                    "messages": [{"role": "user", "content": "hi"}],
                    "params": {"max_tokens": r.randint(1, 3), "temperature": 0.7, "seed": 1}}
        if kind == 2:
            return generate_msg(rid, [r.randrange(512) for _ in range(r.randint(1, 6))], 2)
        if kind == 3:
            return {"type": "cancel", "request_id": r.choice(self.sent or [rid])}
        if kind == 4:
            return {"type": "stats.subscribe", "interval": r.choice([0.05, 1.0, 60.0])}
        return {"type": "stats.unsubscribe"}

    def frames(self, count: int) -> list[Frame]:
        out: list[Frame] = []
        while len(out) < count:
            out += self._one()
        return out[:count]

    def _one(self) -> list[Frame]:
        r = self.rng
        msg = self.valid()
        choice = r.random()
        if choice < 0.06:  # sent as it is: cheap real work, remembered for later cancels
            if msg["type"] == "generate":
                self.sent.append(msg["request_id"])
            return [_text(msg)]
        if choice < 0.09 and msg["type"] == "generate":  # the same id twice in a row
            msg["params"] = {**msg.get("params", {}), "max_tokens": 4}
            self.sent.append(msg["request_id"])
            return [_text(msg), _text(msg)]
        if choice < 0.12:  # cancels of requests that finished or never existed
            rid = r.choice(self.sent) if self.sent and r.random() < 0.7 else f"nope-{r.random()}"
            return [_text({"type": "cancel", "request_id": rid})]
        if choice < 0.45:
            return [self._structural(msg)]
        return [self._textual(msg)]

    def _structural(self, msg: dict[str, Any]) -> Frame:
        r = self.rng
        op = r.randrange(9)
        target = msg
        if "params" in msg and r.random() < 0.5:
            target = msg["params"]
        keys = list(target)
        if op == 0 and keys:  # a wrong type or a bad value
            target[r.choice(keys)] = r.choice(_WEIRD)
        elif op == 1 and keys:
            del target[r.choice(keys)]
        elif op == 2:
            target[r.choice(["bogus", "Type", "request-id", "params "])] = r.choice(_WEIRD)
        elif op == 3:  # deep nesting, as a field or as the whole message
            depth = r.choice([64, 1_000, 20_000, 100_000])
            blob = "[" * depth + "]" * depth
            if r.random() < 0.5:
                return False, blob
            return False, json.dumps(msg)[:-1] + f', "deep": {blob}}}'
        elif op == 4:
            msg["type"] = r.choice(_NEAR_TYPES)
        elif op == 5:
            msg["request_id"] = r.choice(_WEIRD)
        elif op == 6:  # huge strings, kept under the frame limit
            size = r.choice([5_000, 50_000, 120_000])
            field = r.choice(["prompt", "request_id", "type", "messages", "stop"])
            if field == "messages":
                msg[field] = [{"role": "user", "content": "z" * size}]
            elif field == "stop":
                msg.setdefault("params", {})["stop"] = ["s" * size]
            else:
                msg[field] = "y" * size
        elif op == 7:  # many chat messages: the template must not run on the event loop
            msg["messages"] = [{"role": "user", "content": ""}] * r.choice([100, 3_000])
            msg.pop("prompt", None)
            msg.pop("prompt_token_ids", None)
        else:  # as a binary frame
            return _binary(msg)
        return _text(msg)

    def _textual(self, msg: dict[str, Any]) -> Frame:
        r = self.rng
        data = bytearray(json.dumps(msg).encode())
        for _ in range(r.randint(1, 3)):
            op = r.randrange(6)
            i = r.randrange(len(data) + 1)
            if op == 0 and data:
                data[min(i, len(data) - 1)] ^= 1 << r.randrange(8)
            elif op == 1:
                del data[i:]
            elif op == 2:
                data[i:i] = r.randbytes(r.randint(1, 8))
            elif op == 3:
                del data[i:i + r.randint(1, 16)]
            elif op == 4:
                data[i:i] = data[i:i + r.randint(1, 32)]
            else:
                data[i:i] = r.choice([b'"', b"{", b"]", b"\\", b",", b"\\u", b"\xc3", b"NaN"])
        try:
            return False, data.decode()  # valid UTF-8 goes as text
        except UnicodeDecodeError:
            return True, bytes(data)  # invalid UTF-8 as text would close the connection


# ------------------------------------------------------------------- one fuzz connection
@dataclasses.dataclass
class _Stream:
    rid: str
    tokens: list[int] = dataclasses.field(default_factory=list)
    end: dict[str, Any] | None = None


@dataclasses.dataclass
class FuzzTally:
    messages: int = 0
    errors: int = 0
    accepted_streams: int = 0
    codes: dict[str, int] = dataclasses.field(default_factory=dict)


def _expectation(frame: Frame) -> Any:
    """What the server must make of the frame, from the protocol's own decoder: an `Error`
    to send, or the decoded message (whose answer depends on the connection's state)."""
    binary, payload = frame
    if binary:
        return p.Error(code=ErrorCode.INVALID_REQUEST, message="binary")
    return p.decode_client_message(payload)


async def fuzz_connection(url: str, frames: list[Frame], tag: str, tally: FuzzTally) -> None:
    """Send `frames` with a marker after each; check every answer; end with no open stream."""
    async with connect(url, max_size=None, compression=None) as ws:
        reader = asyncio.create_task(_check_answers(ws, frames, tag, tally))
        try:
            for k, (binary, payload) in enumerate(frames):
                if reader.done():
                    break
                if binary:
                    await ws.send(payload if isinstance(payload, bytes) else payload.encode())
                else:
                    await ws.send(payload, text=True)
                await send(ws, {"type": "cancel", "request_id": f"{MARK}{tag}.{k}"})
            await asyncio.wait_for(asyncio.shield(reader), 120 * UNIT)
        finally:
            reader.cancel()
        reader.result()


async def _check_answers(ws: ClientConnection, frames: list[Frame], tag: str,
                         tally: FuzzTally) -> None:
    """Read the connection's events; check each message's answer, window by window."""
    streams: dict[str, _Stream] = {}
    accepted: list[_Stream] = []
    history: collections.deque[str] = collections.deque(maxlen=400)  # for failure messages

    def route(ev: dict[str, Any], window_rid: str | None) -> bool:
        """Deliver a stream event; False when it is not one (it belongs to the window)."""
        rid, kind = ev.get("request_id"), ev["type"]
        st_ = streams.get(rid) if isinstance(rid, str) else None
        if kind in ("delta", "done"):
            assert st_ is not None and st_.end is None, \
                f"{tag}: event of no open stream: {ev}; recently:\n" + "\n".join(history)
            if kind == "delta":
                st_.tokens += ev["token_ids"]
            else:
                st_.end = ev
                assert ev["usage"]["completion_tokens"] == len(st_.tokens), ev  # none lost
            return True
        if kind == "error" and st_ is not None and st_.end is None and rid != window_rid \
                and st_.tokens:
            st_.end = ev  # a running stream failed
            return True
        return False

    for k, frame in enumerate(frames):
        expect = _expectation(frame)
        rid = getattr(expect, "request_id", None)  # an Error's is the id it will echo
        candidate: _Stream | None = None
        was_open = isinstance(rid, str) and rid in streams and streams[rid].end is None
        if isinstance(expect, p.Generate) and not was_open:
            candidate = streams[expect.request_id] = _Stream(expect.request_id)
        errors: list[dict[str, Any]] = []
        ended_here: set[str] = set()
        marker = f"{MARK}{tag}.{k}"
        history.append(f"message {k}: {frame!r:.160}")
        while True:
            try:
                ev = await recv(ws, 60 * UNIT)
            except ConnectionClosed as exc:
                raise AssertionError(f"{tag}: connection closed at message {k}: "
                                     f"{frame!r:.200}") from exc
            if ev["type"] == "stats":
                continue
            history.append(f"  window {k}: {ev}")
            if ev["type"] == "error" and ev.get("request_id") == marker:
                assert ev["code"] == ErrorCode.NOT_FOUND, ev
                break
            before = {r for r, s in streams.items() if s.end is None}
            if route(ev, rid):
                ended_here |= before - {r for r, s in streams.items() if s.end is None}
                if isinstance(expect, p.Generate) and was_open and rid in ended_here \
                        and candidate is None:
                    # the old stream ended just before this generate reused its id
                    candidate = streams[rid] = _Stream(rid)
                continue
            errors.append(ev)
        tally.messages += 1
        for e in errors:
            assert e["code"] != ErrorCode.INTERNAL_ERROR, (
                f"{tag}: server bug on {frame!r:.300}: {e}")
            tally.errors += 1
            tally.codes[e["code"]] = tally.codes.get(e["code"], 0) + 1
        where = f"{tag} message {k} {frame!r:.300}: answers {errors}"
        if isinstance(expect, p.Error):
            assert len(errors) == 1 and errors[0]["code"] == expect.code, where
        elif isinstance(expect, p.Generate):
            assert len(errors) <= 1, where
            if errors:
                assert errors[0]["request_id"] == rid, where
                if candidate is not None and not candidate.tokens and candidate.end is None:
                    del streams[rid]
            elif candidate is not None:
                accepted.append(candidate)
            else:
                raise AssertionError(f"no answer to a duplicate id: {where}")
        elif isinstance(expect, p.Cancel):
            cancelled = rid in ended_here and streams[rid].end is not None \
                and streams[rid].end.get("finish_reason") == "abort"
            assert (not errors and cancelled) or (
                len(errors) == 1 and errors[0]["code"] == ErrorCode.NOT_FOUND
                and errors[0]["request_id"] == rid), where
        else:  # stats.subscribe / stats.unsubscribe: no error, nothing else owed
            assert not errors, where

    # Every accepted stream ends exactly once: cancel what still runs and wait.
    for s in list(streams.values()):
        if s.end is None:
            await send(ws, {"type": "cancel", "request_id": s.rid})
    await send(ws, {"type": "stats.unsubscribe"})
    async with asyncio.timeout(60 * UNIT):
        while any(s.end is None for s in streams.values()):
            ev = await recv(ws)
            if ev["type"] == "stats" or (
                ev["type"] == "error" and ev["code"] == ErrorCode.NOT_FOUND
            ):
                continue  # a cancel that crossed the stream's own end
            assert route(ev, None), ev
    assert all(s.end is not None for s in accepted)
    tally.accepted_streams += len(accepted)


# ------------------------------------------------------------------- the control client
async def control_client(url: str, stop: asyncio.Event, expected: list[tuple[list[int], str]],
                         prompts: list[str], max_tokens: int) -> int:
    """Stream greedy generations until `stop`; each must equal the offline oracle."""
    rounds = 0
    async with connect(url) as ws:
        while not stop.is_set() or rounds == 0:
            i = rounds % len(prompts)
            rid = f"control-{rounds}"
            await send(ws, generate_msg(rid, prompts[i], max_tokens))
            tokens: list[int] = []
            text = ""
            while (ev := await recv(ws, 60 * UNIT))["type"] == "delta":
                tokens += ev["token_ids"]
                text += ev["text"]
            assert ev["type"] == "done" and ev["request_id"] == rid, ev
            assert (tokens, text) == expected[i], f"control stream {rounds} diverged"
            rounds += 1
            # Paced, so the fuzzing is not starved of the GIL by back-to-back steps.
            await asyncio.sleep(0.2)
    return rounds


# ------------------------------------------------------------------- the tests
async def test_ten_thousand_fuzzed_messages_each_get_an_answer(
    engine: AsyncLLMEngine, model_dir: Any, figures: dict[str, Any]
) -> None:
    hyp = hypothesis_frames(4_000)
    n_mut = -(-(TARGET_MESSAGES - len(hyp)) // NUM_CONNECTIONS)  # the rest, mutated
    corpora: list[list[Frame]] = [[] for _ in range(NUM_CONNECTIONS)]
    for i, frame in enumerate(hyp):
        corpora[i % NUM_CONNECTIONS].append(frame)
    for c in range(NUM_CONNECTIONS):
        corpora[c] += Mutator(SEED + c, f"m{c}").frames(n_mut)
        random.Random(SEED - c).shuffle(corpora[c])
    prompts = ["The quick brown fox", "Once upon a time", "hello world"]
    expected = offline_greedy(model_dir, prompts, max_tokens=24)  # type: ignore[arg-type]

    tally = FuzzTally()
    async with serving(engine, max_size=MAX_SIZE) as server:
        stop = asyncio.Event()
        control = asyncio.create_task(
            control_client(server.url, stop, expected, prompts, max_tokens=24))
        await asyncio.gather(*(fuzz_connection(server.url, corpora[c], f"c{c}", tally)
                               for c in range(NUM_CONNECTIONS)))
        stop.set()
        rounds = await asyncio.wait_for(control, 60 * UNIT)
        await _server_still_serves(server)
        await assert_clean(engine)
    assert tally.messages == sum(len(c) for c in corpora) >= MIN_MESSAGES
    assert rounds >= 2
    figures.update(generated_tokens=engine.stats().generation_tokens_total,
                   messages_fuzzed=tally.messages, error_events=tally.errors,
                   accepted_streams=tally.accepted_streams, control_generations=rounds,
                   error_codes=tally.codes, hypothesis_messages=len(hyp))


async def _server_still_serves(server: EngineServer) -> None:
    async with connect(server.url) as ws:
        await send(ws, generate_msg("after", "still serving", 4))
        events = [await recv(ws) for _ in range(2)]
        while events[-1]["type"] == "delta":
            events.append(await recv(ws))
        assert events[-1]["type"] == "done"
        assert sum(len(e.get("token_ids", [])) for e in events) == 4


# Frames that break the WebSocket protocol: the connection ends with this close code.
def _protocol_cases(rng: random.Random) -> list[tuple[str, bytes, set[int | None]]]:
    text = b'{"type": "stats.unsubscribe"}'
    cases: list[tuple[str, bytes, set[int | None]]] = []
    for bad in (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"ok\xe2\x82"):
        cases.append(("invalid UTF-8 text", client_frame(0x1, b'{"type": "' + bad + b'"}'),
                      {1007}))
    cases.append(("oversize header", client_frame(0x1, b"", length=MAX_SIZE + 1), {1009}))
    cases.append(("oversize fragments", client_frame(0x1, b"a" * 200_000, fin=False)
                  + client_frame(0x0, b"a" * 200_000), {1009}))
    for opcode in (0x3, 0x4, 0x5, 0x6, 0x7, 0xB, 0xC, 0xD, 0xE, 0xF):
        cases.append((f"reserved opcode {opcode:#x}", client_frame(opcode, text), {1002}))
    for rsv in (1, 2, 4):
        cases.append((f"rsv bits {rsv}", client_frame(0x1, text, rsv=rsv), {1002}))
    cases.append(("unmasked", client_frame(0x1, text, masked=False), {1002}))
    cases.append(("fragmented ping", client_frame(0x9, b"x", fin=False), {1002}))
    cases.append(("long ping", client_frame(0x9, b"x" * 126), {1002}))
    cases.append(("orphan continuation", client_frame(0x0, text), {1002}))
    cases.append(("text inside fragments", client_frame(0x1, b"{", fin=False)
                  + client_frame(0x1, text), {1002}))
    for code in (0, 999, 1004, 1005, 1006, 1015, 2999, 5000):
        cases.append((f"close code {code}", client_frame(0x8, code.to_bytes(2, "big")), {1002}))
    cases.append(("one-byte close", client_frame(0x8, b"\x03"), {1002}))
    cases.append(("close reason not UTF-8", client_frame(0x8, b"\x03\xe8\xff\xfe"), {1007}))
    for i in range(200):  # random bytes after the handshake, then EOF
        garbage = rng.randbytes(rng.randint(1, 64))
        cases.append((f"garbage {i}", garbage, {1002, 1007, 1009, None}))
    return cases


async def test_protocol_breaking_frames_get_defined_close_codes(
    engine: AsyncLLMEngine, figures: dict[str, Any]
) -> None:
    rng = random.Random(SEED)
    cases = _protocol_cases(rng)
    seen: dict[str, int] = {}
    async with serving(engine, max_size=MAX_SIZE) as server:
        limit = asyncio.Semaphore(8)

        async def run(name: str, data: bytes, allowed: set[int | None]) -> None:
            async with limit:
                ws, head = await RawWebSocket.open(server.host, server.port)
                assert head.startswith(b"HTTP/1.1 101"), head
                ws.write(data)
                if None in allowed:
                    ws.writer.write_eof()  # random bytes may announce more than they hold
                code, events = await ws.read_until_close()
                ws.close()
                assert code in allowed, f"{name}: close code {code}, events {events}"
                assert all(e["type"] == "error" for e in events), (name, events)
                key = "eof" if code is None else str(code)
                seen[key] = seen.get(key, 0) + 1

        async def garbage_handshake(i: int) -> None:
            async with limit:
                reader, writer = await asyncio.open_connection(server.host, server.port)
                writer.write(rng.randbytes(rng.randint(1, 200)) + b"\r\n\r\n")
                writer.write_eof()
                head = await read_http_head(reader)
                writer.transport.abort()
                assert head == b"" or head.startswith(b"HTTP/1.1 4"), head
                seen["http_4xx_or_eof"] = seen.get("http_4xx_or_eof", 0) + 1

        await asyncio.gather(*(run(*c) for c in cases),
                             *(garbage_handshake(i) for i in range(50)))
        # The library's own oversize path, and the server still serves afterwards.
        async with connect(server.url, max_size=None) as ws:
            await ws.send("x" * (MAX_SIZE + 1))
            with pytest.raises(ConnectionClosed):
                await recv(ws)
            assert ws.close_code == 1009
        await _server_still_serves(server)
        await eventually(lambda: not server._connections, what="connections to unwind")
    await assert_clean(engine)
    figures.update(protocol_frames=len(cases) + 51, close_codes=seen)

