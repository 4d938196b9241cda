"""AsyncLLMEngine with the tiny model: streaming kinds, aborts, mailbox merging, failures."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncengine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestFailedError,
    RequestOutputCollector,
)
from asyncengine.config import EngineArgs
from asyncengine.errors import (
    DuplicateRequestIdError,
    ErrorCode,
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
)
from asyncengine.llm import LLM
from asyncengine.llm_engine import LLMEngine, StepError
from asyncengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from asyncengine.request_check import QueueLimits
from asyncengine.sampling_params import RequestOutputKind, SamplingParams
from asyncengine.stat_loggers import StatLoggerBase
from asyncengine.stats_collect import percentiles

UNIT = 1.0
ARGS: dict[str, Any] = dict(device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64,
                            block_size=16, max_num_seqs=32, enforce_eager=True, seed=0)


def greedy(max_tokens: int, kind: RequestOutputKind = RequestOutputKind.DELTA,
           **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=kind, **kw)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), **ARGS)


@pytest.fixture
def llm_engine(tiny_llama_dir: Path) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), **ARGS))


@pytest.fixture
async def engine(llm_engine: LLMEngine) -> AsyncIterator[AsyncLLMEngine]:
    eng = AsyncLLMEngine(llm_engine)
    yield eng
    await eng.shutdown()


async def wait_idle_and_free(engine: AsyncLLMEngine) -> None:
    async with asyncio.timeout(10 * UNIT):
        while await engine.run_in_engine_thread(lambda e: e.has_unfinished_requests()):
            await asyncio.sleep(0.01)
    await engine.check_integrity()
    pool = engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def _out(rid: str, text: str, ids: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, None, [1], [CompletionOutput(0, text, ids,
                                                           "length" if finished else None)],
                         finished)


async def test_collector_merges_deltas_and_replaces_cumulative() -> None:
    box = RequestOutputCollector(merge_deltas=True)
    box.put(_out("a", "he", [1]))
    box.put(_out("a", "llo", [2, 3]))
    box.put(_out("a", "!", [4], finished=True))
    merged = box.get_nowait()
    assert merged is not None and merged.finished
    assert merged.outputs[0].text == "hello!" and merged.outputs[0].token_ids == [1, 2, 3, 4]
    assert merged.outputs[0].finish_reason == "length"
    assert box.get_nowait() is None

    cum = RequestOutputCollector(merge_deltas=False)
    cum.put(_out("b", "he", [1]))
    cum.put(_out("b", "hello", [1, 2]))
    latest = await cum.get()
    assert latest.outputs[0].text == "hello"

    box.put(_out("c", "x", [9]))
    box.put(ValueError("bad"))  # an error wins over pending output
    with pytest.raises(ValueError, match="bad"):
        box.get_nowait()


def _sample(index: int, text: str, ids: list[int], reason: str | None = None
            ) -> CompletionOutput:
    return CompletionOutput(index, text, ids, reason, logprobs=[{t: -1.0} for t in ids])


async def test_collector_merges_deltas_of_parallel_samples_by_index() -> None:
    box = RequestOutputCollector(merge_deltas=True)
    box.put(RequestOutput("p", None, [1], [_sample(0, "a", [1]), _sample(2, "x", [7])], False))
    box.put(RequestOutput("p", None, [1], [_sample(1, "m", [4])], False))
    box.put(RequestOutput("p", None, [1], [_sample(2, "y", [8], "stop"), _sample(0, "b", [2])],
                          False))
    merged = box.get_nowait()
    assert merged is not None and not merged.finished
    got = [(c.index, c.text, c.token_ids, c.finish_reason, len(c.logprobs or []))
           for c in merged.outputs]
    assert got == [(0, "ab", [1, 2], None, 2), (1, "m", [4], None, 1),
                   (2, "xy", [7, 8], "stop", 2)]


async def test_parallel_samples_stream_with_their_index(engine: AsyncLLMEngine,
                                                        offline: LLM) -> None:
    def params(kind: RequestOutputKind) -> SamplingParams:
        return SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True,
                              output_kind=kind)

    expected = offline.generate(["Tell me a story"], params(RequestOutputKind.FINAL_ONLY),
                                use_tqdm=False)[0]
    texts, ids = ["", "", ""], [[], [], []]
    finished_at: list[int] = []
    async for out in engine.generate("Tell me a story", params(RequestOutputKind.DELTA), "p"):
        for c in out.outputs:
            texts[c.index] += c.text
            ids[c.index] += c.token_ids
            if c.finish_reason is not None:
                finished_at.append(c.index)
    assert sorted(finished_at) == [0, 1, 2]
    assert texts == [c.text for c in expected.outputs]
    assert ids == [c.token_ids for c in expected.outputs]
    finals = [out async for out in engine.generate(
        "Tell me a story", params(RequestOutputKind.FINAL_ONLY), "q")]
    assert len(finals) == 1 and finals[0].finished
    assert [c.index for c in finals[0].outputs] == [0, 1, 2]
    assert [c.token_ids for c in finals[0].outputs] == ids
    await wait_idle_and_free(engine)


async def test_abort_ends_every_parallel_sample(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(n=4, temperature=1.0, max_tokens=200, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    stream = engine.add_request("A long story", params, "a")
    first = await stream.__anext__()
    assert not first.finished
    await engine.abort("a")
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished
    assert [c.index for c in last.outputs] == [0, 1, 2, 3]
    assert all(c.finish_reason == "abort" for c in last.outputs)
    await wait_idle_and_free(engine)


async def test_delta_stream_equals_offline_greedy(engine: AsyncLLMEngine, offline: LLM) -> None:
    prompts = ["The quick brown fox", "Hello world!", "def add(a, b):"]
    expected = offline.generate(prompts, greedy(16), use_tqdm=False)

    async def run(i: int) -> tuple[str, list[int], str | None]:
        text, ids, reason = "", [], None
        async for out in engine.generate(prompts[i], greedy(16), f"r{i}"):
            text += out.outputs[0].text
            ids += out.outputs[0].token_ids
            reason = out.outputs[0].finish_reason
        return text, ids, reason

    got = await asyncio.gather(*(run(i) for i in range(len(prompts))))
    for (text, ids, reason), exp in zip(got, expected, strict=True):
        assert ids == exp.outputs[0].token_ids
        assert text == exp.outputs[0].text
        assert reason == exp.outputs[0].finish_reason
    await wait_idle_and_free(engine)


async def test_cumulative_and_final_only_kinds(engine: AsyncLLMEngine, offline: LLM) -> None:
    [exp] = offline.generate(["Numbers 0 1 2"], greedy(10), use_tqdm=False)
    cumulative = [o async for o in engine.generate(
        "Numbers 0 1 2", greedy(10, RequestOutputKind.CUMULATIVE), "cum")]
    lengths = [len(o.outputs[0].token_ids) for o in cumulative]
    assert lengths == sorted(lengths) and lengths[-1] == len(exp.outputs[0].token_ids)
    assert cumulative[-1].outputs[0].text == exp.outputs[0].text
    final = [o async for o in engine.generate(
        "Numbers 0 1 2", greedy(10, RequestOutputKind.FINAL_ONLY), "fin")]
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == exp.outputs[0].token_ids


async def test_leaving_the_iterator_early_aborts(engine: AsyncLLMEngine) -> None:
    async for _ in engine.generate("go on and on", greedy(200, ignore_eos=True), "early"):
        break
    gc.collect()  # the abandoned generator is closed by its finalizer, which aborts it
    await wait_idle_and_free(engine)
    assert engine.num_in_flight == 0
    assert engine.num_queued_requests == 0 and engine.num_queued_prompt_tokens == 0


async def test_cancelling_the_consumer_task_aborts(engine: AsyncLLMEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("go on and on", greedy(200, ignore_eos=True), "cancel"):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 10 * UNIT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle_and_free(engine)


async def test_abort_ends_the_stream_with_abort(engine: AsyncLLMEngine) -> None:
    outs = []
    async for out in engine.generate("abort me", greedy(200, ignore_eos=True), "ab"):
        outs.append(out)
        if len(outs) == 2:
            await engine.abort("ab")
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    await wait_idle_and_free(engine)


async def test_slow_consumer_gets_merged_deltas_and_stalls_nobody(
    engine: AsyncLLMEngine, offline: LLM
) -> None:
    n = 40
    [exp] = offline.generate(["slow reader"], greedy(n, ignore_eos=True), use_tqdm=False)
    loop = asyncio.get_running_loop()
    slow_outputs: list[RequestOutput] = []

    async def slow() -> float:
        async for out in engine.generate("slow reader", greedy(n, ignore_eos=True), "slow"):
            slow_outputs.append(out)
            await asyncio.sleep(0.25 * UNIT)  # lags far behind the engine
        return loop.time()

    async def fast() -> float:
        async for _ in engine.generate("fast reader", greedy(n, ignore_eos=True), "fast"):
            pass
        return loop.time()

    slow_end, fast_end = await asyncio.gather(slow(), fast())
    assert fast_end < slow_end  # the fast request did not wait for the slow consumer
    assert len(slow_outputs) < n  # deltas were merged while the consumer slept
    assert [t for o in slow_outputs for t in o.outputs[0].token_ids] == exp.outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in slow_outputs) == exp.outputs[0].text
    await wait_idle_and_free(engine)


async def test_one_hand_off_per_step(engine: AsyncLLMEngine, llm_engine: LLMEngine) -> None:
    steps_with_outputs = 0
    real_step = llm_engine.step

    def counting_step() -> list[RequestOutput]:
        nonlocal steps_with_outputs
        outs = real_step()
        steps_with_outputs += bool(outs)
        return outs

    llm_engine.step = counting_step  # type: ignore[method-assign]
    hand_offs: list[int] = []
    real_dispatch = engine._dispatch

    def counting_dispatch(outputs: list[RequestOutput], *rest: Any) -> None:
        if outputs:
            hand_offs.append(len(outputs))
        real_dispatch(outputs, *rest)

    engine._dispatch = counting_dispatch  # type: ignore[method-assign]

    async def run(i: int) -> None:
        async for _ in engine.generate(f"prompt {i}", greedy(8, ignore_eos=True), f"h{i}"):
            pass

    await asyncio.gather(*(run(i) for i in range(4)))
    assert len(hand_offs) == steps_with_outputs
    assert max(hand_offs) == 4  # one step's outputs of all four requests in one hand-off


async def test_step_error_fails_its_requests_and_the_engine_keeps_serving(
    engine: AsyncLLMEngine, llm_engine: LLMEngine
) -> None:
    real_step = llm_engine.step
    armed = True

    def failing_step() -> list[RequestOutput]:
        nonlocal armed
        if armed and llm_engine.scheduler.running:
            armed = False
            ids = [r.request_id for r in llm_engine.scheduler.running]
            llm_engine.abort_request(ids)  # as the real step does before raising
            raise StepError(ids, RuntimeError("kernel fault"))
        return real_step()

    llm_engine.step = failing_step  # type: ignore[method-assign]
    with pytest.raises(RequestFailedError, match="kernel fault") as info:
        async for _ in engine.generate("fail me", greedy(20, ignore_eos=True), "victim"):
            pass
    assert info.value.request_id == "victim"
    assert engine.is_running and not engine.errored and engine.stats().healthy
    outs = [o async for o in engine.generate("after", greedy(3, ignore_eos=True), "after")]
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 3
    await wait_idle_and_free(engine)


async def test_fatal_error_leaves_the_engine_clearly_dead(
    engine: AsyncLLMEngine, llm_engine: LLMEngine
) -> None:
    def broken_step() -> list[RequestOutput]:
        raise MemoryError("allocator corrupted")

    llm_engine.step = broken_step  # type: ignore[method-assign]
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate("x", greedy(5), "doomed"):
            pass
    assert engine.errored and not engine.is_running
    assert not engine.stats().healthy
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate("y", greedy(5), "later"):
            pass


async def test_repeated_step_errors_declare_the_engine_dead(
    engine: AsyncLLMEngine, llm_engine: LLMEngine
) -> None:
    def always_failing() -> list[RequestOutput]:
        ids = list(llm_engine.scheduler.requests)
        llm_engine.abort_request(ids)
        raise StepError(ids, RuntimeError("sticky device error"))

    llm_engine.step = always_failing  # type: ignore[method-assign]
    for i in range(engine.max_consecutive_step_errors):
        with pytest.raises((RequestFailedError, EngineDeadError)):
            async for _ in engine.generate("x", greedy(5), f"s{i}"):
                pass
    async with asyncio.timeout(5 * UNIT):
        while not engine.errored:
            await asyncio.sleep(0.01)
    assert not engine.is_running


async def test_invalid_requests_raise_typed_value_errors(engine: AsyncLLMEngine) -> None:
    # Token ids are checked on the loop: the request never reaches the step thread.
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        engine.add_request(None, greedy(10), "long", prompt_token_ids=[5] * 250)
    assert engine.num_in_flight == 0 and engine.num_queued_requests == 0
    # A text prompt is tokenized and checked on the step thread: its refusal comes back
    # through the request's mailbox with its type, code and field.
    text = "hello " * 300
    assert len(engine.engine.tokenize(text)) >= engine.max_model_len
    with pytest.raises(PromptTooLongError) as info:
        async for _ in engine.generate(text, greedy(10), "long-text"):
            pass
    assert (info.value.code, info.value.field) == (ErrorCode.PROMPT_TOO_LONG, "prompt")
    gen = engine.generate("x", greedy(50, ignore_eos=True), "dup")
    await anext(gen)
    with pytest.raises(DuplicateRequestIdError, match="already in flight"):
        async for _ in engine.generate("x", greedy(5), "dup"):
            pass
    params = greedy(5)
    params.top_k = -7  # changed after construction validated it
    with pytest.raises(InvalidRequestError, match="top_k"):
        engine.check_request("new", [5, 6], params)
    await gen.aclose()
    await wait_idle_and_free(engine)
    assert engine.num_queued_requests == 0


async def test_check_request_applies_queue_limits(engine: AsyncLLMEngine) -> None:
    limits = QueueLimits(max_queued_requests=1, max_queued_prompt_tokens=100)
    engine.check_request("a", [5] * 8, greedy(5), queue_limits=limits)  # nothing queued
    stream = engine.add_request(None, greedy(5), "a", prompt_token_ids=[5] * 8)
    # Queued until its first token, which cannot come before this task yields.
    assert engine.num_queued_requests == 1
    with pytest.raises(OverloadedError):
        engine.check_request("b", [5] * 8, greedy(5), queue_limits=limits)
    async for _ in stream:
        pass
    await wait_idle_and_free(engine)


async def test_stats_snapshot_has_device_and_counts(engine: AsyncLLMEngine) -> None:
    async for _ in engine.generate("count", greedy(5, ignore_eos=True), "st"):
        pass
    await wait_idle_and_free(engine)
    async with asyncio.timeout(5 * UNIT):
        while engine.stats().generation_tokens_total < 5:
            await asyncio.sleep(0.01)
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_blocks_total == 64 and stats.kv_blocks_used == 0
    assert stats.device.kind == "cpu" and stats.device.memory_total_bytes > 0
    assert stats.ttft.count >= 1 and stats.healthy


async def test_latency_is_measured_once_for_stats_and_stat_loggers(
    engine: AsyncLLMEngine,
) -> None:
    class Recorder(StatLoggerBase):
        def __init__(self) -> None:
            self.ttft: list[float] = []
            self.itl: list[float] = []

        def on_first_token(self, ttft: float) -> None:
            self.ttft.append(ttft)

        def on_new_tokens(self, num_tokens: int, inter_token_latency: float | None) -> None:
            if inter_token_latency is not None:
                self.itl.append(inter_token_latency)

    recorder = Recorder()
    engine.add_stat_logger(recorder)
    assert engine.stats().ttft.count == 0  # a fresh engine
    for i in range(3):
        async for _ in engine.generate([5, 6, 7], greedy(4, ignore_eos=True), f"lat{i}"):
            pass
    engine.remove_stat_logger(recorder)
    stats = engine.stats()
    assert len(recorder.ttft) == 3 and len(recorder.itl) == 3 * 3
    # The same figures, summarised by the one percentile rule.
    assert stats.ttft == percentiles(recorder.ttft) and stats.ttft.count == 3
    assert stats.itl == percentiles(recorder.itl) and stats.itl.count == 9
    await wait_idle_and_free(engine)


async def test_shutdown_fails_in_flight_requests_and_frees_blocks(
    engine: AsyncLLMEngine, llm_engine: LLMEngine
) -> None:
    gen = engine.generate("x", greedy(200, ignore_eos=True), "inflight")
    await anext(gen)
    await engine.shutdown()
    with pytest.raises(EngineDeadError):
        await anext(gen)
    assert not engine.is_running
    llm_engine.check_integrity()
    assert llm_engine.pool.num_free_blocks == llm_engine.pool.num_blocks


async def test_reused_id_ignores_the_last_words_of_its_predecessor(
    engine: AsyncLLMEngine, offline: LLM
) -> None:
    """Outputs and failures of an ended request can still be on their way to the loop when
    its id is reused: they must not reach (or end, or fail) the new request."""
    first = engine.add_request("go on and on", greedy(200, ignore_eos=True), "same")
    await anext(first)
    first.close()  # abort; the engine may already have produced more for it
    [exp] = offline.generate(["Numbers 0 1 2"], greedy(10), use_tqdm=False)
    second = engine.add_request("Numbers 0 1 2", greedy(10), "same")
    old = RequestOutput(
        request_id="same", prompt=None, prompt_token_ids=[],
        outputs=[CompletionOutput(index=0, text="stale", token_ids=[7], finish_reason="length")],
        finished=True, metrics=RequestMetrics(arrival_time=-1.0),
    )  # fmt: skip
    engine._dispatch([old], {"same": (-1.0, RequestFailedError("same", "stale"))}, None)
    ids: list[int] = []
    async for out in second:
        assert out.outputs[0].text != "stale"
        ids += out.outputs[0].token_ids
    assert ids == exp.outputs[0].token_ids
    await wait_idle_and_free(engine)


async def test_from_engine_args_builds_on_the_step_thread(
    tiny_llama_dir: Path, offline: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine is built by the thread that steps it, which then serves like any other."""
    import threading

    built_on: list[str] = []
    original = LLMEngine.from_engine_args

    def recording(args: EngineArgs) -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return original(args)

    monkeypatch.setattr(LLMEngine, "from_engine_args", staticmethod(recording))
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), **ARGS))
    try:
        assert built_on == ["asyncengine-step"]
        [want] = offline.generate(["Numbers 0 1 2"], greedy(8), use_tqdm=False)
        got: list[int] = []
        async for out in eng.generate("Numbers 0 1 2", greedy(8), "a"):
            got += out.outputs[0].token_ids
        assert got == want.outputs[0].token_ids
        await wait_idle_and_free(eng)
    finally:
        await eng.shutdown()
    assert eng._thread is not None and not eng._thread.is_alive()


async def test_from_engine_args_build_error_reaches_the_caller(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tmp_path), **ARGS))


async def test_engine_built_on_its_thread_stops_without_ever_serving(
    tiny_llama_dir: Path,
) -> None:
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), **ARGS))
    assert eng._thread is not None and eng._thread.is_alive()
    await eng.shutdown(timeout=10 * UNIT)
    assert not eng._thread.is_alive()


async def test_front_ends_reach_the_model_and_tokenizer_through_the_engine(
    engine: AsyncLLMEngine, tiny_llama_dir: Path,
) -> None:  # fmt: skip
    """What a front end needs of the model (its directory, the `model` it was asked for,
    device and dtype) and of the tokenizer (text and chat prompts, tools passed on to the
    template), without reaching into the engine it wraps."""
    assert engine.model_dir == tiny_llama_dir and engine.requested_model == str(tiny_llama_dir)
    assert str(engine.device) == "cpu" and engine.dtype == torch.float32
    assert engine.encode("Numbers 0 1 2") == list(engine.tokenizer.encode("Numbers 0 1 2"))
    messages = [{"role": "user", "content": "hi"}]
    want = engine.engine.apply_chat_template(messages)
    assert want and all(isinstance(i, int) for i in want)
    assert engine.encode_chat(messages) == want
    assert engine.encode_chat(messages, [{"type": "function", "function": {"name": "f"}}]) == want
