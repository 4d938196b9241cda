"""The L2 prefetch: where it applies, and how a launch's programs share a buffer's lines."""

from __future__ import annotations

import itertools

import pytest
import torch

from asyncengine_kernels._triton_utils import tl, triton
from asyncengine_kernels.l2_prefetch import l2_prefetch_supported, l2_share
from tests.asyncengine_kernels.kernel_cases import requires_cuda


@triton.jit
def _shares_kernel(out_ptr, nbytes):
    part = tl.program_id(0)
    lo, hi = l2_share(nbytes, part, tl.num_programs(0))
    tl.store(out_ptr + 2 * part, lo)
    tl.store(out_ptr + 2 * part + 1, hi)


@pytest.mark.parametrize("nbytes,parts", [(33_554_432, 512), (1000, 7), (128, 4), (5, 3),
                                          (16_777_216 + 4 * 4096, 128)])  # fmt: skip
def test_programs_share_every_line_once(nbytes: int, parts: int) -> None:
    """The shares are whole 128-byte lines, in program order, covering the buffer exactly
    once; none is larger than an even split rounded up."""
    out = torch.zeros(2 * parts, dtype=torch.int64)
    _shares_kernel[(parts,)](out, nbytes)
    bounds = out.view(parts, 2).tolist()
    lines = -(-nbytes // 128)
    assert bounds[0][0] == 0 and bounds[-1][1] == lines
    for (_, hi), (next_lo, _) in itertools.pairwise(bounds):
        assert hi == next_lo
    assert all(0 <= hi - lo <= -(-lines // parts) for lo, hi in bounds)


def test_off_for_cpu_tensors() -> None:
    assert not l2_prefetch_supported(torch.zeros(1))


@pytest.mark.gpu
@requires_cuda
def test_gpu_on_from_ampere() -> None:
    x = torch.zeros(1, device="cuda")
    assert l2_prefetch_supported(x) == (torch.cuda.get_device_capability()[0] >= 8)
