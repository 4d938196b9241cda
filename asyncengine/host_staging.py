"""Host-to-device copies of packed step inputs that never make the host wait for the GPU.

A copy to the GPU from pageable memory first waits for the stream's queued work, so a host
that lays out step N + 1 while the device runs step N would stall on its own upload. The
copies here go through pinned buffers that are pinned once and reused in turn; an event per
buffer guards its reuse (the copy that last read it must be done before it is rewritten),
which is usually long done, so the host runs ahead of the device by up to `turns` copies.

The copies are issued on the stream that is current when the first one is made (the
engine's steps never switch streams). That stream and each turn's event are looked up and
made once: creating an event and finding the current stream through torch's Python helpers
cost about 0.04 ms a copy on the H200's host, on the path from one verify step's verdict to
the next step's graph.
"""

from __future__ import annotations

import numpy as np
import torch

# Pinned buffers start this large (bytes), so that small steps never re-pin.
MIN_STAGING_BYTES = 1 << 19


class PinnedStaging:
    """`turns` pinned upload buffers used in rotation for one device."""

    def __init__(self, device: torch.device, turns: int = 2) -> None:
        if turns < 1:
            raise ValueError(f"turns must be at least 1, got {turns}")
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * turns
        # One per turn, made at the first copy; each is recorded after its buffer's copy (an
        # event never recorded is waited for at once).
        self._events: list[torch.cuda.Event] = []
        self._stream: torch.cuda.Stream | None = None
        self._turn = 0

    def to_device(self, flat: np.ndarray, dst: torch.Tensor | None = None) -> torch.Tensor:
        """`flat` (uint8) on the device: copied into `dst` (uint8, as long) where given, else
        into a new tensor. Off the GPU the host array itself serves (copied into `dst`)."""
        host = torch.from_numpy(flat)
        if self.device.type != "cuda":
            return host if dst is None else dst.copy_(host)
        if self._stream is None:
            self._stream = torch.cuda.current_stream(self.device)
            self._events = [torch.cuda.Event() for _ in self._buffers]
        turn = self._turn
        self._turn = (turn + 1) % len(self._buffers)
        event = self._events[turn]
        event.synchronize()  # the copy that last read this buffer
        buf = self._buffers[turn]
        if buf is None or buf.numel() < host.numel():
            buf = torch.empty(max(host.numel(), MIN_STAGING_BYTES), dtype=torch.uint8,
                              pin_memory=True)  # fmt: skip
            self._buffers[turn] = buf
        staged = buf[: host.numel()]
        staged.copy_(host)
        if dst is not None:
            dev = dst.copy_(staged, non_blocking=True)
        else:
            dev = staged.to(self.device, non_blocking=True)
        event.record(self._stream)
        return dev

    def release(self) -> None:
        """Let go of the pinned buffers (they are pinned again on the next copy)."""
        self._buffers = [None] * len(self._buffers)
