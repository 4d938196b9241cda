"""Fixtures for the frontend tests: the tiny model behind an async engine and a server on
port 0. Every timeout is a multiple of `UNIT`; every test ends with the KV pool checked."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.config import EngineArgs
from asyncengine.llm_engine import LLMEngine
from asyncengine.outputs import CompletionOutput
from asyncengine.sampling_params import SamplingParams
from frontends.server import EngineServer, ServerConfig, serve_engine

UNIT = 1.0  # seconds

ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=16,
    max_num_seqs=64, enforce_eager=True, seed=0,
)


def engine_args(model_dir: Path, **overrides: Any) -> EngineArgs:
    return EngineArgs(model=str(model_dir), **{**ENGINE_ARGS, **overrides})


@functools.cache
def _offline_llm(model_dir: str) -> Any:
    from asyncengine.llm import LLM

    return LLM(model_dir, **ENGINE_ARGS)


def offline_greedy(model_dir: Path, prompts: list[str], max_tokens: int,
                   **params: Any) -> list[Any]:
    """The offline engine's greedy outputs (the oracle for streamed results)."""
    llm = _offline_llm(str(model_dir))
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [_Expected(o.prompt_token_ids, o.outputs[0]) for o in outs]


class _Expected:
    def __init__(self, prompt_token_ids: list[int], c: CompletionOutput) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.text = c.text
        self.token_ids = c.token_ids
        self.finish_reason = c.finish_reason


async def wait_idle(engine: AsyncLLMEngine, timeout: float = 10 * UNIT) -> None:
    """Wait until the engine holds no request (finished or aborted)."""

    def idle(e: LLMEngine) -> bool:
        return not e.has_unfinished_requests()

    deadline = asyncio.get_running_loop().time() + timeout
    while not await engine.run_in_engine_thread(idle):
        assert asyncio.get_running_loop().time() < deadline, "engine did not go idle"
        await asyncio.sleep(0.02)


async def all_blocks_free(engine: AsyncLLMEngine, timeout: float = 10 * UNIT) -> None:
    """Wait until the engine is idle, then assert the pool is whole and entirely free."""
    await wait_idle(engine, timeout)

    def check(e: LLMEngine) -> tuple[int, int]:
        e.check_integrity()
        return e.pool.num_free_blocks, e.pool.num_blocks

    free, total = await engine.run_in_engine_thread(check)
    assert free == total


@pytest.fixture
def model_dir(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir


@pytest.fixture
def llm_engine(model_dir: Path) -> LLMEngine:
    return LLMEngine.from_engine_args(engine_args(model_dir))


@pytest.fixture
async def engine(llm_engine: LLMEngine) -> AsyncIterator[AsyncLLMEngine]:
    eng = AsyncLLMEngine(llm_engine)
    yield eng
    healthy = not eng.errored
    await eng.shutdown()
    if healthy:  # no test may leak blocks
        llm_engine.check_integrity()
        assert llm_engine.pool.num_free_blocks == llm_engine.pool.num_blocks


@pytest.fixture
async def server(engine: AsyncLLMEngine) -> AsyncIterator[EngineServer]:
    async with serve_engine(engine, ServerConfig(port=0)) as srv:
        yield srv
