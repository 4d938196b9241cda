"""RMSNorm / fused add + RMSNorm: the reference against HF's LlamaRMSNorm, Triton against it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from asyncengine_kernels import fused_add_rms_norm, rms_norm
from asyncengine_kernels.rms_norm import (
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from tests.asyncengine_kernels.kernel_cases import requires_cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(device=x.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


def _inputs(rows: int, hidden: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=dtype)
    res = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device=device, dtype=dtype)
    return x, res, w


def _interp_tol(dtype: torch.dtype) -> float:
    # One output ulp: fp32 sums in another order can move rstd by an ulp, and the interpreter
    # rounds fp32 -> bf16 toward zero where GPUs round to nearest.
    return {torch.float32: 2e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-6}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_hf(dtype: torch.dtype) -> None:
    x, res, w = _inputs(5, 96, dtype)
    assert torch.equal(rms_norm_ref(x, w, 1e-5), _hf_norm(x, w, 1e-5))
    normed, new_res = fused_add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(new_res, x + res)
    assert torch.equal(normed, _hf_norm(x + res, w, 1e-5))


def test_dispatch_on_cpu_and_leading_dims() -> None:
    x, res, w = _inputs(6, 32, torch.float32)
    x3 = x.view(2, 3, 32)
    assert torch.equal(rms_norm(x3, w, 1e-6), rms_norm_ref(x3, w, 1e-6))
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(new_res, x + res)
    assert torch.equal(normed, rms_norm_ref(x + res, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_triton_matches_reference(dtype: torch.dtype, hidden: int) -> None:
    x, res, w = _inputs(7, hidden, dtype, seed=1)
    tol = _interp_tol(dtype)
    out = rms_norm_triton(x, w, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6), atol=tol * 8, rtol=tol)
    normed, new_res = fused_add_rms_norm_triton(x, res, w, 1e-6)
    ref_normed, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, ref_res, atol=tol * 8, rtol=tol)
    torch.testing.assert_close(normed, ref_normed, atol=tol * 8, rtol=tol)
    assert torch.equal(x, _inputs(7, hidden, dtype, seed=1)[0])  # inputs untouched


def test_triton_mixed_weight_dtype_and_strided_rows() -> None:
    x, _, w = _inputs(4, 64, torch.float16)
    wide = torch.zeros(4, 128, dtype=torch.float16)
    wide[:, :64] = x
    out = rms_norm_triton(wide[:, :64], w.float(), 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_ref(x, w.float(), 1e-6))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_within_one_ulp_of_reference(dtype: torch.dtype) -> None:
    x, res, w = _inputs(300, 4096, dtype, device="cuda", seed=2)
    # The fp32 sum of squares is reduced in another order than torch's: rstd can move by an
    # ulp, and the product with the weight can turn that into two output ulps.
    ulp = 2 * (2.0**-7 if dtype == torch.bfloat16 else 2.0**-10)
    torch.testing.assert_close(
        rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), atol=0, rtol=ulp
    )
    normed, new_res = fused_add_rms_norm_triton(x, res, w, 1e-5)
    ref_normed, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(new_res, ref_res)
    # fp32 sums in another order can move the rstd by an ulp: allow one output ulp.
    torch.testing.assert_close(normed, ref_normed, atol=0, rtol=ulp)
