"""Warming L2 with a later kernel's weights while a latency-bound kernel leaves the memory
bus idle.

A batch-1 decode step reads every weight once, and its attention kernel reads a few MB of
KV cache in a few microseconds: during attention the bus is nearly idle, and the output
projection after it then streams its weight from memory. A kernel that takes a buffer to
prefetch (`prefetch_l2_share`) has each program ask L2 for its share of the buffer's lines
before doing its own work, marked to stay (`evict_last`), so the next kernel reads them from
L2. The asks are hints: they change no value, only where the next reads are served from.

The interpreter runs no inline PTX; there the asks are skipped (values are unchanged).
"""

from __future__ import annotations

import torch

from asyncengine_kernels._triton_utils import (
    INLINE_PTX,
    compute_capability,
    interpreter_enabled,
    tl,
    triton,
)

__all__ = ["l2_prefetch_supported", "l2_share", "prefetch_l2_share"]

# The granule one ask brings into L2, and the lines a program asks for per loop step.
_LINE_BYTES = tl.constexpr(128)
_LINES_PER_STEP = tl.constexpr(128)


def l2_prefetch_supported(t: torch.Tensor) -> bool:
    """Whether kernels on t's device can ask L2 to keep lines (`prefetch.global.L2::evict_last`
    needs sm_80 or newer)."""
    if not t.is_cuda or interpreter_enabled():
        return False
    return compute_capability(t.device.index or 0)[0] >= 8


@triton.jit
def _ask_lines(addr, keep):
    """Ask L2 for the line at each address where `keep` is set."""
    if INLINE_PTX:
        # Not pure: the asks have no result, and a pure op without a used result is removed.
        tl.inline_asm_elementwise(
            asm="""{
            .reg .pred p;
            setp.ne.b32 p, $2, 0;
            @p prefetch.global.L2::evict_last [$1];
            mov.b32 $0, 0;
            }""",
            constraints="=r,l,r",
            args=[addr, keep.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def l2_share(nbytes, part, parts):
    """The lines [lo, hi) of an `nbytes` buffer that program `part` of `parts` asks for:
    whole lines, in order, the shares tiling the buffer (the last ones may be empty)."""
    lines = tl.cdiv(nbytes, _LINE_BYTES)
    per_part = tl.cdiv(lines, parts)
    lo = tl.minimum(part * per_part, lines)
    hi = tl.minimum(lo + per_part, lines)
    return lo, hi


@triton.jit
def prefetch_l2_share(base_ptr, nbytes, part, parts):
    """Ask L2 for this program's share (`l2_share`) of the `nbytes` bytes at `base_ptr` (a
    byte pointer)."""
    lo, hi = l2_share(nbytes, part, parts)
    for start in range(lo, hi, _LINES_PER_STEP):
        line = start + tl.arange(0, _LINES_PER_STEP)
        _ask_lines(base_ptr + line.to(tl.int64) * _LINE_BYTES, line < hi)
