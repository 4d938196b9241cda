"""RMSNorm and the fused residual-add + RMSNorm, rounded like HF transformers' LlamaRMSNorm.

normed = weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype): the variance is taken in
fp32, the normalized value is cast back to the input dtype, then multiplied by the weight
(result dtype: torch's promotion of x and weight). The fused variant first forms
new_residual = x + residual in x.dtype and normalizes that.
"""

from __future__ import annotations

import torch

from asyncengine_kernels._triton_utils import (
    next_power_of_2,
    pdl_kwargs,
    pdl_wait,
    tl,
    triton,
    use_pdl,
    use_triton,
)

__all__ = [
    "check_norm_inputs",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "fused_add_rms_norm_triton",
    "rms_norm",
    "rms_norm_ref",
    "rms_norm_triton",
]


def check_norm_inputs(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor
) -> None:
    """What a matmul with the norm in its prologue needs of its norm's inputs: a weight of
    x's row length and dtype, and a residual shaped and typed as x."""
    k = x.shape[-1]
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"the norm weight must be [{k}] in {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("the residual must match x in shape and dtype")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual.to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # The sum is rounded to x.dtype before normalizing, as an eager `x + residual` is.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # Two bf16/fp16 factors multiply exactly in fp32, so one rounding matches torch's mul.
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res2 = res_out = None
    if residual is not None:
        res2 = residual.reshape(-1, hidden).to(x.dtype)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty_like(x2, memory_format=torch.contiguous_format)
    rows = x2.shape[0]
    if rows > 0:
        block = next_power_of_2(hidden)
        pdl = use_pdl(x2)
        _rms_norm_kernel[(rows,)](
            x2, res2 if res2 is not None else x2, weight.contiguous(), out,
            res_out if res_out is not None else out, float(eps),
            x2.stride(0), res2.stride(0) if res2 is not None else 0,
            out.stride(0), res_out.stride(0) if res_out is not None else 0,
            N=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, USE_PDL=pdl,
            num_warps=max(1, min(16, block // 512)), **pdl_kwargs(pdl),
        )  # fmt: skip
    out = out.view(x.shape)
    return out, (res_out.view(x.shape) if res_out is not None else None)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    normed, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return normed, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] (new tensor)."""
    return (rms_norm_triton if use_triton(x) else rms_norm_ref)(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); new tensors, inputs untouched."""
    fn = fused_add_rms_norm_triton if use_triton(x) else fused_add_rms_norm_ref
    return fn(x, residual, weight, eps)
