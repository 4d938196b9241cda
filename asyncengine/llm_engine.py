"""LLMEngine: the synchronous engine. `step()` is the one place where a step happens:
schedule → execute on the device → postprocess (append tokens, detokenize, stop, free).

The offline `LLM` and the `AsyncLLMEngine` (which runs `step()` in its own thread) both
drive this object.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Container, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asyncengine.admission import GrowthEstimate
from asyncengine.block_pool import BlockPool, SwapSpace
from asyncengine.config import EngineArgs
from asyncengine.detokenizer import IncrementalDetokenizer
from asyncengine.errors import InvalidRequestError, RequestError
from asyncengine.kv_calibration import (
    KVScales,
    calibration_token_ids,
    checkpoint_has_kv_scales,
    describe_kv_scales,
    should_calibrate,
)
from asyncengine.model_runner import InflightStep, ModelRunner
from asyncengine.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from asyncengine.prompt_logprobs import PromptLogprobPlan, ScoredRows, to_dicts
from asyncengine.request import ParentRequest, Request, RequestStatus
from asyncengine.request_check import QueueState, RequestLimits, check_request
from asyncengine.sampling_params import RequestOutputKind, SamplingParams
from asyncengine.scheduler import Scheduler, SchedulerOutput
from asyncengine.stats_collect import (
    RateMeter,
    block_map,
    decode_rate,
    device_stats,
    kv_dtype_name,
)
from asyncengine.stats_schema import EngineStats, RequestStats, SpecDecodeStats
from asyncengine.structured_outputs.engine_side import StructuredOutputs
from models.config import ModelConfig
from models.loader import load_model, resolve_model_path

if TYPE_CHECKING:
    from asyncengine.spec_decode.draft_model import DraftModel

logger = logging.getLogger(__name__)


class StepError(RuntimeError):
    """The model step failed; the requests it held were aborted and their blocks freed."""

    def __init__(
        self,
        request_ids: list[str],
        cause: BaseException,
        arrival_times: list[float] | None = None,
    ) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = request_ids
        # Which request of each id (an id may be reused once its request has ended).
        self.arrival_times = arrival_times
        self.cause = cause


def load_tokenizer(path: Path | str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot load a tokenizer from {path} ({e}); pass --tokenizer or skip_tokenizer_init"
        ) from e


class LLMEngine:
    """Owns the model runner, the block pool and the scheduler; one `step()` at a time."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        t0 = time.monotonic()
        self.device = args.resolve_device()
        model_dir = resolve_model_path(args.model, args.load_format)
        self.model_dir = model_dir
        self.model_config = cfg = ModelConfig.from_dir(model_dir, args.quantization)
        self.dtype = args.resolve_dtype(cfg.torch_dtype, self.device)
        self.kv_cache_dtype = args.resolve_kv_cache_dtype(self.dtype, self.device)
        self.max_model_len = self._resolve_max_model_len(cfg)
        self.model_name = args.model or "SmolLM2-135M-Instruct (embedded)"
        torch.manual_seed(args.seed)

        self.tokenizer = None
        if not args.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(args.tokenizer or model_dir)
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids |= self._generation_config_eos(model_dir)
        # A draft model is checked and loaded before the target: a bad one fails fast.
        draft = self._load_draft_model(cfg)

        # Tensor parallelism: spawn ranks 1..N-1 and make this process rank 0, so the model
        # built below is rank 0's shard and the runner mirrors each step on the workers.
        make_runner: Callable[..., ModelRunner] = ModelRunner
        if args.tensor_parallel_size > 1:
            from asyncengine.tp_runner import start_tensor_parallel

            make_runner = start_tensor_parallel(args, model_dir, cfg, self.dtype, self.device)
        model = load_model(
            model_dir,
            cfg,
            dtype=self.dtype,
            device=self.device,
            load_format=args.load_format,
            seed=args.seed,
        )
        wanted = args.async_scheduling
        if wanted is None:
            wanted = self.device.type == "cuda"
        self.async_scheduling = wanted
        self.max_num_batched_tokens = args.max_num_batched_tokens or (
            8192 if self.device.type == "cuda" else 2048
        )
        self.runner = make_runner(
            model,
            cfg,
            device=self.device,
            dtype=self.dtype,
            block_size=args.block_size,
            eos_token_ids=self.eos_token_ids,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        if draft is not None:  # its K/V shares the target's blocks: each block holds both
            self.runner.draft_kv_layout = draft.kv_layout
        # Before the KV pool and CUDA graphs exist: the pass leaves nothing behind.
        self.calibrated_kv_scales = self._set_up_kv_scales(model)
        num_blocks = args.num_kv_blocks or self.runner.profile_num_blocks(
            args.gpu_memory_utilization, self.max_num_batched_tokens, args.cpu_kv_cache_gib
        )
        num_cpu_blocks = 0
        if args.preemption_mode == "swap":
            num_cpu_blocks = max(int(args.swap_space * 2**30) // self.runner.block_bytes(), 1)
            if args.num_kv_blocks:  # tests size both pools small and explicitly
                num_cpu_blocks = min(num_cpu_blocks, 4 * args.num_kv_blocks)
        self.runner.allocate_kv_cache(num_blocks, num_cpu_blocks)
        self.pool = BlockPool(num_blocks, args.block_size, args.enable_prefix_caching)
        swap = SwapSpace(num_cpu_blocks) if num_cpu_blocks else None
        self.scheduler = Scheduler(
            self.pool,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            preemption_mode=args.preemption_mode,
            swap_space=swap,
            growth=GrowthEstimate(conservativeness=args.schedule_conservativeness),
        )
        self.spec_decoder = None
        proposer = None
        # Jump-forward alone needs the coordinator too: forced tokens are verified drafts.
        if args.speculative_config is not None or args.structured_outputs_jump_forward:
            from asyncengine.spec_decode import DraftModelProposer, build_spec_decoder

            if draft is not None:
                assert self.runner.draft_kv_cache is not None
                proposer = DraftModelProposer(
                    draft, self.runner.draft_kv_cache, self.pool, device=self.device,
                    max_num_batched_tokens=self.max_num_batched_tokens,
                )  # fmt: skip
            self.spec_decoder = build_spec_decoder(
                args.speculative_config, self.pool, self.max_model_len, self.async_scheduling,
                proposer,
                jump_forward=args.structured_outputs_jump_forward,
            )  # fmt: skip
        self.request_limits = RequestLimits(
            vocab_size=cfg.vocab_size,
            max_model_len=self.max_model_len,
            num_kv_blocks=num_blocks,
            block_size=args.block_size,
        )
        spec = self.spec_decoder
        self.runner.prepare_for_serving(
            enforce_eager=args.enforce_eager,
            max_num_seqs=args.max_num_seqs,
            max_blocks_per_seq=self.pool.blocks_needed(self.max_model_len),
            verify_rows=0 if spec is None else spec.max_verify_rows,
        )
        if proposer is not None and self.runner.graphs is not None:  # the GPU, not eager
            proposer.capture_graphs(
                args.max_num_seqs, self.pool.blocks_needed(self.max_model_len),
                expanded_rows=0 if spec is None else spec.max_verify_rows,
                head_layers=self.runner.graph_head_layers,
            )  # fmt: skip
        self._prompt_meter = RateMeter()
        self._gen_meter = RateMeter()
        self.num_finished = 0
        self.num_aborted = 0
        # Wall time per phase, summed over steps (benchmarks report where the time goes).
        self.step_timing = {
            "schedule_s": 0.0, "launch_s": 0.0, "wait_s": 0.0, "postprocess_s": 0.0, "steps": 0
        }
        self._inflight: InflightStep | None = None
        self._last_tokens_at: float | None = None  # when a step's tokens last reached the host
        self.is_shut_down = False
        self.structured = StructuredOutputs(
            self.tokenizer, cfg.vocab_size, self.eos_token_ids,
            compile_timeout_s=args.structured_outputs_compile_timeout,
        )  # fmt: skip
        logger.info(
            "engine ready in %.1fs: %s on %s (%s), %d KV blocks of %d tokens (%s, %.2f GiB), "
            "max_model_len %d, max_num_seqs %d",
            time.monotonic() - t0,
            cfg.architecture,
            self.device,
            self.dtype,
            num_blocks,
            args.block_size,
            kv_dtype_name(self.runner.kv_cache_dtype),
            num_blocks * self.runner.block_bytes() / 2**30,
            self.max_model_len,
            args.max_num_seqs,
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def shutdown(self) -> None:
        """Give the engine's memory back: the KV pools, CUDA graphs and weights, and stop the
        tensor-parallel workers, if any. No steps after this; calling it again does nothing.

        Dropping the engine frees the same memory (nothing outside it keeps its tensors); this
        does it at a known moment and hands the freed blocks back to the device at once."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        self._inflight = None
        self.runner.shutdown()
        if self.spec_decoder is not None:
            close = getattr(self.spec_decoder.proposer, "shutdown", None)
            if close is not None:  # a draft model's weights
                close()
        self.structured.shutdown()
        # A cycle nobody has found yet must not keep gigabytes alive until the next collection.
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("the engine was shut down: build a new one")

    # ------------------------------------------------------------ set-up bits
    def _resolve_max_model_len(self, cfg: ModelConfig) -> int:
        limit = cfg.max_position_embeddings
        if cfg.sliding_window and cfg.sliding_window < limit:
            logger.warning("sliding window %d caps max_model_len", cfg.sliding_window)
            limit = cfg.sliding_window
        if self.args.max_model_len is None:
            return limit
        if self.args.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.args.max_model_len} exceeds the model's limit {limit}"
            )
        return self.args.max_model_len

    def _set_up_kv_scales(self, model: torch.nn.Module) -> KVScales | None:
        """An FP8 cache's scales: the checkpoint's, or calibrated on the shipped text as
        `calculate_kv_scales` says (None: only without checkpoint scales), else 1.0. Returns
        the calibrated scales (every rank's), None when nothing was calibrated."""
        if self.args.kv_cache_dtype == "auto":
            return None
        has_scales = checkpoint_has_kv_scales(model)
        if not should_calibrate(self.args.calculate_kv_scales, True, has_scales):
            source = "the checkpoint's" if has_scales else "1.0 (calculate_kv_scales=False)"
            logger.info("FP8 KV cache with KV scales %s", source)
            return None
        if has_scales:
            logger.info("calculate_kv_scales=True: the checkpoint's KV scales are replaced")
        ids = calibration_token_ids(
            self.tokenizer, self.model_config.vocab_size, self.max_model_len
        )
        if self.tokenizer is None:
            logger.info(
                "no tokenizer: KV scales are calibrated on a fixed sequence of %d token ids",
                len(ids),
            )
        scales = self.runner.calibrate_kv_scales(ids)
        logger.info("%s", describe_kv_scales(scales, len(ids)))
        return scales

    def _load_draft_model(self, target: ModelConfig) -> DraftModel | None:
        """The draft model `speculative_config.model` names, checked against the target
        (None without one)."""
        if self.args.speculative_config is None:
            return None
        from asyncengine.spec_decode import SpeculativeConfig, load_draft_model

        spec = SpeculativeConfig.from_dict(self.args.speculative_config)
        if spec.method != "draft_model":
            return None
        return load_draft_model(
            spec, target, self.tokenizer, dtype=self.dtype, device=self.device,
            seed=self.args.seed,
        )  # fmt: skip

    @staticmethod
    def _generation_config_eos(model_dir: Path) -> set[int]:
        import json

        path = model_dir / "generation_config.json"
        if not path.is_file():
            return set()
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is None:
            return set()
        return {eos} if isinstance(eos, int) else set(eos)

    # ---------------------------------------------------------------- requests
    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        *, add_generation_prompt: bool = True,
    ) -> list[int]:
        """The prompt's token ids; `tools` go to templates that take them (others ignore
        them)."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                "chat messages need a tokenizer (skip_tokenizer_init is set)", field="messages"
            )
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "the model's tokenizer has no chat template; send a prompt instead",
                field="messages",
            )
        ids = self.tokenizer.apply_chat_template(
            list(messages), tools=tools, add_generation_prompt=add_generation_prompt,
            tokenize=True,
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(
                "text prompts need a tokenizer (skip_tokenizer_init is set)", field="prompt"
            )
        return list(self.tokenizer.encode(prompt))

    def check_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        in_use: Container[str] | None = None,
        queue: QueueState | None = None,
    ) -> int:
        """The request check (see `request_check`) against this engine's limits; `in_use`
        defaults to the ids this engine holds. Returns the request's max_tokens."""
        if in_use is None:
            in_use = self.scheduler.requests
            if len(self.structured.waiting):  # requests waiting for their grammar count too
                in_use = {*in_use, *self.structured.waiting.request_ids()}
        return check_request(
            request_id,
            prompt_token_ids,
            params,
            self.request_limits,
            in_use=in_use,
            queue=queue,
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Check and queue a request; a refused one raises a `RequestError` (the content
        errors are ValueErrors) and is never queued."""
        self._check_open()
        params = params or SamplingParams()
        text: str | None = None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                text, prompt_token_ids = prompt, self.tokenize(prompt)
            elif isinstance(prompt, list):
                prompt_token_ids = prompt
            else:
                raise InvalidRequestError(
                    "prompt must be a string or a list of token ids", field="prompt"
                )
        else:
            text = prompt if isinstance(prompt, str) else None
        ids = [int(t) for t in prompt_token_ids]
        max_tokens = self.check_request(request_id, ids, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [self._new_sequence(request_id, text, ids, params, max_tokens, arrival, i)
                for i in range(params.n)]
        if len(seqs) > 1:
            ParentRequest.link(seqs)
        if params.structured_outputs is not None and not self.structured.admit(seqs):
            return  # waits for its grammar off the step loop; `step` queues it
        for seq in seqs:
            self.scheduler.add_request(seq)

    def _new_sequence(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        arrival: float,
        index: int,
    ) -> Request:
        """Sample `index` of a request: its own generator (seed + index, as in vLLM),
        detokenizer and logprobs."""
        req = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            max_tokens=max_tokens,
            arrival_time=arrival,
            index=index,
        )
        if params.seed is not None:
            req.generator = torch.Generator(self.device).manual_seed(params.seed + index)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop_strings,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        if params.logprobs is not None:
            req.logprobs = []
        if params.prompt_logprobs is not None and index == 0:
            req.prompt_logprobs = [None]  # nothing predicts the first prompt token
        return req

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self.structured.waiting.remove(rid):
                self.num_aborted += 1
                continue
            seqs = self.scheduler.get_sequences(rid)
            for seq in seqs:
                self.scheduler.finish_request(seq, RequestStatus.FINISHED_ABORTED)
            if seqs:
                self.num_aborted += 1

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self._inflight is not None
            or len(self.structured.waiting) > 0
        )

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests) + len(self.structured.waiting)

    def take_rejected(self) -> list[tuple[str, float, RequestError]]:
        """Requests refused after `add_request` returned (their grammar failed to compile
        or took too long): (request id, arrival time, error), each reported once."""
        return self.structured.take_rejected()

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedule and launch the next step, then resolve the previous one.

        With asynchronous scheduling the outputs returned are those of the step launched by
        the previous call, so the host's work here overlaps the device's; otherwise each call
        launches a step and waits for it.
        """
        self._check_open()
        outputs: list[RequestOutput] = []
        for seqs in self.structured.ready_requests(idle=not self.scheduler.requests):
            for seq in seqs:
                self.scheduler.add_request(seq)
        prev = self._inflight
        if prev is not None and not self._can_overlap(prev):
            self._inflight = None
            outputs += self._resolve(prev)
            prev = None
        t0 = time.perf_counter()
        if self.spec_decoder is not None:
            self.spec_decoder.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched = None
        if not sched.is_empty:
            launched = self._launch(sched, prev)
        else:
            self.runner.release_prelaunch()  # the bet on this step was lost
            if sched.has_block_moves:
                self._move_blocks(sched)
        t2 = time.perf_counter()
        self._inflight = launched
        if prev is not None:
            outputs += self._resolve(prev)
        if launched is not None and not self.async_scheduling:
            self._inflight = None
            outputs += self._resolve(launched)
        timing = self.step_timing
        timing["schedule_s"] += t1 - t0
        timing["launch_s"] += t2 - t1
        timing["steps"] += launched is not None
        return outputs

    def _can_overlap(self, step: InflightStep) -> bool:
        """Whether the next step may be scheduled before `step`'s tokens reach the host: not
        while a request in it may speculate next (its drafts continue its known tokens). A
        request whose sampling reads its output history (penalties, the min_tokens ban)
        takes its token in flight from the device (`model_runner._in_flight`)."""
        spec = self.spec_decoder
        return spec is None or not spec.wants_sync(step.requests)

    def _launch(self, sched: SchedulerOutput, prev: InflightStep | None) -> InflightStep:
        now = time.monotonic()
        for s in sched.scheduled:
            if s.request.metrics.first_scheduled_time is None:
                s.request.metrics.first_scheduled_time = now
        try:
            step = self.runner.launch(sched, prev)
        except Exception as e:
            # Requests swapped out in this step may have lost their copy: abort them too.
            lost = [s.request for s in sched.scheduled]
            lost += [r for r in sched.preempted if r.status == RequestStatus.SWAPPED]
            raise self._step_failed(lost, e) from e
        prompt_tokens = 0
        for s in sched.scheduled:
            req = s.request
            prompt_tokens += max(
                0, min(req.num_prompt_tokens - req.num_computed_tokens, s.num_new_tokens)
            )
            req.num_computed_tokens += s.num_new_tokens
        for req in step.requests:
            req.num_pending_tokens += 1
        self._prompt_meter.add(prompt_tokens, now)
        spec = self.spec_decoder
        if (spec is not None and self.runner.prelaunch is not None
                and spec.next_step_verifies([(s.request, s.num_spec_tokens)
                                             for s in sched.scheduled])):  # fmt: skip
            # The next step's graph goes in now, behind a gate the next launch opens: its
            # launch call leaves the path from this step's verdict to the next step.
            self.runner.prelaunch_next()
        return step

    def _move_blocks(self, sched: SchedulerOutput) -> None:
        """A step that schedules nothing may still move blocks: preemption can swap out every
        running sequence (a parallel request whose samples outgrew the pool together)."""
        try:
            self.runner.move_blocks(sched)
        except Exception as e:
            lost = [r for r in sched.preempted if r.status == RequestStatus.SWAPPED]
            raise self._step_failed(lost, e) from e

    def _resolve(self, step: InflightStep) -> list[RequestOutput]:
        """Wait for a launched step's sampled ids and apply them to its requests."""
        t0 = time.perf_counter()
        try:
            result = step.result()
        except Exception as e:
            raise self._step_failed([*step.scheduled, *step.requests], e) from e
        t1 = time.perf_counter()
        if self.spec_decoder is not None and result.requests:
            # The period from the last step's tokens to these: what this kind of step costs.
            if self._last_tokens_at is not None:
                self.spec_decoder.observe_step(t1 - self._last_tokens_at, verify=bool(result.spec))
            self._last_tokens_at = t1
        now = time.monotonic()
        # Blocks whose tokens are all known are cached now, before a request that ends below
        # frees them; a block completed by the token appended below is cached after it.
        for req in step.scheduled:
            if req.status == RequestStatus.RUNNING:
                self.pool.cache_full_blocks(req)
        if result.prompt_logprobs is not None:
            self._add_prompt_logprobs(*result.prompt_logprobs)
        for req in step.requests:
            req.num_pending_tokens -= 1
        if result.spec and self.spec_decoder is not None:
            # Before the kept tokens are appended: the rejected drafts' slots are rolled back.
            self.spec_decoder.on_verified(result.spec)
        touched: dict[int, list[Request]] = {}  # request -> its sequences with a new token
        generated = 0
        # A verify step lists a request once per kept token, in order; tokens after one that
        # finishes the request are dropped, as later steps would never have run.
        for i, (req, token) in enumerate(zip(result.requests, result.token_ids, strict=True)):
            if req.is_finished:  # aborted while its step was in flight
                continue
            generated += 1
            try:
                self._append_token(req, token, result.logprobs[i] if result.logprobs else None, now)
                if req.status == RequestStatus.RUNNING:
                    self.pool.cache_full_blocks(req)
            except Exception as e:  # one request's failure must not hurt the others
                logger.exception("postprocessing failed for request %s", req.request_id)
                req.error = f"{type(e).__name__}: {e}"
                self._finish(req, RequestStatus.FINISHED_ABORTED)
            seqs = touched.setdefault(id(req.siblings[0]), [])
            if req not in seqs:
                seqs.append(req)
        outputs: list[RequestOutput] = []
        for seqs in touched.values():
            out = self._make_output(seqs)
            if out is not None:
                outputs.append(out)
        self._gen_meter.add(generated, now)
        timing = self.step_timing
        timing["wait_s"] += t1 - t0
        timing["postprocess_s"] += time.perf_counter() - t1
        return outputs

    def _add_prompt_logprobs(self, scored: ScoredRows, plan: PromptLogprobPlan) -> None:
        tok = self.tokenizer
        decode = None
        if tok is not None:
            def decode(ids: list[int]) -> list[str]:
                return list(tok.batch_decode([[t] for t in ids]))
        for req, entries in to_dicts(scored, plan, decode):
            if req.prompt_logprobs is not None and not req.is_finished:
                req.prompt_logprobs.extend(entries)

    def _step_failed(self, requests: list[Request], cause: Exception) -> StepError:
        """Abort the requests a failed step held (each once) and describe the failure."""
        ids: list[str] = []
        arrivals: list[float] = []
        seen: set[int] = set()
        for r in requests:
            # A parallel request fails whole: its other sequences are aborted too.
            key = id(r.siblings[0])
            if key in seen:
                continue
            seen.add(key)
            ids.append(r.request_id)
            arrivals.append(r.arrival_time)
            live = [s for s in r.siblings if not s.is_finished]
            for s in live:
                self.scheduler.finish_request(s, RequestStatus.FINISHED_ABORTED)
            if live:
                self.num_aborted += 1
        logger.error("engine step failed (%r); aborted %d request(s)", cause, len(ids))
        return StepError(ids, cause, arrivals)

    def _append_token(
        self, req: Request, token: int, logprobs: dict[int, float] | None, now: float
    ) -> None:
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        req.append_token(token)
        if req.grammar is not None:  # a no-op when the mask of a later step took it already
            req.grammar.catch_up(req.output_token_ids)
        if req.logprobs is not None and logprobs is not None:
            req.logprobs.append(logprobs)
            req.cumulative_logprob += logprobs.get(token, 0.0)
        params = req.params
        min_ok = req.num_output_tokens >= params.min_tokens
        # A stopping token ends the request before its text is rendered (as in vLLM).
        if min_ok and not params.ignore_eos and token in self.eos_token_ids:
            self._finish(req, RequestStatus.FINISHED_STOPPED)
            return
        if min_ok and token in (params.stop_token_ids or ()):
            req.stop_reason = token
            self._finish(req, RequestStatus.FINISHED_STOPPED)
            return
        if req.detokenizer is not None:
            req.detokenizer.append([token])
            if req.detokenizer.finished_by_stop:
                req.stop_reason = req.detokenizer.stop_reason
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                return
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            self._finish(req, RequestStatus.FINISHED_LENGTH)
        elif req.grammar is not None and req.grammar.is_terminated:
            self._finish(req, RequestStatus.FINISHED_STOPPED)  # complete; nothing may follow

    def _finish(self, req: Request, status: RequestStatus) -> None:
        detok = req.detokenizer
        if detok is not None and not detok.finished_by_stop:
            # Text held back for a stop string that never came belongs to the output.
            try:
                detok.flush()
            except Exception:
                logger.exception("detokenizer flush failed for %s", req.request_id)
        req.metrics.finished_time = time.monotonic()
        self.scheduler.finish_request(req, status)
        if req.parent is None or req.parent.is_finished:  # a request, not each sample
            self.num_finished += 1

    def _make_output(self, touched: list[Request]) -> RequestOutput | None:
        """The output of the request whose sequences in `touched` got a token this step:
        DELTA carries those sequences' news, CUMULATIVE and FINAL_ONLY all n sequences."""
        first = touched[0]
        group = first.parent
        seqs = group.seqs if group is not None else touched
        kind = first.params.output_kind
        finished = group.is_finished if group is not None else first.is_finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        shown = touched if kind == RequestOutputKind.DELTA else seqs
        return RequestOutput(
            prompt_logprobs=self._prompt_logprobs_of(seqs[0], kind),
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(seq, kind) for seq in sorted(shown, key=_by_index)],
            finished=finished,
            metrics=seqs[0].metrics,
            error=next((s.error for s in seqs if s.error is not None), None),
        )

    @staticmethod
    def _prompt_logprobs_of(first: Request, kind: RequestOutputKind) -> PromptLogprobs | None:
        """The request's prompt logprobs for this output: whole, and once for DELTA."""
        lps = first.prompt_logprobs
        if lps is None or (kind == RequestOutputKind.DELTA and first.prompt_logprobs_sent):
            return None
        first.prompt_logprobs_sent = True
        return lps if kind == RequestOutputKind.FINAL_ONLY else list(lps)

    @staticmethod
    def _completion(req: Request, kind: RequestOutputKind) -> CompletionOutput:
        text = req.detokenizer.output_text if req.detokenizer is not None else ""
        token_ids = req.output_token_ids
        logprobs = req.logprobs
        if kind == RequestOutputKind.DELTA:
            text_delta = text[req.sent_text_len :]
            ids_delta = token_ids[req.sent_token_len :]
            lp_delta = logprobs[req.sent_token_len :] if logprobs is not None else None
            req.sent_text_len, req.sent_token_len = len(text), len(token_ids)
            text, token_ids, logprobs = text_delta, ids_delta, lp_delta
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(
            index=req.index,
            text=text,
            token_ids=token_ids,
            finish_reason=req.status.value if req.is_finished else None,
            stop_reason=req.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
        )

    # ------------------------------------------------------------------ state
    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def get_stats(self, include_requests: bool = True) -> EngineStats:
        now = time.monotonic()
        sched, pool = self.scheduler, self.pool
        reqs: list[RequestStats] = []
        if include_requests:
            queues = (
                ("running", sched.running),
                ("swapped", sched.swapped),
                ("waiting", sched.waiting),
            )
            for state, queue in queues:
                for r in list(queue)[:200]:
                    reqs.append(
                        RequestStats(
                            request_id=r.request_id,
                            state=state,  # type: ignore[arg-type]
                            prompt_tokens=r.num_prompt_tokens,
                            generated_tokens=r.num_output_tokens,
                            tokens_per_s=decode_rate(
                                r.num_output_tokens, r.metrics.first_token_time, now
                            ),
                            age_s=now - r.arrival_time,
                        )
                    )
        queries = pool.prefix_queries
        return EngineStats(
            timestamp=time.time(),
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_cached=pool.num_cached_free_blocks,
            kv_blocks_reserved=min(sched.reserved_blocks(), pool.num_free_blocks),
            kv_block_size=pool.block_size,
            kv_cache_dtype=kv_dtype_name(self.runner.kv_cache_dtype),
            kv_block_map=block_map(pool),
            prefix_cache_hit_rate=pool.prefix_hits / queries if queries else 0.0,
            prefix_cache_queries=queries,
            prefix_cache_hits=pool.prefix_hits,
            num_preemptions=sched.num_preemptions,
            num_swaps_out=sched.num_swaps_out,
            num_swaps_in=sched.num_swaps_in,
            prompt_tokens_total=self._prompt_meter.total,
            generation_tokens_total=self._gen_meter.total,
            prompt_tokens_per_s=self._prompt_meter.rate(now),
            generation_tokens_per_s=self._gen_meter.rate(now),
            num_requests_finished=self.num_finished,
            num_requests_aborted=self.num_aborted,
            requests=reqs,
            device=device_stats(self.device.type, self.device.index or 0),
            spec_decode=self._spec_stats(),
            model=self.model_name,
        )

    def _spec_stats(self) -> SpecDecodeStats | None:
        if self.spec_decoder is None or self.spec_decoder.config is None:
            return None
        m = self.spec_decoder.metrics
        return SpecDecodeStats(
            num_drafts=m.num_drafts,
            num_draft_tokens=m.num_draft_tokens,
            num_accepted_tokens=m.num_accepted_tokens,
            accepted_per_pos=list(m.accepted_per_pos),
            acceptance_rate=m.acceptance_rate,
            mean_acceptance_length=m.mean_acceptance_length,
        )


def _by_index(req: Request) -> int:
    return req.index
