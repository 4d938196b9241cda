"""SiLU-and-mul: the reference is HF's `silu(gate) * up`; Triton rounds once (tolerances)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncengine_kernels import silu_and_mul
from asyncengine_kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from tests.asyncengine_kernels.kernel_cases import requires_cuda

TOLS = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def test_reference_is_gate_silu_times_up() -> None:
    x = torch.randn(3, 2 * 10, dtype=torch.float64)
    expected = x[:, :10] / (1 + torch.exp(-x[:, :10])) * x[:, 10:]
    torch.testing.assert_close(silu_and_mul_ref(x), expected)
    assert torch.equal(silu_and_mul(x.float()), F.silu(x.float()[:, :10]) * x.float()[:, 10:])


@pytest.mark.parametrize("dtype", list(TOLS))
@pytest.mark.parametrize("inter", [48, 1500])
def test_triton_matches_reference(dtype: torch.dtype, inter: int) -> None:
    x = (torch.randn(5, 2 * inter) * 3).to(dtype)
    out = silu_and_mul_triton(x)
    assert out.shape == (5, inter) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=TOLS[dtype], rtol=TOLS[dtype])


def test_triton_leading_dims_and_empty() -> None:
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x))
    assert silu_and_mul_triton(torch.empty(0, 64)).shape == (0, 32)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_llama_sizes(dtype: torch.dtype) -> None:
    x = torch.randn(1000, 2 * 14336, device="cuda", dtype=dtype) * 3
    out = silu_and_mul_triton(x)
    exact = (F.silu(x[:, :14336].float()) * x[:, 14336:].float()).to(dtype)
    # One rounding of the fp32 result (fp32 silu formulas may differ in the last bit).
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(out, exact, atol=1e-6, rtol=ulp)
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=TOLS[dtype], rtol=TOLS[dtype])
