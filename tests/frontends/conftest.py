"""Fixtures for the frontend tests: engines, servers on port 0, and a time unit."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams
from asyncengine.stats import EngineStats
from frontends.server import ServerConfig, serve_engine

UNIT = 1.0  # seconds; every timeout in these tests is a multiple of it


class _Tok:
    eos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [1 + (ord(c) % 200) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(96 + (i % 26)) for i in ids)


@dataclasses.dataclass
class _Cfg:
    max_model_len: int = 128
    model_name: str = "fake"
    vocab_size: int = 256


class _Pool:
    def __init__(self, n: int, bs: int) -> None:
        self.num_blocks = n
        self.block_size = bs
        self.num_free_blocks = n


class _Sched:
    def __init__(self) -> None:
        self.block_pool = _Pool(64, 4)


@dataclasses.dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    out: list[int] = dataclasses.field(default_factory=list)
    blocks: int = 0
    sent: int = 0


class FakeLLMEngine:
    """Deterministic stand-in: token i+1 follows token i; each request holds blocks."""

    def __init__(self, step_time: float = 0.001) -> None:
        self.tokenizer = _Tok()
        self.model_config = _Cfg()
        self.scheduler = _Sched()
        self.step_time = step_time
        self.reqs: dict[str, _Req] = {}
        self.fail_next_step = False

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    *, prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None) -> None:
        if request_id in self.reqs:
            raise ValueError("duplicate")
        ids = prompt_token_ids or self.tokenizer.encode(prompt)
        params = params or SamplingParams()
        if len(ids) + (params.max_tokens or 0) > self.model_config.max_model_len:
            raise ValueError("exceeds max_model_len")
        pool = self.scheduler.block_pool
        need = -(-(len(ids) + (params.max_tokens or 0)) // pool.block_size)
        if need > pool.num_free_blocks:
            raise ValueError("not enough KV blocks")
        pool.num_free_blocks -= need
        self.reqs[request_id] = _Req(request_id, list(ids), params, blocks=need)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode("".join(f"<{m['role']}>{m['content']}" for m in messages))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self._free(rid)

    def _free(self, rid: str) -> None:
        r = self.reqs.pop(rid, None)
        if r is not None:
            self.scheduler.block_pool.num_free_blocks += r.blocks

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_time)
        if self.fail_next_step:
            self.fail_next_step = False
            ids = list(self.reqs)
            for rid in ids:
                self._free(rid)
            exc = RuntimeError("boom")
            exc.request_ids = ids  # type: ignore[attr-defined]
            raise exc
        outs = []
        for r in list(self.reqs.values()):
            last = (r.out or r.prompt)[-1]
            r.out.append((last + 1) % self.model_config.vocab_size)
            done = len(r.out) >= (r.params.max_tokens or 16)
            kind = r.params.output_kind
            if kind == RequestOutputKind.FINAL_ONLY and not done:
                continue
            ids = r.out[r.sent:] if kind == RequestOutputKind.DELTA else list(r.out)
            r.sent = len(r.out)
            outs.append(RequestOutput(r.rid, None, r.prompt, [CompletionOutput(
                0, self.tokenizer.decode(ids), ids, "length" if done else None)], done))
            if done:
                self._free(r.rid)
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.reqs)

    def get_stats(self) -> EngineStats:
        pool = self.scheduler.block_pool
        return EngineStats(timestamp=time.time(), num_running=len(self.reqs),
                           kv_blocks_total=pool.num_blocks, kv_block_size=pool.block_size,
                           kv_blocks_used=pool.num_blocks - pool.num_free_blocks, model="fake")

    def check_integrity(self) -> None:
        pool = self.scheduler.block_pool
        assert pool.num_free_blocks + sum(r.blocks for r in self.reqs.values()) == pool.num_blocks


@pytest.fixture
def unit() -> float:
    return UNIT


@pytest.fixture
async def engine() -> AsyncIterator[AsyncLLMEngine]:
    eng = AsyncLLMEngine(FakeLLMEngine())  # type: ignore[arg-type]
    yield eng
    await eng.shutdown()


@pytest.fixture
async def server(engine: AsyncLLMEngine) -> AsyncIterator[Any]:
    async with serve_engine(engine, ServerConfig(port=0)) as srv:
        yield srv
