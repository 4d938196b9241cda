"""Guarded Triton import and small helpers shared by the kernel modules.

Importing `asyncengine_kernels` must work on a machine without Triton (or without a GPU and without
the interpreter): kernel modules import `triton`/`tl` from here, which fall back to inert stand-ins
so that the `@triton.jit` decorators still run; only launching a kernel needs real Triton.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from asyncengine_kernels import envs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is not installed
    HAS_TRITON = False

    class _Stub:
        """Stands in for `triton` / `triton.language` so decorators and annotations evaluate."""

        def __getattr__(self, name: str) -> Any:
            return _Stub()

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            # `@triton.jit` and `@triton.jit(...)` both leave the function as it is.
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]
            return self

    triton = _Stub()  # type: ignore[assignment]
    tl = _Stub()  # type: ignore[assignment]

__all__ = [
    "HAS_TRITON",
    "INLINE_PTX",
    "compute_capability",
    "interpreter_enabled",
    "next_power_of_2",
    "num_sms",
    "pdl_kwargs",
    "pdl_wait",
    "tl",
    "triton",
    "triton_available",
    "use_pdl",
    "use_triton",
]


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Whether kernels may run inline PTX: the interpreter runs none, so kernels that use it
# take a plain-Triton path there that computes the same values.
INLINE_PTX = tl.constexpr(not interpreter_enabled())


def triton_available() -> bool:
    """True when Triton kernels can be launched here: on a CUDA device or in the interpreter."""
    return HAS_TRITON and (torch.cuda.is_available() or interpreter_enabled())


def use_triton(t: torch.Tensor) -> bool:
    """Dispatch rule of the public ops: Triton for CUDA tensors, the torch reference otherwise."""
    return t.is_cuda and HAS_TRITON


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@functools.cache
def num_sms(device_index: int = 0) -> int:
    """Multiprocessor count of a CUDA device (132 on an H200); 1 on CPU / interpreter runs."""
    if not torch.cuda.is_available():
        return 1
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def compute_capability(device_index: int) -> tuple[int, int]:
    """(major, minor) of a CUDA device, looked up once: launches ask it on the step's path."""
    return torch.cuda.get_device_capability(device_index)


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with programmatic dependent launch (Hopper and
    newer): a kernel may start while the previous one drains and waits in `pdl_wait` before
    touching memory that kernel writes, so launch latency and ramp-up overlap its tail."""
    if not (t.is_cuda and HAS_TRITON) or interpreter_enabled():
        return False
    return compute_capability(t.device.index or 0)[0] >= 9 and not envs.no_pdl()


def pdl_kwargs(enabled: bool) -> dict[str, Any]:
    """Launch options for a kernel taking `USE_PDL=enabled`."""
    return {"launch_pdl": True} if enabled else {}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel's writes are visible, then let the next kernel launch.

    Releasing the next kernel this early is safe: it waits here in turn before its own
    dependent reads and writes, and it is released only once every block of this kernel has
    started, so it never takes a multiprocessor from this kernel's later blocks."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
