"""An engine gives its memory back: `shutdown()`, a `with` block or simply dropping an `LLM` or
an `AsyncLLMEngine` frees its KV pool and weights at once (weak references to them die with
the garbage collector switched off, so no reference cycle is needed to free them), and a
second engine can then be built in the same process. The GPU test builds two 7B-shape
engines one after the other."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncengine import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from asyncengine.llm_engine import LLMEngine

PARAMS = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Memory must come back by reference counting alone, not at some later collection."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _tensor_refs(engine: LLMEngine) -> dict[str, weakref.ref[torch.Tensor]]:
    runner = engine.runner
    refs = {name: weakref.ref(p) for name, p in runner.model.named_parameters()}
    assert runner.kv_cache is not None
    refs["kv_cache"] = weakref.ref(runner.kv_cache.data)
    if runner.cpu_cache is not None:
        refs["swap_cache"] = weakref.ref(runner.cpu_cache.data)
    return refs


def _alive(refs: dict[str, weakref.ref[torch.Tensor]]) -> list[str]:
    return [name for name, ref in refs.items() if ref() is not None]


def _make_llm(model_dir: Path) -> LLM:
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=64, preemption_mode="swap")
    llm.generate(["hello world"], PARAMS, use_tqdm=False)
    return llm


def test_dropped_llm_frees_weights_and_kv_pool(tiny_llama_dir: Path, no_gc: None) -> None:
    llm = _make_llm(tiny_llama_dir)
    refs = _tensor_refs(llm.llm_engine)
    assert "swap_cache" in refs and len(refs) > 3
    del llm
    assert _alive(refs) == []


def test_shutdown_frees_while_the_llm_is_still_held(tiny_llama_dir: Path, no_gc: None) -> None:
    llm = _make_llm(tiny_llama_dir)
    refs = _tensor_refs(llm.llm_engine)
    llm.shutdown()
    assert _alive(refs) == []
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["hello"], PARAMS, use_tqdm=False)
    llm.shutdown()  # a second call does nothing


def test_with_block_frees_and_the_next_engine_works(tiny_llama_dir: Path, no_gc: None) -> None:
    with _make_llm(tiny_llama_dir) as llm:
        refs = _tensor_refs(llm.llm_engine)
        first = llm.generate(["the quick brown fox"], PARAMS, use_tqdm=False)
    assert _alive(refs) == []
    with _make_llm(tiny_llama_dir) as again:
        second = again.generate(["the quick brown fox"], PARAMS, use_tqdm=False)
    assert second[0].outputs[0].token_ids == first[0].outputs[0].token_ids


async def _serve_one(engine: AsyncLLMEngine) -> None:
    async for _ in engine.generate("hello world", PARAMS, request_id="r"):
        pass


async def _until_freed(refs: dict[str, weakref.ref[torch.Tensor]]) -> list[str]:
    """The step thread frees a dropped engine when it wakes: give it a moment."""
    for _ in range(200):
        if not _alive(refs):
            break
        await asyncio.sleep(0.01)
    return _alive(refs)


async def test_async_engine_shutdown_and_async_with_free(tiny_llama_dir: Path,
                                                         no_gc: None) -> None:  # fmt: skip
    args = EngineArgs(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    async with AsyncLLMEngine.from_engine_args(args) as engine:
        await _serve_one(engine)
        refs = _tensor_refs(engine.engine)
    assert _alive(refs) == []
    assert not engine.is_running


async def test_dropped_async_engine_frees(tiny_llama_dir: Path, no_gc: None) -> None:
    args = EngineArgs(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    engine = AsyncLLMEngine.from_engine_args(args)
    await _serve_one(engine)
    refs = _tensor_refs(engine.engine)
    thread = engine._thread
    del engine
    assert await _until_freed(refs) == []
    assert thread is not None
    thread.join(timeout=10)
    assert not thread.is_alive()


async def test_dropped_async_engine_that_never_served_frees(tiny_llama_dir: Path,
                                                            no_gc: None) -> None:  # fmt: skip
    args = EngineArgs(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    engine = AsyncLLMEngine.from_engine_args(args)  # its step thread waits for a first request
    refs = _tensor_refs(engine.engine)
    del engine
    assert await _until_freed(refs) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_two_7b_engines_one_after_the_other() -> None:
    """As a new user would: the 7B shape with dummy weights and default settings (90 % of the
    card), built twice in one process, the first given back by `shutdown()` and the second
    by `del`; each time, memory is back to the baseline before the next."""
    from scripts.bench_common import dummy_model_dir

    model = str(dummy_model_dir("llama2-7b"))
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    prompt = [list(range(1, 65))]
    outputs = []
    for how in ("shutdown", "drop"):
        llm = LLM(model, load_format="dummy", skip_tokenizer_init=True)
        held = torch.cuda.memory_allocated() - baseline
        assert held > 100 * 2**30, f"{held / 2**30:.1f} GiB: weights + KV pool expected"
        outputs.append(llm.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids)
        if how == "shutdown":
            llm.shutdown()
        del llm
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated() - baseline
        print(f"{how}: {held / 2**30:.1f} GiB held, {left / 2**30:.2f} GiB left after")
        assert left < 2**30, f"{left / 2**30:.1f} GiB still allocated after {how}"
    assert outputs[0] == outputs[1]
