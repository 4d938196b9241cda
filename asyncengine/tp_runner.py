"""Tensor-parallel model runner: rank 0 schedules and broadcasts each step, ranks 1..N-1
mirror the forward pass on their shard of the weights and of the KV cache.

Rank 0 runs `TensorParallelModelRunner` (a `ModelRunner`); every message to the workers
starts with one fixed-size int64 header on the control group:

- STEP: the header carries the step's `StepHeader` (sizes, host hints, the decode plan, the
  counts of the rare block moves, which follow as a small host vector); then rank 0
  broadcasts the step's packed device buffer, the very buffer its own inputs are views of,
  on the default group (NCCL on the GPU, so it never leaves the device). The workers unpack
  it with the same field list (`asyncengine.step_buffer`). Nothing is pickled per step.
- CALL: a set-up call (`calibrate_kv_scales`, `profile_num_blocks`, `allocate_kv_cache`,
  `prepare_for_serving`), pickled as (method name, args, kwargs); every rank runs that
  `ModelRunner` method and rank 0 gathers the results.

Each worker runs the same `ModelRunner.run_model` (so CUDA graphs, captured for the same
sizes and plans on every rank, replay in lockstep) and the LM head's gather when rows need
logits; only rank 0 turns logits into tokens. The KV pool has the same number of blocks on
every rank: the minimum of what fits on each.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from asyncengine.config import EngineArgs
from asyncengine.distributed import (
    CMD_STOP,
    ProcessGroups,
    TensorParallelWorkerError,
    WorkerGroup,
    broadcast_header,
    broadcast_host_ints,
    receive_header,
)
from asyncengine.kv_calibration import KVScales
from asyncengine.model_runner import InflightStep, ModelRunner, StepInputs, step_inputs
from asyncengine.scheduler import SchedulerOutput
from asyncengine.step_buffer import StepHeader, layout, unpack
from models.config import ModelConfig
from models.loader import load_model

logger = logging.getLogger(__name__)

CMD_STEP, CMD_CALL = 1, 2


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its shard; pickled once when it is spawned."""

    model_dir: str
    model_config: ModelConfig
    dtype: torch.dtype
    load_format: str
    seed: int


def check_tp_compatible(cfg: ModelConfig, tp: int) -> None:
    """Fail before any process starts if the model cannot be split `tp` ways."""
    problems = []
    if cfg.num_attention_heads % tp:
        problems.append(f"num_attention_heads={cfg.num_attention_heads}")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    kv = cfg.num_key_value_heads
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} (nor does {tp} divide by it)")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp} does not divide " + ", ".join(problems))


def start_tensor_parallel(
    args: EngineArgs,
    model_dir: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> Callable[..., ModelRunner]:
    """Spawn ranks 1..N-1 and make this process rank 0 (its TP state is set, so the model
    it builds next is rank 0's shard). Returns the runner class to build, workers bound."""
    tp = args.tensor_parallel_size
    check_tp_compatible(cfg, tp)
    spec = WorkerSpec(str(model_dir), cfg, dtype, args.load_format, args.seed)
    workers = WorkerGroup(tp, device, worker_main, spec)
    return functools.partial(TensorParallelModelRunner, workers=workers)


class TensorParallelModelRunner(ModelRunner):
    """Rank 0's runner: a `ModelRunner` whose every model call is mirrored by the workers."""

    # The workers unpack each step from the broadcast buffer: no step skips it.
    stage_small_steps = False

    def __init__(
        self, model: nn.Module, model_config: ModelConfig, *, workers: WorkerGroup, **kwargs: Any
    ) -> None:
        super().__init__(model, model_config, **kwargs)
        self.workers = workers
        with self._guard("start"):
            workers.wait_ready()
            # The workers build the same runner (own device, no sampling): sent once.
            worker_kwargs = {k: v for k, v in kwargs.items() if k not in ("device",)}
            worker_kwargs["eos_token_ids"] = set()
            dist.broadcast_object_list([worker_kwargs], src=0, group=workers.groups.control)

    def stop_workers(self) -> None:
        """Stop ranks 1..N-1 (also done at exit); this rank's memory stays."""
        self.workers.close()

    def shutdown(self) -> None:
        self.stop_workers()
        super().shutdown()

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Turn a failed collective into a clear error naming the dead worker, and retire
        the group after any failure: the ranks' collectives no longer line up."""
        try:
            self.workers.raise_if_failed()
            yield
            # A result computed while a peer was dying is not to be trusted.
            self.workers.raise_if_failed()
        except TensorParallelWorkerError:
            self.workers.close()
            raise
        except BaseException as e:  # an interrupt mid-step leaves the ranks out of step too
            died = self.workers.failure(wait_s=5.0 if isinstance(e, Exception) else 0.0)
            self.workers.mark_broken(f"{what} failed on rank 0: {e!r}")
            self.workers.close()
            if died is not None and isinstance(e, Exception):
                raise TensorParallelWorkerError(died) from e
            raise

    def _call_all(self, name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `ModelRunner` method `name` on every rank, rank 0 included; the results in
        rank order."""
        groups = self.workers.groups
        broadcast_header(groups, [CMD_CALL])
        dist.broadcast_object_list([(name, args, kwargs)], src=0, group=groups.control)
        local = getattr(ModelRunner, name)(self, *args, **kwargs)
        results: list[Any] = [None] * groups.world_size
        dist.gather_object(local, results, dst=0, group=groups.control)
        return results

    # ------------------------------------------------------------ KV memory
    def profile_num_blocks(
        self, gpu_memory_utilization: float, max_num_batched_tokens: int, cpu_cache_gib: float
    ) -> int:
        with self._guard("profiling"):
            counts = self._call_all(
                "profile_num_blocks",
                gpu_memory_utilization,
                max_num_batched_tokens,
                cpu_cache_gib,
            )
            return min(counts)

    def calibrate_kv_scales(self, token_ids: list[int]) -> KVScales:
        """Every rank calibrates its own KV heads from rank 0's ids; the scales of all ranks,
        each layer's concatenated in rank order (a KV head that several ranks hold appears
        once per rank)."""
        with self._guard("KV scale calibration"):
            per_rank = self._call_all("calibrate_kv_scales", token_ids)
        return [
            (torch.cat([r[i][0] for r in per_rank]), torch.cat([r[i][1] for r in per_rank]))
            for i in range(len(per_rank[0]))
        ]

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        with self._guard("KV cache allocation"):
            self._call_all("allocate_kv_cache", num_blocks, num_cpu_blocks)

    def prepare_for_serving(
        self, *, enforce_eager: bool, max_num_seqs: int, max_blocks_per_seq: int,
        verify_rows: int = 0,
    ) -> None:  # fmt: skip
        with self._guard("CUDA graph capture"):
            self._call_all(
                "prepare_for_serving",
                enforce_eager=enforce_eager,
                max_num_seqs=max_num_seqs,
                max_blocks_per_seq=max_blocks_per_seq,
                verify_rows=verify_rows,
            )

    # --------------------------------------------------------------- a step
    def move_blocks(self, sched: SchedulerOutput) -> None:
        with self._guard("block moves"):
            self._call_all("apply_block_moves", sched.block_moves())

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, prev: InflightStep | None = None) -> InflightStep:
        """Rank 0's step: its inputs are prepared, broadcast, then run. With a step in
        flight (asynchronous scheduling) its sampled ids are filled into `input_ids` on rank
        0's device before the broadcast, which the device orders after that step's
        sampling: the workers never need them."""
        with self._guard("step"):
            self.apply_block_moves(sched)
            inputs = self.prepare_inputs(sched, prev)
            send_step(self.workers.groups, inputs, sched)
            step = self.launch_prepared(inputs, sched, prev)
        # The wait for the step's ids can fail too (a collective of a dead peer).
        step.guard = functools.partial(self._guard, "step")
        return step


# ------------------------------------------------------------------ wire format
def send_step(groups: ProcessGroups, inputs: StepInputs, sched: SchedulerOutput) -> None:
    """Rank 0: the step's header, its block moves and its packed device buffer."""
    header = inputs.header
    broadcast_header(groups, [CMD_STEP, *header.to_ints()])
    if header.num_moves:
        moves = (sched.blocks_to_swap_out, sched.blocks_to_swap_in, sched.blocks_to_copy)
        broadcast_host_ints(groups, [x for m in moves for pair in m for x in pair])
    dist.broadcast(inputs.buffer, src=0)


def receive_step(groups: ProcessGroups, values: list[int]) -> tuple[StepInputs, SchedulerOutput]:
    """A worker: the step announced by header `values` (command first), and its moves."""
    header = StepHeader.from_ints(values[1:])
    moves = SchedulerOutput()
    if header.num_moves:
        ints = broadcast_host_ints(groups, 2 * header.num_moves)
        pairs = [(ints[i], ints[i + 1]) for i in range(0, len(ints), 2)]
        n_out, n_in = header.num_swap_out, header.num_swap_in
        moves.blocks_to_swap_out = pairs[:n_out]
        moves.blocks_to_swap_in = pairs[n_out : n_out + n_in]
        moves.blocks_to_copy = pairs[n_out + n_in :]
    _, size = layout(header)
    buffer = torch.empty(size, dtype=torch.uint8, device=groups.device)
    dist.broadcast(buffer, src=0)
    return step_inputs(header, buffer, unpack(header, buffer), []), moves


# ------------------------------------------------------------------ workers
def worker_main(groups: ProcessGroups, spec: WorkerSpec, ready: Callable[[], None]) -> None:
    """Body of ranks 1..N-1 (their TP state is already set): build the shard, then serve."""
    model = load_model(
        Path(spec.model_dir),
        spec.model_config,
        dtype=spec.dtype,
        device=groups.device,
        load_format=spec.load_format,
        seed=spec.seed,
    )
    ready()
    received: list[Any] = [None]
    dist.broadcast_object_list(received, src=0, group=groups.control)
    runner = ModelRunner(model, spec.model_config, device=groups.device, **received[0])
    TensorParallelWorker(runner, groups).serve()


class TensorParallelWorker:
    """Executes rank 0's commands on this rank's shard until told to stop."""

    def __init__(self, runner: ModelRunner, groups: ProcessGroups) -> None:
        self.runner = runner
        self.groups = groups

    @torch.inference_mode()
    def serve(self) -> None:
        while True:
            header = receive_header(self.groups)
            cmd = header[0]
            if cmd == CMD_STOP:
                return
            if cmd == CMD_STEP:
                self.step(header)
            elif cmd == CMD_CALL:
                self.call()
            else:
                raise RuntimeError(f"unknown tensor-parallel command {cmd}")

    def call(self) -> None:
        """Run the `ModelRunner` method rank 0 names; rank 0 gathers the result."""
        received: list[Any] = [None]
        dist.broadcast_object_list(received, src=0, group=self.groups.control)
        name, args, kwargs = received[0]
        result = getattr(self.runner, name)(*args, **kwargs)
        dist.gather_object(result, None, dst=0, group=self.groups.control)

    def step(self, header: list[int]) -> None:
        inputs, moves = receive_step(self.groups, header)
        self.runner.apply_block_moves(moves)
        hidden = self.runner.run_model(inputs)
        if inputs.header.num_prompt_rows:
            self.runner.prompt_lm_head(inputs)
        if inputs.logits_indices.numel():
            # The LM head is vocab-parallel: every rank joins the gather; rank 0 samples.
            self.runner.model.compute_logits(hidden)  # type: ignore[operator]
