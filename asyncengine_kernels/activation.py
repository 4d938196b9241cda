"""SiLU-and-mul, the gated activation of Llama MLPs: silu(x[:, :I]) * x[:, I:].

The reference computes in x.dtype with torch semantics, as HF's `act_fn(gate) * up` does
(silu rounded to x.dtype, then the product rounded). The Triton kernel computes in fp32 and
rounds once, so fp16/bf16 results can differ from the reference by one rounding step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncengine_kernels._triton_utils import pdl_kwargs, pdl_wait, tl, triton, use_pdl, use_triton

__all__ = ["silu_and_mul", "silu_and_mul_ref", "silu_and_mul_triton", "silu_times"]


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


@triton.jit
def silu_times(gate, up):
    """silu(gate) * up in the operands' precision (fp32 where the kernels call it): the one
    formula this kernel and every kernel that fuses the activation (the GEMVs' prologues and
    epilogues, the few-row matmul) compute, each rounding the result as it needs."""
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    out = silu_times(gate, up)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and inter > 0:
        block = min(1024, triton.next_power_of_2(inter))
        grid = (x2.shape[0], triton.cdiv(inter, block))
        pdl = use_pdl(x2)
        _silu_and_mul_kernel[grid](
            x2, out, x2.stride(0), out.stride(0), INTER=inter, BLOCK=block, USE_PDL=pdl,
            num_warps=4 if block >= 512 else 2, **pdl_kwargs(pdl),
        )  # fmt: skip
    return out.view(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*I] -> silu(x[..., :I]) * x[..., I:] of shape [..., I]."""
    return (silu_and_mul_triton if use_triton(x) else silu_and_mul_ref)(x)
