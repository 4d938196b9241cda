"""AsyncLLMEngine: the asyncio face of `LLMEngine`.

The model step never runs on the event loop. A dedicated thread owns the `LLMEngine`: it
drains a thread-safe inbox of commands (add, abort, call, stop), runs `step()` while there
is work, sleeps on a `threading.Event` when idle, and hands each step's outputs to the loop
in ONE `loop.call_soon_threadsafe` call. On the loop, every request has a single-slot
mailbox that merges deltas when its consumer lags, so a slow consumer costs memory of one
merged output and never stalls the engine or other requests.

Knows nothing of WebSockets; the frontends build on `generate`/`abort`/`stats`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from asyncengine.config import EngineArgs
from asyncengine.errors import InvalidRequestError, RequestError
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.request_check import QueueLimits, QueueState, check_request_id
from asyncengine.sampling_params import RequestOutputKind, SamplingParams
from asyncengine.stat_loggers import LatencyStatLogger, StatLoggerBase
from asyncengine.stats_schema import EngineStats

if TYPE_CHECKING:
    from asyncengine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Snapshots walk the block pool and read the device, so the step thread takes one only when
# somebody asked since the last one, at most this often, and whenever it goes idle.
_STATS_INTERVAL_S = 0.1


class EngineDeadError(RuntimeError):
    """The engine's step thread died (or was shut down); no request can be served."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its step raised, or its own processing did).

    The engine itself keeps serving other requests.
    """

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id!r} failed: {message}")
        self.request_id = request_id
        self.reason = message


class RequestOutputCollector:
    """A single-slot mailbox between the step hand-off and one request's consumer.

    `put` never blocks: a DELTA output merges into the one still waiting (text and token ids
    concatenated), a CUMULATIVE/FINAL_ONLY output replaces it, and an exception wins.
    """

    __slots__ = ("_item", "_merge_deltas", "_ready")

    def __init__(self, merge_deltas: bool = True) -> None:
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self._merge_deltas = merge_deltas

    def put(self, item: RequestOutput | BaseException) -> None:
        pending = self._item
        if pending is None or isinstance(item, BaseException):
            self._item = item
        elif isinstance(pending, RequestOutput):
            self._item = _merge(pending, item) if self._merge_deltas else item
        self._ready.set()

    def get_nowait(self) -> RequestOutput | None:
        """The waiting output, or None; raises the waiting exception."""
        item = self._item
        if item is None:
            return None
        self._item = None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        return item

    async def get(self) -> RequestOutput:
        while self._item is None:
            await self._ready.wait()
        out = self.get_nowait()
        assert out is not None
        return out

    @property
    def has_pending(self) -> bool:
        return self._item is not None


def _merge(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Fold `new` into a not-yet-consumed `old` of the same request, sample by sample (the
    deltas of a request with n > 1 carry only the samples that moved, each with its index)."""
    if not old.outputs or not new.outputs:
        return new
    merged = {c.index: c for c in old.outputs}
    for b in new.outputs:
        a = merged.get(b.index)
        if a is None:
            merged[b.index] = b
            continue
        logprobs = None
        if a.logprobs is not None or b.logprobs is not None:
            logprobs = (a.logprobs or []) + (b.logprobs or [])
        merged[b.index] = dataclasses.replace(
            b, text=a.text + b.text, token_ids=[*a.token_ids, *b.token_ids], logprobs=logprobs)
    # A DELTA output carries the prompt logprobs once: keep them through a merge.
    prompt_logprobs = new.prompt_logprobs if new.prompt_logprobs is not None \
        else old.prompt_logprobs
    return dataclasses.replace(new, outputs=[merged[i] for i in sorted(merged)],
                               prompt_logprobs=prompt_logprobs)


@dataclasses.dataclass(slots=True)
class _RequestState:
    """What the loop side knows about one in-flight request."""

    request_id: str
    arrival_time: float
    output_kind: RequestOutputKind
    mailbox: RequestOutputCollector
    num_prompt_tokens: int = 0
    n: int = 1  # samples of the request, each an output with its index
    finished_samples: set[int] = dataclasses.field(default_factory=set)
    num_generated: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished: bool = False
    queued: bool = True  # counted in the queue accounting until its first token or its end
    finish_recorded: bool = False


class RequestStream:
    """The outputs of one submitted request, as an async iterator.

    Ends after the finished output; raises the request's error. `close()` (idempotent)
    forgets the request and aborts it in the engine if it has not finished.
    """

    __slots__ = ("_ended", "_engine", "_state")

    def __init__(self, engine: AsyncLLMEngine, state: _RequestState) -> None:
        self._engine = engine
        self._state = state
        self._ended = False

    @property
    def request_id(self) -> str:
        return self._state.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        mailbox = self._state.mailbox
        try:
            out = mailbox.get_nowait() or await mailbox.get()
        except BaseException:
            if self._state.finished:  # the request failed: nothing more will come
                self._ended = True
            raise
        if out.finished:
            self._ended = True
        return out

    def close(self) -> None:
        self._ended = True
        self._engine._close_stream(self._state)


class AsyncLLMEngine:
    """Runs an `LLMEngine` in a background thread and streams outputs to asyncio consumers.

    Use `generate()` as an async iterator of `RequestOutput`s whose shape follows
    `SamplingParams.output_kind` (DELTA: only what is new; CUMULATIVE: everything so far;
    FINAL_ONLY: one output at the end). Leaving the iterator early, or cancelling the task
    that iterates it, aborts the request and frees its KV blocks.
    """

    def __init__(self, engine: LLMEngine, *, log_requests: bool = False,
                 owns_engine: bool = False) -> None:
        self.engine = engine
        # Whether `shutdown()` (or dropping this object) frees the engine's memory: true for
        # an engine built by `from_engine_args`; one handed in stays its caller's to free.
        self.owns_engine = owns_engine
        self.log_requests = log_requests
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        # Set when the step thread already exists (it built the engine) and waits for the
        # first event loop to serve.
        self._release_thread: threading.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._requests: dict[str, _RequestState] = {}
        # TTFT and ITL are measured once, in `_account`, and handed to every stat logger;
        # this one keeps the windows `stats()` summarises.
        self._latency = LatencyStatLogger()
        self._stat_loggers: list[StatLoggerBase] = [self._latency]
        # A first real snapshot (pool size, block map) before any step: the step thread only
        # starts with the first request, and a dashboard may attach to an idle server.
        get_stats = getattr(engine, "get_stats", None)
        self._latest_stats = get_stats() if get_stats else EngineStats(model=self.model_name)
        self._dead_error: BaseException | None = None
        self._shutdown = False
        self._num_queued_prompt_tokens = 0
        self._num_queued_requests = 0
        self.max_consecutive_step_errors = 3
        self._auto_ids = itertools.count()
        self._last_arrival = 0.0
        self._stats_requested = True
        self._next_stats = 0.0
        self._was_busy = True  # publish one snapshot at start
        self._consecutive_errors = 0
        # Dropped without `shutdown()`: the idle step thread wakes, finds its owner gone,
        # frees the engine's memory and ends.
        weakref.finalize(self, self._wakeup.set)

    async def __aenter__(self) -> AsyncLLMEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, log_requests: bool = False) -> AsyncLLMEngine:
        """Build the `LLMEngine` from `args` on the step thread and wrap it; the thread waits
        there until the first request's event loop attaches.

        The thread that steps the engine also builds it: on the CPU, stepping from another
        thread than the one that loaded the weights measured 15-20 % slower (2 OpenMP
        threads, the embedded model)."""
        from asyncengine.llm_engine import LLMEngine

        built: queue.SimpleQueue[LLMEngine | BaseException] = queue.SimpleQueue()
        release = threading.Event()
        # Weakly: the thread must not keep a dropped AsyncLLMEngine (and its memory) alive.
        owner: list[weakref.ref[AsyncLLMEngine]] = []

        def step_thread() -> None:
            try:
                engine = LLMEngine.from_engine_args(args)
            except BaseException as exc:  # handed to the caller, who raises it
                built.put(exc)
                return
            built.put(engine)
            release.wait()
            if owner:
                _serve_steps(owner[0], engine, True)
            else:
                engine.shutdown()

        thread = threading.Thread(target=step_thread, name="asyncengine-step", daemon=True)
        thread.start()
        result = built.get()
        if isinstance(result, BaseException):
            thread.join()
            raise result
        self = cls(result, log_requests=log_requests, owns_engine=True)
        self._thread, self._release_thread = thread, release
        owner.append(weakref.ref(self))
        weakref.finalize(self, release.set)
        return self

    # ------------------------------------------------------------------ properties
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def model_name(self) -> str:
        return str(self.engine.model_name)

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def model_dir(self) -> Any:
        """The directory the model was loaded from (the embedded model's, without `model`)."""
        return self.engine.model_dir

    @property
    def requested_model(self) -> str | None:
        """`EngineArgs.model` as given (None: the embedded default model)."""
        return getattr(self.engine.args, "model", None)

    @property
    def device(self) -> Any:
        return self.engine.device

    @property
    def dtype(self) -> Any:
        return self.engine.dtype

    @property
    def block_pool(self) -> Any:
        """The engine's KV block pool (read-only use from the loop: counts, sizes)."""
        return self.engine.pool

    @property
    def is_running(self) -> bool:
        """True while the engine can take requests (not shut down, not dead)."""
        return not self._shutdown and self._dead_error is None

    @property
    def errored(self) -> bool:
        """True once the step thread has died; every later request fails at once."""
        return self._dead_error is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    @property
    def num_queued_requests(self) -> int:
        """Requests accepted here that have not produced their first token yet."""
        return self._num_queued_requests

    @property
    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens of `num_queued_requests` (known once the engine reports them)."""
        return self._num_queued_prompt_tokens

    @property
    def load(self) -> int:
        """Requests accepted and not finished (running, waiting or swapped): what a load
        balancer weighs (vllm-router's `/get_load`); exact, unlike a stats snapshot."""
        return len(self._requests)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (the tokenizer's special tokens, e.g. BOS, when asked)."""
        return list(self._require_tokenizer("prompt").encode(
            text, add_special_tokens=add_special_tokens))

    def encode_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None, *,
                    add_generation_prompt: bool = True) -> list[int]:  # fmt: skip
        """Token ids of `messages` under the model's chat template (`tools` to templates that
        take them)."""
        return self.engine.apply_chat_template(
            messages, tools, add_generation_prompt=add_generation_prompt)

    def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (special tokens included, as vLLM's `/detokenize`)."""
        return str(self._require_tokenizer("tokens").decode(token_ids))

    def _require_tokenizer(self, field: str) -> Any:
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this server has no tokenizer (skip_tokenizer_init is set)", field=field)
        return self.tokenizer

    async def reset_prefix_cache(self) -> int:
        """Drop the prefix cache's free blocks, between two steps; returns how many.

        Blocks held by requests in flight keep their prefixes (see
        `BlockPool.reset_prefix_cache`), so this is safe while the engine serves."""
        dropped = await self.run_in_engine_thread(lambda e: e.pool.reset_prefix_cache())
        self._stats_requested = True
        return int(dropped)

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        self._stat_loggers.append(stat_logger)
        stat_logger.on_stats(self._latest_stats)

    def remove_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        if stat_logger in self._stat_loggers:
            self._stat_loggers.remove(stat_logger)

    # ------------------------------------------------------------------ public API
    def check_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        queue_limits: QueueLimits | None = None,
    ) -> None:
        """The request check (`LLMEngine.check_request`), on the loop: against the ids in
        flight here and, when `queue_limits` are given, this engine's waiting queue. Raises a
        `RequestError` (see `asyncengine.errors`); cheap, so frontends call it before
        `add_request` and a refused request never reaches the step thread."""
        queue = None
        if queue_limits is not None:
            queue = QueueState(self._num_queued_requests, self._num_queued_prompt_tokens,
                               queue_limits)
        self.engine.check_request(request_id, prompt_token_ids, params, in_use=self._requests,
                                  queue=queue)

    def add_request(
        self,
        prompt: str | list[int] | None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        num_prompt_tokens: int | None = None,
    ) -> RequestStream:
        """Submit a request now and return its stream (what `generate` iterates).

        Synchronous, so callers can count it against queue limits before they yield; close
        the stream (`stream.close()`) if you stop before its end, which aborts the request.
        `num_prompt_tokens`, when known, counts the prompt in the queue accounting at once.
        A request with token ids is checked here (a `RequestError` raises at once); a text
        prompt is checked once the step thread has tokenized it (its stream raises).
        """
        self._ensure_started()
        params = sampling_params if sampling_params is not None else SamplingParams()
        if request_id is None:
            request_id = f"req-{next(self._auto_ids)}"
        ids = prompt_token_ids if prompt_token_ids is not None else (
            prompt if isinstance(prompt, list) else None)
        if ids is not None:
            self.check_request(request_id, ids, params)
            if num_prompt_tokens is None:
                num_prompt_tokens = len(ids)
        else:
            check_request_id(request_id, self._requests)
            params.validate()
        # The arrival time tells this request apart from an earlier one with the same id
        # whose last outputs may still be on their way to the loop: it must be unique.
        arrival = max(time.monotonic(), self._last_arrival + 1e-6)
        self._last_arrival = arrival
        mailbox = RequestOutputCollector(params.output_kind == RequestOutputKind.DELTA)
        state = _RequestState(request_id, arrival, params.output_kind, mailbox,
                              num_prompt_tokens=num_prompt_tokens or 0, n=params.n)
        self._requests[request_id] = state
        self._num_queued_requests += 1
        self._num_queued_prompt_tokens += state.num_prompt_tokens
        if self.log_requests:
            logger.info("request %s added (%d prompt tokens)", request_id, state.num_prompt_tokens)
        self._submit(("add", request_id, prompt, params, prompt_token_ids, arrival))
        return RequestStream(self, state)

    async def generate(
        self,
        prompt: str | list[int] | None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request.

        With `n` > 1 one stream carries all samples: each output's `outputs` hold a
        `CompletionOutput` per sample (DELTA: only the samples with news), told apart by
        `index`; the stream ends when every sample has finished.

        Raises a `RequestError` for a refused request (`InvalidRequestError`,
        `PromptTooLongError`, `DuplicateRequestIdError`: all ValueErrors),
        `RequestFailedError` when the engine fails this request, `EngineDeadError` when the
        engine is dead. Leaving the loop early or cancelling the task aborts the request.
        """
        stream = self.add_request(prompt, sampling_params, request_id,
                                  prompt_token_ids=prompt_token_ids)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _close_stream(self, state: _RequestState) -> None:
        self._forget(state)
        if not state.finished:
            # Left early or cancelled: free the request's blocks at once.
            state.finished = True
            if self._thread is not None and self._dead_error is None:
                self._submit(("abort", [state.request_id]))
            self._record_finish(state, "abort", None)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests; their iterators end with a final output, finish_reason "abort"."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self._thread is not None and self._dead_error is None:
            self._submit(("abort", ids))
        for rid in ids:
            state = self._requests.get(rid)
            if state is None or state.finished:
                continue
            state.finished = True
            state.mailbox.put(RequestOutput(
                request_id=rid, prompt=None, prompt_token_ids=[],
                outputs=[CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
                         for i in range(state.n) if i not in state.finished_samples],
                finished=True))
            self._record_finish(state, "abort", None)

    def stats(self) -> EngineStats:
        """The latest engine snapshot (taken by the step thread at most every
        `_STATS_INTERVAL_S` and when it goes idle), with the device part and the TTFT/ITL
        percentiles measured here."""
        self._stats_requested = True
        snap = shallow_copy(self._latest_stats)
        snap.ttft = self._latency.ttft.summary()
        snap.itl = self._latency.itl.summary()
        if not snap.model:
            snap.model = self.model_name
        snap.healthy = self.is_running
        return snap

    async def run_in_engine_thread(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the step thread between two steps and return its result.

        The safe way to touch the `LLMEngine` while the async engine runs (e.g.
        `check_integrity`, reading the block pool).
        """
        self._ensure_started()
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._submit(("call", fn, fut))
        return await fut

    async def check_integrity(self) -> None:
        """Run `LLMEngine.check_integrity()` on the step thread."""
        await self.run_in_engine_thread(lambda e: e.check_integrity())

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the step thread and free the engine's KV pools, CUDA graphs and weights;
        in-flight requests end with `EngineDeadError`. Also done by `async with`, and, without
        the wait, when the engine is dropped."""
        if self._shutdown:
            return
        self._shutdown = True
        thread = self._thread
        if thread is not None:
            if self._requests and self._dead_error is None:
                self._submit(("abort", list(self._requests)))
            self._submit(("stop",))
            if self._release_thread is not None:
                self._release_thread.set()  # a thread that never served still has to stop
            await asyncio.get_running_loop().run_in_executor(None, thread.join, timeout)
            if thread.is_alive():
                logger.warning("engine thread did not stop within %.1fs", timeout)
        free = getattr(self.engine, "shutdown", None)
        if not self.owns_engine:
            free = getattr(self.engine.runner, "stop_workers", None)  # tensor-parallel ranks
        if free is not None and (thread is None or not thread.is_alive()):
            free()  # never under a step that is still running
        self._fail_all(EngineDeadError("engine was shut down"))

    # ------------------------------------------------------------------ loop side
    def _ensure_started(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self._dead_error!r}") from self._dead_error
        if self._shutdown:
            raise EngineDeadError("engine was shut down")
        loop = asyncio.get_running_loop()
        if self._thread is None:
            self._loop = loop
            self._thread = threading.Thread(
                target=_serve_steps, name="asyncengine-step",
                args=(weakref.ref(self), self.engine, self.owns_engine), daemon=True,
            )
            self._thread.start()
        elif self._loop is None and self._release_thread is not None:
            self._loop = loop
            self._release_thread.set()
        elif loop is not self._loop:
            if self._requests:
                raise RuntimeError("AsyncLLMEngine is serving requests on another event loop")
            self._loop = loop  # the step thread reads it at each hand-off

    def _submit(self, cmd: tuple[Any, ...]) -> None:
        self._inbox.put(cmd)
        self._wakeup.set()

    def _forget(self, state: _RequestState) -> None:
        if self._requests.get(state.request_id) is state:
            del self._requests[state.request_id]
        self._leave_queue(state)

    def _leave_queue(self, state: _RequestState) -> None:
        # A request leaves the queue accounting exactly once: at its first token or its end.
        if state.queued:
            state.queued = False
            self._num_queued_requests -= 1
            self._num_queued_prompt_tokens -= state.num_prompt_tokens

    def _dispatch(
        self,
        outputs: list[RequestOutput],
        failures: dict[str, tuple[float | None, BaseException]],
        stats: EngineStats | None,
    ) -> None:
        """Runs on the loop: one call per step. Never blocks."""
        now = time.monotonic()
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None or state.finished:
                continue  # consumer left, or aborted from outside
            if out.metrics is not None and out.metrics.arrival_time != state.arrival_time:
                continue  # the last words of an earlier request that had this id
            if out.error is not None:
                self._fail(state, RequestFailedError(out.request_id, out.error))
                continue
            self._account(state, out, now)
            for c in out.outputs:
                if c.finish_reason is not None:
                    state.finished_samples.add(c.index)
            if out.finished:
                state.finished = True
                reason = out.outputs[0].finish_reason if out.outputs else None
                self._record_finish(state, reason or "stop", out)
            state.mailbox.put(out)
        for rid, (arrival, exc) in failures.items():
            state = self._requests.get(rid)
            if state is None or state.finished:
                continue
            if arrival is not None and arrival != state.arrival_time:
                continue  # it concerned an earlier request with this id
            self._fail(state, exc)
        if stats is not None:
            self._latest_stats = stats
            for sl in self._stat_loggers:
                sl.on_stats(stats)

    def _account(self, state: _RequestState, out: RequestOutput, now: float) -> None:
        """Measure TTFT and ITL (the one place they are measured) and count tokens; every
        stat logger, `stats()`'s windows included, receives the same figures."""
        if out.prompt_token_ids:
            n_prompt = len(out.prompt_token_ids)
            if n_prompt != state.num_prompt_tokens:
                if state.queued:
                    self._num_queued_prompt_tokens += n_prompt - state.num_prompt_tokens
                state.num_prompt_tokens = n_prompt
        total = sum(len(c.token_ids) for c in out.outputs)
        new = total if state.output_kind == RequestOutputKind.DELTA else total - state.num_generated
        if new <= 0:
            return
        state.num_generated += new
        if state.first_token_time is None:
            state.first_token_time = now
            self._leave_queue(state)
            ttft = now - state.arrival_time
            for sl in self._stat_loggers:
                sl.on_prompt_processed(state.num_prompt_tokens)
                sl.on_first_token(ttft)
                sl.on_new_tokens(new, None)
        else:
            assert state.last_token_time is not None
            itl = now - state.last_token_time
            for sl in self._stat_loggers:
                sl.on_new_tokens(new, itl)
        state.last_token_time = now

    def _record_finish(self, state: _RequestState, reason: str, out: RequestOutput | None) -> None:
        if state.finish_recorded:
            return
        state.finish_recorded = True
        self._leave_queue(state)
        queue_time = None
        m = out.metrics if out is not None else None
        if m is not None and m.first_scheduled_time is not None:
            queue_time = max(0.0, m.first_scheduled_time - m.arrival_time)
        e2e = time.monotonic() - state.arrival_time
        if self.log_requests:
            logger.info("request %s finished: %s, %d tokens, %.3fs", state.request_id, reason,
                        state.num_generated, e2e)
        for sl in self._stat_loggers:
            sl.on_request_finished(finish_reason=reason, e2e_latency=e2e, queue_time=queue_time,
                                   num_prompt_tokens=state.num_prompt_tokens,
                                   num_generation_tokens=state.num_generated)

    def _fail(self, state: _RequestState, exc: BaseException) -> None:
        state.finished = True
        self._record_finish(state, "error", None)
        state.mailbox.put(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for state in list(self._requests.values()):
            if not state.finished:
                self._fail(state, exc)

    def _on_dead(self, exc: BaseException) -> None:
        self._dead_error = exc
        self._latest_stats.healthy = False
        self._fail_all(EngineDeadError(f"engine step thread died: {exc!r}"))

    # ------------------------------------------------------------------ step thread
    def _hand_off(self, *args: Any) -> bool:
        loop = self._loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(*args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            return False
        return True

    def _run_until_idle(self) -> bool:
        """Step while there is work; False when idle (the caller waits for `_wakeup`), True
        when the thread must end (asked to stop, nobody listening, or the engine died)."""
        engine = self.engine
        try:
            while True:
                self._wakeup.clear()
                failures: dict[str, tuple[float | None, BaseException]] = {}
                stop = self._drain_inbox(engine, failures)
                outputs: list[RequestOutput] = []
                busy = engine.has_unfinished_requests()
                if busy and not stop:
                    try:
                        outputs = engine.step()
                        self._consecutive_errors = 0
                        for rid, arrival, exc in engine.take_rejected():
                            failures[rid] = (arrival, exc)
                    except Exception as exc:
                        # A StepError names the requests it aborted; anything else is fatal.
                        ids = getattr(exc, "request_ids", None)
                        if ids is None:
                            raise
                        self._consecutive_errors += 1
                        logger.error("engine step failed for %d request(s): %r", len(ids), exc)
                        arrivals = getattr(exc, "arrival_times", None) or [None] * len(ids)
                        for rid, arrival in zip(ids, arrivals, strict=True):
                            failures[rid] = (
                                arrival, RequestFailedError(rid, f"engine step failed: {exc}")
                            )
                        engine.check_integrity()  # an AssertionError here kills the engine
                        if self._consecutive_errors >= self.max_consecutive_step_errors:
                            raise RuntimeError(
                                f"{self._consecutive_errors} consecutive engine steps failed"
                            ) from exc
                    busy = engine.has_unfinished_requests()
                now = time.monotonic()
                stats = None
                if (self._stats_requested and now >= self._next_stats) or (
                    self._was_busy and not busy
                ):
                    self._stats_requested = False
                    stats = engine.get_stats()
                    self._next_stats = now + _STATS_INTERVAL_S
                self._was_busy = busy
                if (outputs or failures or stats is not None) and not self._hand_off(
                    self._dispatch, outputs, failures, stats
                ):
                    return True
                if stop:
                    return True
                if not busy:
                    return False
        except BaseException as exc:
            logger.exception("engine step thread died")
            self._hand_off(self._on_dead, exc)
            return True

    def _drain_inbox(
        self, engine: LLMEngine, failures: dict[str, tuple[float | None, BaseException]]
    ) -> bool:
        """Apply queued commands; True when asked to stop."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return False
            kind = cmd[0]
            if kind == "add":
                _, rid, prompt, params, prompt_token_ids, arrival = cmd
                try:
                    engine.add_request(rid, prompt, params, prompt_token_ids=prompt_token_ids,
                                       arrival_time=arrival)
                except (RequestError, ValueError) as exc:  # refused: handed back as raised
                    failures[rid] = (arrival, exc)
                except Exception as exc:
                    # `LLMEngine.add_request` queues the request last, so a failure before
                    # that leaves no trace: fail this request, not the engine.
                    logger.exception("adding request %s failed", rid)
                    failures[rid] = (
                        arrival, RequestFailedError(rid, f"{type(exc).__name__}: {exc}")
                    )
            elif kind == "abort":
                engine.abort_request(cmd[1])
            elif kind == "call":
                _, fn, fut = cmd
                try:
                    result = fn(engine)
                except BaseException as exc:
                    self._hand_off(_settle, fut, None, exc)
                else:
                    self._hand_off(_settle, fut, result, None)
            elif kind == "stop":
                return True


def _serve_steps(owner_ref: weakref.ref[AsyncLLMEngine], engine: LLMEngine,
                 owns_engine: bool) -> None:
    """The step thread's body. It holds its `AsyncLLMEngine` only while there is work, so
    one that is dropped can be collected: the thread then ends, and frees the engine's memory
    if the `AsyncLLMEngine` owned it."""
    while True:
        owner = owner_ref()
        if owner is None:
            if owns_engine:
                engine.shutdown()
            return
        wakeup = owner._wakeup
        if owner._run_until_idle():
            return
        del owner
        wakeup.wait()


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def shallow_copy(stats: EngineStats) -> EngineStats:
    """A shallow copy whose top-level fields can be replaced without touching the original."""
    import msgspec

    return msgspec.structs.replace(stats)
