"""Process groups and worker processes for tensor parallelism on one host.

Rank 0 is the engine's own process; `WorkerGroup` spawns ranks 1..N-1 (spawn context, one
process per rank, rank r on cuda:r), joins them in two process groups and watches them:

- the default group (NCCL on GPUs, gloo on CPU) carries the model's collectives and the
  step's flat tensor, with a finite timeout so a stuck peer ends in an error, not a hang;
- a gloo "control" group carries the small per-step header from rank 0. Workers wait on it
  between steps for as long as the engine idles, so its timeout is effectively unlimited.

A worker that dies is noticed from its process sentinel; rank 0 then raises
`TensorParallelWorkerError` with the worker's exit code and traceback (sent over a pipe)
instead of waiting on a collective that will never complete. The same pipe is the worker's
lifeline: when rank 0's process goes away the pipe closes and the worker exits.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm.auto import tqdm

from asyncengine_kernels import envs
from models.parallel import set_tensor_parallel

logger = logging.getLogger(__name__)

# NVLink multicast (NVLS) stays off in every rank: set before any communicator exists.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
HEADER_LEN = 16
CMD_STOP = 0
# Workers block on the control group between steps, however long the engine idles.
IDLE_TIMEOUT = datetime.timedelta(days=365)
_HOST = "127.0.0.1"


def collective_timeout() -> datetime.timedelta:
    """Limit on one collective and on the rendezvous (ASYNCENGINE_TP_TIMEOUT_S, default 600).

    Generous because the first steps on a GPU include kernel compilation on every rank."""
    return datetime.timedelta(seconds=envs.tp_timeout_s())


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def cpu_threads_per_rank(world_size: int) -> int:
    # Ranks on the CPU share the host's cores; oversubscribed threads spin against each other.
    return max(1, (os.cpu_count() or 1) // world_size)


def set_process_env() -> None:
    """Environment every rank needs before its first communicator is created."""
    os.environ.update(NO_MULTICAST_ENV)
    if sys.platform.startswith("linux"):
        # Keep gloo's sockets on loopback: all ranks live on this host.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


class TensorParallelWorkerError(RuntimeError):
    """A tensor-parallel worker died or the group broke; the engine cannot step any more."""


@dataclass
class ProcessGroups:
    """This rank's view of the tensor-parallel world."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    control: dist.ProcessGroup
    store: dist.Store = field(repr=False)


def init_process_groups(
    rank: int, world_size: int, device: torch.device, store: dist.Store
) -> ProcessGroups:
    """Join the default group (the model's collectives) and the gloo control group, and set
    the model-building TP state (`models.parallel`) for this rank."""
    backend = backend_for(device)
    extra: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=collective_timeout(),
        **extra,
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    set_tensor_parallel(rank, world_size)
    return ProcessGroups(rank, world_size, device, backend, control, store)


def destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    set_tensor_parallel(0, 1)


# ---------------------------------------------------------------- per-step messages
def broadcast_header(groups: ProcessGroups, values: Sequence[int]) -> None:
    """Rank 0: send one fixed-size int64 header (command and sizes) to every worker."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[: len(values)] = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(header, src=0, group=groups.control)


def receive_header(groups: ProcessGroups) -> list[int]:
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, src=0, group=groups.control)
    return header.tolist()


def broadcast_host_ints(groups: ProcessGroups, values: list[int] | int) -> list[int]:
    """A variable-length int64 vector on the control group (rank 0 passes values, workers
    the length they learnt from the header); it stays on the host, so no device sync."""
    if isinstance(values, int):
        data = torch.empty(values, dtype=torch.int64)
    else:
        data = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(data, src=0, group=groups.control)
    return data.tolist()


# ----------------------------------------------------------------- worker side
WorkerEntry = Callable[[ProcessGroups, Any, Callable[[], None]], None]


def _watch_parent(conn: Connection) -> None:
    """Exit as soon as rank 0 goes away: its end of the pipe closes and recv raises."""
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        os._exit(1)


def _worker_bootstrap(
    entry: WorkerEntry,
    rank: int,
    world_size: int,
    port: int,
    device_type: str,
    spec: Any,
    conn: Connection,
) -> None:
    set_process_env()
    os.environ["TQDM_DISABLE"] = "1"  # rank 0 shows the progress bars
    # tqdm's default lock is a named semaphore, which the fast exit below would leak.
    tqdm.set_lock(threading.RLock())
    threading.Thread(target=_watch_parent, args=(conn,), daemon=True).start()
    try:
        device = rank_device(device_type, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(cpu_threads_per_rank(world_size))
        conn.send(("started", None))
        store = dist.TCPStore(
            _HOST, port, world_size, is_master=False, timeout=collective_timeout()
        )
        groups = init_process_groups(rank, world_size, device, store)
        entry(groups, spec, lambda: conn.send(("ready", None)))
        destroy_process_groups()
    except BaseException:
        message = traceback.format_exc()
        with contextlib.suppress(OSError):
            conn.send(("error", message))
        sys.stderr.write(f"tensor-parallel worker rank {rank} failed:\n{message}")
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Interpreter teardown (torch, CUDA, Triton) only costs time in a process ending anyway.
    os._exit(0)


# ------------------------------------------------------------------- rank 0 side
def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _State:
    """Everything shutdown needs, kept apart from WorkerGroup so a finalizer can use it."""

    def __init__(self) -> None:
        self.procs: list[Any] = []  # index i holds rank i + 1
        self.conns: list[Connection] = []
        self.messages: list[list[tuple[str, Any]]] = []
        self.groups: ProcessGroups | None = None
        self.failure: str | None = None
        self.stopping = False
        self.closed = False
        self.threads_before: int | None = None
        self.monitor: threading.Thread | None = None
        self.lock = threading.Lock()
        self.wake_r, self.wake_w = mp.get_context("spawn").Pipe(duplex=False)

    def drain(self, i: int) -> None:
        with self.lock:
            conn = self.conns[i]
            try:
                while not conn.closed and conn.poll():
                    self.messages[i].append(conn.recv())
            except (EOFError, OSError):
                pass

    def dead(self) -> list[int]:
        """Indices of workers that have exited. Their sentinels say so whichever thread
        reaps them (exitcode reads None in one thread while another is reaping)."""
        ready = wait([p.sentinel for p in self.procs], timeout=0)
        return [i for i, p in enumerate(self.procs) if p.sentinel in ready]

    def record_death(self, i: int) -> None:
        """Note worker i+1's death (once); the first death is the one reported."""
        if self.stopping:
            return
        self.drain(i)
        proc = self.procs[i]
        code = proc.exitcode
        deadline = time.monotonic() + 1.0
        # Another thread may be reaping it this instant; its exit status appears shortly.
        while code is None and time.monotonic() < deadline:
            time.sleep(0.01)
            code = proc.exitcode
        what = _describe_exit(code)
        text = f"tensor-parallel worker rank {i + 1} (pid {proc.pid}) {what}"
        errors = [m[1] for m in self.messages[i] if m[0] == "error"]
        if errors:
            text += f"; its traceback:\n{errors[-1]}"
        elif not any(m[0] == "started" for m in self.messages[i]):
            text += (
                " before it started (see its stderr). Spawned processes re-import the main "
                "module: a script must start the engine under `if __name__ == '__main__':`"
            )
        with self.lock:
            if self.failure is None:
                self.failure = text
                logger.error("%s", text)

    def close(self, stop_timeout: float) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = self.stopping = True
        with contextlib.suppress(OSError):
            self.wake_w.send(None)
        told = False
        if self.failure is None and self.groups is not None:
            try:
                broadcast_header(self.groups, [CMD_STOP])
                told = True
            except Exception:  # a worker that already died cannot hear it; terminated below
                logger.debug("stop message not delivered", exc_info=True)
        if told:
            for proc in self.procs:
                proc.join(stop_timeout)
        # After a failure the survivors may sit in a collective that will never complete.
        for proc in self.procs:
            if proc.is_alive():
                if told:
                    logger.warning("tensor-parallel worker pid %d did not stop", proc.pid)
                proc.terminate()
                proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        if self.groups is not None or dist.is_initialized():
            try:
                destroy_process_groups()
            except Exception:
                logger.warning("destroying the tensor-parallel process group failed", exc_info=True)
                set_tensor_parallel(0, 1)
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
        if self.monitor is not None and self.monitor is not threading.current_thread():
            self.monitor.join(5)  # woken above; its pipe must not close under its wait()
        self.wake_r.close()
        self.wake_w.close()


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1: start, readiness, failure checks, shutdown.

    Construction spawns the workers (each runs `entry(groups, spec, ready)`), joins the
    process groups as rank 0 and sets rank 0's TP state, so the caller can build its model
    shard right away while the workers build theirs.
    """

    def __init__(
        self, world_size: int, device: torch.device, entry: WorkerEntry, spec: Any
    ) -> None:
        if world_size < 2:
            raise ValueError(f"a worker group needs at least 2 ranks, got {world_size}")
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialized in this process: shut the other "
                "tensor-parallel engine down first (LLMEngine.shutdown())"
            )
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index != 0:
                raise ValueError(f"tensor parallelism puts rank r on cuda:r; rank 0 is on {device}")
            if torch.cuda.device_count() < world_size:
                raise ValueError(
                    f"tensor_parallel_size={world_size} needs {world_size} GPUs, "
                    f"{torch.cuda.device_count()} visible"
                )
            device = torch.device("cuda", 0)
        self.world_size = world_size
        self.device = device
        state = self._state = _State()
        # Runs at close(), when the group is garbage collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, state.close, 30.0)
        if device.type == "cpu":  # rank 0 shares the cores too; restored at close
            state.threads_before = torch.get_num_threads()
            torch.set_num_threads(cpu_threads_per_rank(world_size))
        set_process_env()
        store = dist.TCPStore(
            _HOST,
            0,
            world_size,
            is_master=True,
            timeout=collective_timeout(),
            wait_for_workers=False,
        )
        ctx = mp.get_context("spawn")
        try:
            for rank in range(1, world_size):
                parent_conn, child_conn = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_bootstrap,
                    args=(entry, rank, world_size, store.port, device.type, spec, child_conn),
                    name=f"asyncengine-tp{rank}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()  # the worker holds the only other end: EOF when we die
                state.procs.append(proc)
                state.conns.append(parent_conn)
                state.messages.append([])
            # A worker that fails before joining would leave rank 0 in the rendezvous until
            # it times out, so wait for each to report in (or die) first.
            self._wait_for("started", collective_timeout().total_seconds())
            state.groups = init_process_groups(0, world_size, device, store)
        except BaseException:
            self.close()
            raise

    @property
    def groups(self) -> ProcessGroups:
        assert self._state.groups is not None
        return self._state.groups

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._state.procs]

    def _wait_for(self, kind: str, timeout: float | None) -> None:
        state = self._state
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = set(range(len(state.procs)))
        while pending:
            for i in list(pending):
                state.drain(i)
                if any(m[0] == kind for m in state.messages[i]):
                    pending.discard(i)
                elif i in state.dead():
                    state.record_death(i)
            self.raise_if_failed()  # the monitor is not running yet: deaths noted just above
            if not pending:
                break
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if left == 0.0:
                ranks = ", ".join(str(i + 1) for i in sorted(pending))
                raise TensorParallelWorkerError(
                    f"tensor-parallel worker rank(s) {ranks} did not report {kind!r} in time"
                )
            waitables = [state.conns[i] for i in pending] + [
                state.procs[i].sentinel for i in pending
            ]
            wait(waitables, timeout=left)

    def wait_ready(self) -> None:
        """Block until every worker has built its model shard; raise if one failed."""
        # No timeout: loading a large shard takes as long as it takes; death is noticed.
        self._wait_for("ready", None)
        state = self._state
        if state.monitor is None:
            state.monitor = threading.Thread(
                target=_monitor, args=(state,), name="asyncengine-tp-monitor", daemon=True
            )
            state.monitor.start()

    def failure(self, wait_s: float = 0.0) -> str | None:
        """Why the group cannot go on (a worker died, or it was marked broken), or None.

        After a failed collective, `wait_s` gives a dying peer time to finish dying, so the
        error names it rather than the collective's symptom."""
        state = self._state
        if state.failure is None and wait_s > 0 and not state.stopping:
            wait([p.sentinel for p in state.procs], timeout=wait_s)
        if state.failure is None and not state.stopping:
            for i in state.dead():
                state.record_death(i)
        return state.failure

    def raise_if_failed(self) -> None:
        """Raise `TensorParallelWorkerError` if a worker died or the group is closed.

        Cheap enough for every step: no system call, the monitor thread records deaths (and
        a collective that fails first is handled by the caller through `failure`)."""
        state = self._state
        if state.failure is not None:
            raise TensorParallelWorkerError(state.failure)
        if state.closed:
            raise TensorParallelWorkerError("the tensor-parallel workers were shut down")

    def mark_broken(self, reason: str) -> None:
        """A step failed on rank 0 part-way: the ranks' collectives no longer line up."""
        with self._state.lock:
            if self._state.failure is None:
                self._state.failure = f"tensor-parallel group is broken: {reason}"

    def close(self) -> None:
        """Stop the workers (STOP message, then join, then kill) and leave the groups."""
        self._finalizer()


def _monitor(state: _State) -> None:
    """Notice a worker's death while rank 0 may be blocked in a collective."""
    sentinels = {p.sentinel: i for i, p in enumerate(state.procs)}
    while sentinels and not state.stopping:
        try:
            ready = wait([*sentinels, state.wake_r])
        except OSError:
            return
        if state.wake_r in ready or state.stopping:
            return
        for s in ready:
            i = sentinels.pop(s)
            state.record_death(i)
        groups = state.groups
        if state.failure is not None and groups is not None and groups.backend == "nccl":
            # NCCL kernels wait on the dead peer forever; aborting the communicator makes
            # rank 0's pending work fail now. (gloo raises by itself: the socket closes.)
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception:
                logger.warning("aborting the NCCL process group failed", exc_info=True)
            return
