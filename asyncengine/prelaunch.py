"""A verify step's decode graph launched before the verdict that decides its inputs.

A speculating stream resolves each verify step before it schedules the next (the next
drafts continue the kept tokens), so the device waits for the host: resolving, proposing,
scheduling, laying out the inputs, then the graph's launch call, and the graph's first
kernel starts only once that call has returned. The launch call is the longest of those
parts that does not depend on the verdict. So right after a verify step is enqueued, its
successor's graph is enqueued too, behind a gate: the stream waits on a word of pinned host
memory (`cuStreamWaitValue32`), then copies the staged inputs from a pinned image and
replays the graph. When the next step is laid out, the host writes its image and opens the
gate; the device starts at once, and the launch call is off the critical path.

The bet is that the next step fits the same graph (padded rows and attention plan) with
no block moves before it; a step of fewer rows (fewer drafts, or none) pads into it. When
it does not fit (the request finished, a prompt chunk joined, a swap, another attention
plan), the armed graph runs on an image of padding rows only (no slot written, no context
read) and its output is dropped; the step then runs as usual behind it. So a lost bet
costs one forward and never a wrong token.

Nothing may wait on the stream while its gate is closed: every path that enqueues other
work, or waits for the device, first fires or releases the armed graph
(`ModelRunner.launch`, `LLMEngine.step`, shutdown).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from asyncengine.cuda_graphs import DecodeGraphs
    from asyncengine_kernels.paged_attention import DecodePlan

logger = logging.getLogger(__name__)

_CU_STREAM_WAIT_VALUE_GEQ = 0x0


class StreamGate(Protocol):
    """Holds a stream's later work until the host opens it."""

    def close(self, value: int) -> None:
        """Work enqueued from now waits until `open(v)` with v >= value."""

    def enqueue(self, work: Callable[[], None]) -> None:
        """Enqueue `work` (which enqueues device work) behind the gate."""

    def open(self, value: int) -> None:
        """Let the work behind `close(value)` run."""


class GateUnavailable(RuntimeError):
    """The driver cannot make a stream wait on host memory."""


class CudaStreamGate:
    """`cuStreamWaitValue32` on a word of mapped pinned memory, on the stream current at
    construction (the engine's steps never switch streams): the stream itself waits, no
    kernel spins."""

    def __init__(self, device: torch.device) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            wait = lib.cuStreamWaitValue32_v2
        except (OSError, AttributeError) as e:
            raise GateUnavailable(f"no cuStreamWaitValue32_v2 in libcuda: {e}") from e
        # The driver calls below act on the calling thread's current context: make sure it
        # is the device's primary context, as torch's own calls leave it.
        torch.cuda.synchronize(device)
        wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        wait.restype = ctypes.c_int
        self._wait = wait
        # A 64-byte line of its own: nothing else the host writes shares it.
        self._word = torch.zeros(16, dtype=torch.int32, pin_memory=True)
        self._host = self._word.numpy()
        # Pinned memory is mapped at the same address under unified addressing; the driver
        # says so, or names the mapping, here.
        dptr = ctypes.c_uint64(0)
        get = lib.cuMemHostGetDevicePointer_v2
        get.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        get.restype = ctypes.c_int
        rc = get(ctypes.byref(dptr), ctypes.c_void_p(self._word.data_ptr()), 0)
        if rc != 0:
            raise GateUnavailable(f"pinned memory not mapped for the device (CUresult {rc})")
        self._dptr = dptr.value
        self._stream = torch.cuda.current_stream(device)
        self._handle = ctypes.c_void_p(self._stream.cuda_stream)

    def close(self, value: int) -> None:
        # GEQ compares as (int32)(*addr - value) >= 0: counts wrap around safely.
        rc = self._wait(self._handle, self._dptr, value & 0x7FFFFFFF, _CU_STREAM_WAIT_VALUE_GEQ)
        if rc != 0:
            raise GateUnavailable(f"cuStreamWaitValue32 failed (CUresult {rc})")

    def enqueue(self, work: Callable[[], None]) -> None:
        work()

    def open(self, value: int) -> None:
        # x86 keeps stores in order: the image written before this is what the copy reads.
        self._host[0] = value & 0x7FFFFFFF


class HostGate:
    """Off the GPU, where there is no stream: work enqueued behind a closed gate runs when
    the gate opens, as a stream would run it. Other work runs at once, where a stream would
    hold it behind the gate too, so the two agree only while nothing else is enqueued between
    an arm and its fire or release: the order the runner keeps, and the one the GPU needs (a
    copy from pageable memory waits for the stream). The CPU's stand-in graphs use it, and
    the tests of the bookkeeping around it."""

    def __init__(self) -> None:
        self._closed_at: int | None = None
        self._held: list[Callable[[], None]] = []

    def close(self, value: int) -> None:
        self._closed_at = value

    def enqueue(self, work: Callable[[], None]) -> None:
        if self._closed_at is None:
            work()
        else:
            self._held.append(work)

    def open(self, value: int) -> None:
        if self._closed_at is None or value < self._closed_at:
            return
        held, self._held, self._closed_at = self._held, [], None
        for work in held:
            work()


class GraphPrelaunch:
    """One decode graph at a time, enqueued behind a gate before its inputs exist
    (`arm`), then given them (`fire`) or padding (`release`). Counts what it did."""

    def __init__(self, graphs: DecodeGraphs, gate: StreamGate) -> None:
        self.graphs = graphs
        self.gate = gate
        self.armed: tuple[int, DecodePlan] | None = None
        self._seq = 0
        # Two pinned images used in turn, each as large as the largest step's: the copy that
        # last read one is the one before the previous arm, whose gate is open, so its event
        # can be waited for (`_write`).
        size = graphs.image_bytes(graphs.sizes[-1])
        pin = graphs.device.type == "cuda"
        self._images = [torch.zeros(size, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self.fired = 0
        self.released = 0

    def arm(self, padded: int, plan: DecodePlan) -> None:
        """Enqueue the graph of `padded` rows and `plan` behind a closed gate."""
        assert self.armed is None, "fire or release the armed graph first"
        graphs = self.graphs
        self._seq += 1
        turn = self._seq & 1
        nbytes = graphs.image_bytes(padded)
        image = self._images[turn][:nbytes]
        static = graphs.static[:nbytes]
        key = (padded, plan)
        on_gpu = graphs.device.type == "cuda"

        def copy_and_replay() -> None:
            static.copy_(image, non_blocking=on_gpu)
            if on_gpu:
                event = self._events[turn] or torch.cuda.Event()
                event.record()
                self._events[turn] = event
            graphs.graphs[key].replay()
            graphs.replays += 1

        self.gate.close(self._seq)
        self.armed = key
        try:
            self.gate.enqueue(copy_and_replay)
        except BaseException:
            self.release()  # nothing may stay behind a closed gate
            raise

    def takes(self, padded: int, plan: DecodePlan) -> bool:
        return self.armed == (padded, plan)

    def _write(self, image: np.ndarray) -> None:
        turn = self._seq & 1
        previous = self._events[1 - turn]
        if previous is not None:
            previous.synchronize()  # behind an open gate: the copy of two arms ago is done
        self._images[turn][: image.size].numpy()[:] = image
        assert self.armed is not None
        self.armed = None
        self.gate.open(self._seq)

    def fire(self, image: np.ndarray) -> None:
        """Give the armed graph its step (`DecodeGraphs.stage_image` of its padded size)."""
        self._write(image)
        self.fired += 1

    def release(self) -> None:
        """Let the armed graph run on padding rows only; its output is never read."""
        if self.armed is None:
            return
        padded = self.armed[0]
        self._write(self.graphs.stage_image(padded, [], [], [], [], []))
        self.released += 1
        logger.debug("prelaunched graph of %d rows released unused", padded)
