"""Tensor-parallel model runner: rank 0 schedules and broadcasts each step, ranks 1..N-1
mirror the forward pass on their shard of the weights and of the KV cache.

Rank 0 runs `TensorParallelModelRunner` (a `ModelRunner`): every call that runs the model
or touches the KV cache is first announced to the workers with one fixed-size header on the
control group. A step then sends one flat int64 tensor on the default group (NCCL on the
GPU, so it never leaves the device) holding the flattened batch; the rare block moves (swap
and copy-on-write) follow the header as a small host vector. Nothing is pickled per step.

    header = [STEP, T, B, L, W, max_query_len, decode_only, #swap_out, #swap_in, #copy,
              max_seq_len]
    flat   = input_ids[T] positions[T] slot_mapping[T] query_start_loc[B+1] seq_lens[B]
             logits_indices[L] block_tables[B*W]

Each worker runs the same `ModelRunner.run_model` (so CUDA graphs, captured for the same
sizes on every rank, replay in lockstep) and the LM head's gather when rows need logits;
only rank 0 turns logits into tokens. The KV pool has the same number of blocks on every
rank: the minimum of what fits on each (an all-reduce MIN over the profiled counts).
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
    min_over_ranks,
    receive_header,
)
from asyncengine.model_runner import InflightStep, ModelRunner, StepInputs
from asyncengine.scheduler import SchedulerOutput
from models.config import ModelConfig
from models.forward_context import AttentionMetadata
from models.loader import load_model

logger = logging.getLogger(__name__)

CMD_STEP, CMD_PROFILE, CMD_ALLOCATE, CMD_PREPARE = 1, 2, 3, 4
_MILLI = 1_000_000  # fixed-point scale for the float arguments of PROFILE


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

    def shutdown(self) -> None:
        self.workers.close()

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

    def _command(self, *values: int) -> None:
        broadcast_header(self.workers.groups, values)

    # ------------------------------------------------------------ KV memory
    def profile_num_blocks(
        self, gpu_memory_utilization: float, max_num_batched_tokens: int, cpu_cache_gib: float
    ) -> int:
        with self._guard("profiling"):
            self._command(
                CMD_PROFILE,
                max_num_batched_tokens,
                round(gpu_memory_utilization * _MILLI),
                round(cpu_cache_gib * _MILLI),
            )
            local = super().profile_num_blocks(
                gpu_memory_utilization, max_num_batched_tokens, cpu_cache_gib
            )
            return min_over_ranks(local, self.device)

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        with self._guard("KV cache allocation"):
            self._command(CMD_ALLOCATE, num_blocks, num_cpu_blocks)
            super().allocate_kv_cache(num_blocks, num_cpu_blocks)

    def prepare_for_serving(
        self, *, enforce_eager: bool, max_num_seqs: int, max_blocks_per_seq: int
    ) -> None:
        with self._guard("CUDA graph capture"):
            self._command(CMD_PREPARE, int(enforce_eager), max_num_seqs, max_blocks_per_seq)
            super().prepare_for_serving(
                enforce_eager=enforce_eager,
                max_num_seqs=max_num_seqs,
                max_blocks_per_seq=max_blocks_per_seq,
            )

    # --------------------------------------------------------------- a step
    def prepare_inputs(
        self, sched: SchedulerOutput, prev: InflightStep | None = None
    ) -> StepInputs:
        """Rank 0's inputs, broadcast. With a step in flight (asynchronous scheduling) its
        sampled ids are filled into `input_ids` on rank 0's device before the broadcast,
        which the device orders after that step's sampling: the workers never need them."""
        inputs = super().prepare_inputs(sched, prev)
        send_step(self.workers.groups, inputs, sched)
        return inputs

    def launch(self, sched: SchedulerOutput, prev: InflightStep | None = None) -> InflightStep:
        with self._guard("step"):
            step = super().launch(sched, prev)
        # The wait for the step's ids can fail too (a collective of a dead peer).
        step.guard = functools.partial(self._guard, "step")
        return step


# ------------------------------------------------------------------ wire format
def send_step(groups: ProcessGroups, inputs: StepInputs, sched: SchedulerOutput) -> None:
    meta = inputs.meta
    b, w = meta.block_tables.shape
    moves = (sched.blocks_to_swap_out, sched.blocks_to_swap_in, sched.blocks_to_copy)
    max_q = -1 if meta.max_query_len is None else meta.max_query_len
    header = [
        CMD_STEP,
        inputs.input_ids.numel(),
        b,
        inputs.logits_indices.numel(),
        w,
        max_q,
        int(meta.decode_only),
        *(len(m) for m in moves),
        -1 if meta.max_seq_len is None else meta.max_seq_len,
    ]
    broadcast_header(groups, header)
    if any(moves):
        broadcast_host_ints(groups, [x for m in moves for pair in m for x in pair])
    i64 = torch.int64
    flat = torch.cat(
        [
            inputs.input_ids.to(i64),
            inputs.positions.to(i64),
            meta.slot_mapping.to(i64),
            meta.query_start_loc.to(i64),
            meta.seq_lens.to(i64),
            inputs.logits_indices.to(i64),
            meta.block_tables.reshape(-1).to(i64),
        ]
    )
    dist.broadcast(flat, src=0)


def receive_step(groups: ProcessGroups, header: list[int]) -> tuple[StepInputs, SchedulerOutput]:
    t, b, n_logits, w, max_q, decode_only, n_out, n_in, n_copy, max_len = header[1:11]
    moves = SchedulerOutput()
    if n_out or n_in or n_copy:
        ints = broadcast_host_ints(groups, 2 * (n_out + n_in + n_copy))
        pairs = [(ints[i], ints[i + 1]) for i in range(0, len(ints), 2)]
        moves.blocks_to_swap_out = pairs[:n_out]
        moves.blocks_to_swap_in = pairs[n_out : n_out + n_in]
        moves.blocks_to_copy = pairs[n_out + n_in :]
    sizes = [t, t, t, b + 1, b, n_logits, b * w]
    flat = torch.empty(sum(sizes), dtype=torch.int64, device=groups.device)
    dist.broadcast(flat, src=0)
    parts = flat.split(sizes)
    meta = AttentionMetadata(
        slot_mapping=parts[2],
        query_start_loc=parts[3].to(torch.int32),
        seq_lens=parts[4].to(torch.int32),
        block_tables=parts[6].view(b, w).to(torch.int32),
        max_query_len=None if max_q < 0 else max_q,
        decode_only=bool(decode_only),
        max_seq_len=None if max_len < 0 else max_len,
    )
    inputs = StepInputs(
        input_ids=parts[0],
        positions=parts[1],
        meta=meta,
        logits_indices=parts[5],
        sampling_requests=[],
    )
    return inputs, moves


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
            elif cmd == CMD_PROFILE:
                local = self.runner.profile_num_blocks(
                    header[2] / _MILLI, header[1], header[3] / _MILLI
                )
                min_over_ranks(local, self.groups.device)
            elif cmd == CMD_ALLOCATE:
                self.runner.allocate_kv_cache(header[1], header[2])
            elif cmd == CMD_PREPARE:
                self.runner.prepare_for_serving(
                    enforce_eager=bool(header[1]),
                    max_num_seqs=header[2],
                    max_blocks_per_seq=header[3],
                )
            else:
                raise RuntimeError(f"unknown tensor-parallel command {cmd}")

    def step(self, header: list[int]) -> None:
        inputs, moves = receive_step(self.groups, header)
        self.runner.apply_block_moves(moves)
        hidden = self.runner.run_model(inputs)
        if inputs.logits_indices.numel():
            # The LM head is vocab-parallel: every rank joins the gather; rank 0 samples.
            self.runner.model.compute_logits(hidden)  # type: ignore[operator]
