"""The tensor-parallel process machinery on CPU (gloo): start, collectives, clean stop, and
clear errors, never hangs, when a worker fails to start or dies."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asyncengine.distributed import (
    CMD_STOP,
    NO_MULTICAST_ENV,
    ProcessGroups,
    TensorParallelWorkerError,
    WorkerGroup,
    broadcast_header,
    receive_header,
)
from models.parallel import get_tp_rank, get_tp_size

CPU = torch.device("cpu")


def _serve_sums(groups: ProcessGroups, spec: Any, ready: Callable[[], None]) -> None:
    """Worker body: report the environment, then join one all-reduce per header."""
    env_ok = all(os.environ.get(k) == v for k, v in NO_MULTICAST_ENV.items())
    tp_ok = (get_tp_rank(), get_tp_size()) == (groups.rank, groups.world_size)
    ready()
    while True:
        header = receive_header(groups)
        if header[0] == CMD_STOP:
            return
        x = torch.tensor([float(groups.rank + 1), float(env_ok and tp_ok), float(spec)])
        dist.all_reduce(x)


def _fail_on_start(groups: ProcessGroups, spec: Any, ready: Callable[[], None]) -> None:
    raise ValueError(f"rank {groups.rank} cannot load its shard: {spec}")


def test_workers_join_collectives_and_stop_cleanly() -> None:
    group = WorkerGroup(2, CPU, _serve_sums, 7)
    try:
        group.wait_ready()
        assert (get_tp_rank(), get_tp_size()) == (0, 2)
        broadcast_header(group.groups, [1])
        x = torch.tensor([1.0, 1.0, 7.0])
        dist.all_reduce(x)
        # ranks 1 + 2; the worker saw NVLS off and its TP state; both hold the spec.
        assert x.tolist() == [3.0, 2.0, 14.0]
    finally:
        group.close()
    assert [p.exitcode for p in group._state.procs] == [0]
    assert not dist.is_initialized()
    assert (get_tp_rank(), get_tp_size()) == (0, 1)
    with pytest.raises(TensorParallelWorkerError, match="shut down"):
        group.raise_if_failed()


def test_worker_failing_to_start_raises_its_traceback() -> None:
    group = WorkerGroup(2, CPU, _fail_on_start, "bad checkpoint")
    try:
        with pytest.raises(TensorParallelWorkerError) as err:
            group.wait_ready()
    finally:
        group.close()
    message = str(err.value)
    assert "worker rank 1" in message and "exited with code 1" in message
    assert "ValueError: rank 1 cannot load its shard: bad checkpoint" in message
    assert not dist.is_initialized()
    assert get_tp_size() == 1


def test_worker_dying_mid_collective_is_named_not_hung() -> None:
    group = WorkerGroup(2, CPU, _serve_sums, 0)
    try:
        group.wait_ready()
        os.kill(group.pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        # Rank 0 reaches the collective the dead worker will never join.
        with pytest.raises(RuntimeError):
            broadcast_header(group.groups, [1])
            dist.all_reduce(torch.zeros(3))
        failure = group.failure(wait_s=5.0)
        assert failure is not None and "rank 1" in failure and "SIGKILL" in failure
        assert time.monotonic() - t0 < 10
        with pytest.raises(TensorParallelWorkerError, match="SIGKILL"):
            group.raise_if_failed()
    finally:
        group.close()
    assert not dist.is_initialized()
    assert get_tp_size() == 1
