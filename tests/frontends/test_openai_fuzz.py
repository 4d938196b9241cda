"""Fuzzing the OpenAI-compatible API with malformed bodies and parameter combinations.

Thousands of hypothesis-drawn and mutated bodies (wrong types, out-of-range values, unknown
fields, broken JSON, deep nesting, huge strings, odd content types, random paths and
methods) go to `/v1/completions` and `/v1/chat/completions` from a few concurrent workers,
some streamed, some dropped after the first event, while a control client streams greedy
generations beside them. Every answer must be a success or a 4xx in OpenAI's error shape,
never a 5xx; every stream that starts must end with `data: [DONE]`; the control client's
output must equal offline greedy; afterwards the server still serves and every KV block is
free. The fuzzed engine has a short `max_model_len`, so accepted requests stay cheap.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.llm_engine import LLMEngine
from asyncengine_kernels import envs
from frontends.openai_api import OpenAIConfig, OpenAIServer, serve_openai

from .conftest import UNIT, all_blocks_free, engine_args, offline_greedy

SEED = envs.fuzz_seed()
MODEL = "tiny"
NUM_WORKERS = 6
HYPOTHESIS_BODIES = 1_600
MUTATED_BODIES = 1_600
MIN_BODIES = 3_000
MAX_BODY = 256 * 1024
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

Case = tuple[str, str, bytes]  # (method, path, body)

# ------------------------------------------------------------------- hypothesis bodies
_leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
         | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
_json = st.recursive(
    _leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=8), inner, max_size=4), max_leaves=8)
_sampling = {
    "model": st.sampled_from([MODEL, "other", ""]) | _json,
    "temperature": st.floats(-1.0, 3.0) | st.sampled_from([0, 0.7]) | _json,
    "top_p": st.floats(-0.5, 1.5) | _json, "n": st.integers(-1, 3) | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({}, optional={
        "include_usage": st.booleans() | _json,
        "continuous_usage_stats": st.booleans() | _json}) | _json,
    "stop": st.none() | st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=5) | _json,
    "seed": st.none() | st.integers(-1, 2**64) | _json,
    "presence_penalty": st.floats(-3.0, 3.0) | _json,
    "frequency_penalty": st.floats(-3.0, 3.0) | _json,
    "user": _json, "logit_bias": st.dictionaries(st.text(max_size=3), st.floats()) | _json,
    "top_k": st.integers(-3, 100) | _json, "min_p": st.floats(-1.0, 2.0) | _json,
    "repetition_penalty": st.floats(-1.0, 12.0) | _json, "ignore_eos": st.booleans() | _json,
    "min_tokens": st.integers(-1, 5) | _json,
    "stop_token_ids": st.lists(st.integers(-1, 2**32), max_size=5) | _json,
    "skip_special_tokens": st.booleans() | _json,
    "include_stop_str_in_output": st.booleans() | _json, "bogus": _json,
}
# max_tokens is always drawn: left out, a chat request would generate all the room left.
_max_tokens = st.integers(-1, 4) | st.integers(60, 2**70) | st.sampled_from(["3", 2.5, True])
_prompt = (st.text(max_size=24) | st.lists(st.integers(-2, 600), max_size=6)
           | st.lists(st.text(max_size=8), max_size=3)
           | st.lists(st.lists(st.integers(-1, 600), max_size=3), max_size=3) | _json)
_completion = st.fixed_dictionaries({"max_tokens": _max_tokens}, optional={
    "prompt": _prompt, "logprobs": st.integers(-1, 25) | _json, "echo": st.booleans() | _json,
    "best_of": st.integers(-1, 3) | _json, "suffix": st.text(max_size=3) | _json,
    **_sampling})
_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | _json},
                              optional={"text": st.text(max_size=8) | _json})
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | st.text(max_size=10) | _json},
    optional={"content": st.text(max_size=16) | st.lists(_part, max_size=3) | _json,
              "name": _json})
_chat = st.fixed_dictionaries({"max_tokens": _max_tokens}, optional={
    "messages": st.lists(_message, max_size=3) | _json,
    "max_completion_tokens": _max_tokens, "logprobs": st.booleans() | _json,
    "top_logprobs": st.integers(-1, 25) | _json, "tools": _json, "response_format": _json,
    **_sampling})


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


_cases = st.one_of(
    _completion.map(lambda b: ("POST", COMPLETIONS, _dump(b))),
    _chat.map(lambda b: ("POST", CHAT, _dump(b))),
    _json.map(lambda b: ("POST", st_path_choice(b), _dump(b))),
    st.binary(max_size=48).map(lambda b: ("POST", COMPLETIONS, b)),
    st.text(max_size=48).map(lambda t: ("POST", CHAT, t.encode())),
)


def st_path_choice(obj: Any) -> str:
    return CHAT if len(repr(obj)) % 2 else COMPLETIONS


def hypothesis_cases(n: int) -> list[Case]:
    """About `n` cases drawn by hypothesis (deterministic for a given SEED)."""
    out: list[Case] = []

    @hypothesis_seed(SEED)
    @settings(max_examples=max(1, n // 20), database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.lists(_cases, min_size=15, max_size=25))
    def draw(cases: list[Case]) -> None:
        out.extend(cases)

    draw()
    return out


# ------------------------------------------------------------------- mutated bodies
_WEIRD: list[Any] = [None, True, -1, 0, 2**64, 1e309, -0.0, "", "x" * 300, [], {}, [[[]]],
                     "\u0000", "\ud800", 3.5, [1, "a", None], {"a": {"b": []}}]


class Mutator:
    """Valid bodies of both endpoints, broken on purpose in structure or in text."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def valid(self) -> tuple[str, dict[str, Any]]:
        r = self.rng
        common: dict[str, Any] = {"model": MODEL, "max_tokens": r.randint(1, 3),
                                  "stream": r.random() < 0.5}
        if r.random() < 0.3:
            common.update(temperature=0.7, seed=r.randint(0, 9), top_k=5)
        if r.random() < 0.5:
            return COMPLETIONS, {"prompt": r.choice(["hello", "a b c", [5, 6, 7], ["x", "y"]]),
                                 **common}
        return CHAT, {"messages": [{"role": "user", "content": r.choice(["hi", "a b"])}],
                      **common}

    def cases(self, count: int) -> list[Case]:
        return [self._one() for _ in range(count)]

    def _one(self) -> Case:
        r = self.rng
        path, body = self.valid()
        choice = r.random()
        if choice < 0.08:
            return "POST", path, _dump(body)
        if choice < 0.11:  # another method, or a path that is not there
            return r.choice([("GET", path, b""), ("PUT", path, _dump(body)),
                             ("POST", "/v1/embeddings", _dump(body)),
                             ("POST", "/v1/completions/x", _dump(body))])
        if choice < 0.55:
            return "POST", path, self._structural(body)
        return "POST", path, self._textual(_dump(body))

    def _structural(self, body: dict[str, Any]) -> bytes:
        r = self.rng
        op = r.randrange(7)
        key = r.choice(list(body))
        if op == 0 and key != "max_tokens":  # a wrong type or a bad value
            body[key] = r.choice(_WEIRD)
        elif op == 1 and key != "max_tokens":
            del body[key]
        elif op == 2:
            body[r.choice(["bogus", "Model", "max-tokens", "n", "logprobs", "top_logprobs",
                           "echo", "stream_options", "tools", "best_of"])] = r.choice(_WEIRD)
        elif op == 3:  # deep nesting, as a field or as the whole body
            depth = r.choice([64, 1_000, 20_000])
            blob = "[" * depth + "]" * depth
            if r.random() < 0.5:
                return blob.encode()
            return (json.dumps(body)[:-1] + f', "deep": {blob}}}').encode()
        elif op == 4:  # huge strings
            size = r.choice([5_000, 50_000, 120_000, MAX_BODY + 1])  # the last: 413
            if "messages" in body:
                body["messages"] = [{"role": "user", "content": "z" * size}]
            else:
                body["prompt"] = "y" * size
        elif op == 5:  # many chat messages: the template must not run on the event loop
            body.pop("prompt", None)
            body["messages"] = [{"role": "user", "content": ""}] * r.choice([100, 3_000])
        else:  # another field's value in the wrong place
            body[key] = r.choice([dict(body), [dict(body)], {"stream": body.get("stream")}])
        return _dump(body)

    def _textual(self, data: bytes) -> bytes:
        r = self.rng
        buf = bytearray(data)
        for _ in range(r.randint(1, 3)):
            op = r.randrange(5)
            i = r.randrange(len(buf) + 1)
            if op == 0 and buf:
                buf[min(i, len(buf) - 1)] ^= 1 << r.randrange(8)
            elif op == 1:
                del buf[i:]
            elif op == 2:
                buf[i:i] = r.randbytes(r.randint(1, 8))
            elif op == 3:
                del buf[i:i + r.randint(1, 16)]
            else:
                buf[i:i] = r.choice([b'"', b"{", b"]", b"\\", b",", b"\\u", b"\xc3", b"NaN"])
        return bytes(buf)


# ------------------------------------------------------------------- sending and checking
@dataclasses.dataclass
class Tally:
    by_status: dict[int, int] = dataclasses.field(default_factory=dict)
    streams: int = 0
    dropped: int = 0


def _check_error(status: int, data: bytes, where: str) -> None:
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}, where
    assert err["code"] != "internal_error" and err["message"], where


def _check_events(text: str, where: str) -> None:
    lines = [line for line in text.split("\n\n") if line]
    assert lines and lines[-1] == "data: [DONE]", where
    for line in lines[:-1]:
        assert line.startswith("data: "), where
        chunk = json.loads(line[6:])
        if "error" in chunk:
            assert chunk["error"]["code"] != "internal_error", where
        else:
            assert "choices" in chunk, where


async def send_case(http: httpx2.AsyncClient, case: Case, drop: bool, tally: Tally) -> None:
    method, path, body = case
    where = f"{method} {path} {body[:300]!r}"
    headers = {"content-type": "application/json"}
    async with http.stream(method, path, content=body or None, headers=headers) as r:
        status = r.status_code
        tally.by_status[status] = tally.by_status.get(status, 0) + 1
        assert status < 500, f"{status} for {where}"
        if status != 200:
            _check_error(status, await r.aread(), where)
            return
        if not r.headers["content-type"].startswith("text/event-stream"):
            data = json.loads(await r.aread())
            assert data["choices"] and data["usage"]["completion_tokens"] >= 0, where
            return
        tally.streams += 1
        if drop:  # leave after the first event: the request must be aborted
            async for _ in r.aiter_bytes():
                break
            tally.dropped += 1
            return
        _check_events((await r.aread()).decode(), where)


async def worker(http: httpx2.AsyncClient, cases: list[Case], seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    for case in cases:
        await send_case(http, case, rng.random() < 0.15, tally)


async def control_client(url: str, stop: asyncio.Event, prompts: list[str],
                         expected: list[str]) -> int:
    """Stream greedy generations until `stop`; each must equal the offline oracle."""
    rounds = 0
    async with httpx2.AsyncClient(base_url=url, timeout=60 * UNIT) as http:
        while not stop.is_set() or rounds == 0:
            i = rounds % len(prompts)
            body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 12, "temperature": 0,
                    "stream": True}
            async with http.stream("POST", COMPLETIONS, json=body) as r:
                assert r.status_code == 200
                text = ""
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            assert text == expected[i], f"control stream {rounds} diverged"
            rounds += 1
            await asyncio.sleep(0.2)  # paced, so the fuzzing is not starved
    return rounds


@pytest.fixture
async def fuzz_engine(model_dir: Path) -> AsyncIterator[AsyncLLMEngine]:
    llm = LLMEngine.from_engine_args(engine_args(model_dir, max_model_len=48))
    engine = AsyncLLMEngine(llm)
    yield engine
    await engine.shutdown()
    llm.check_integrity()
    assert llm.pool.num_free_blocks == llm.pool.num_blocks


@pytest.mark.slow
async def test_thousands_of_malformed_bodies_get_4xx_and_leak_nothing(
        fuzz_engine: AsyncLLMEngine, model_dir: Path) -> None:
    drawn = hypothesis_cases(HYPOTHESIS_BODIES)
    # Hypothesis may stop short of its example budget; mutated bodies make up the count.
    cases = drawn + Mutator(SEED).cases(max(MUTATED_BODIES, MIN_BODIES - len(drawn)))
    random.Random(SEED).shuffle(cases)
    prompts = ["The quick brown fox", "Once upon a time"]
    expected = [e.text for e in offline_greedy(model_dir, prompts, max_tokens=12)]
    config = OpenAIConfig(port=0, served_model_name=MODEL, max_body_size=MAX_BODY)
    tally = Tally()
    async with serve_openai(fuzz_engine, config) as server:
        stop = asyncio.Event()
        control = asyncio.create_task(control_client(server.url, stop, prompts, expected))
        limits = httpx2.Limits(max_connections=NUM_WORKERS * 2)
        async with httpx2.AsyncClient(base_url=server.url, timeout=60 * UNIT,
                                      limits=limits) as http:
            await asyncio.gather(*(worker(http, cases[w::NUM_WORKERS], SEED + w, tally)
                                   for w in range(NUM_WORKERS)))
            stop.set()
            rounds = await asyncio.wait_for(control, 60 * UNIT)
            await _still_serves(server, http)
            assert _rejected(await http.get("/metrics")).get("internal_error", 0) == 0
        await all_blocks_free(fuzz_engine, timeout=30 * UNIT)
    assert sum(tally.by_status.values()) == len(cases) >= MIN_BODIES
    assert rounds >= 2 and tally.by_status.get(200, 0) > 50 and tally.dropped > 5
    assert tally.by_status.get(400, 0) > 1_000


async def _still_serves(server: OpenAIServer, http: httpx2.AsyncClient) -> None:
    r = await http.post(COMPLETIONS, json={"model": MODEL, "prompt": "still serving",
                                           "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def _rejected(response: httpx2.Response) -> dict[str, float]:
    return {s.labels["code"]: s.value for f in text_string_to_metric_families(response.text)
            if f.name == "asyncengine_http_requests_rejected" for s in f.samples
            if s.name.endswith("_total")}
