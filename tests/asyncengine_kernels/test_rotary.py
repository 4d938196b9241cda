"""Rotary embedding: the reference against HF's apply_rotary_pos_emb, Triton against it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from asyncengine_kernels import apply_rotary_emb
from asyncengine_kernels.rotary import apply_rotary_emb_ref, apply_rotary_emb_triton
from tests.asyncengine_kernels.kernel_cases import requires_cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _cos_sin_cache(rot_dim: int, max_pos: int = 256, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _inputs(tokens: int, hq: int, hkv: int, dim: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, hq, dim, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(tokens, hkv, dim, generator=gen).to(device=device, dtype=dtype)
    pos = torch.randint(0, 256, (tokens,), generator=gen).to(device)
    return pos, q, k


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_hf(dtype: torch.dtype) -> None:
    pos, q, k = _inputs(9, 4, 2, 64, dtype)
    cache = _cos_sin_cache(64)
    cos, sin = cache[pos].chunk(2, dim=-1)
    cos_full, sin_full = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    # HF layout: [batch, heads, seq, dim] with cos/sin [batch, seq, dim] cast to q.dtype.
    hq, hk = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None],
        cos_full[None].to(dtype), sin_full[None].to(dtype),
    )  # fmt: skip
    rq, rk = apply_rotary_emb_ref(pos, q, k, cache)
    assert torch.equal(rq, hq[0].transpose(0, 1))
    assert torch.equal(rk, hk[0].transpose(0, 1))
    dq, dk = apply_rotary_emb(pos.to(torch.int32), q, k, cache)
    assert torch.equal(dq, rq) and torch.equal(dk, rk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dim,rot", [((4, 2), 64, 64), ((6, 2), 32, 32), ((3, 1), 48, 32)])
def test_triton_matches_reference(
    dtype: torch.dtype, heads: tuple[int, int], dim: int, rot: int
) -> None:
    pos, q, k = _inputs(7, *heads, dim, dtype)
    cache = _cos_sin_cache(rot)
    tq, tk = apply_rotary_emb_triton(pos, q, k, cache)
    rq, rk = apply_rotary_emb_ref(pos, q, k, cache)
    # The interpreter rounds to bf16 toward zero, GPUs to nearest: 1 bf16 ulp there.
    tol = 2.0**-6 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(tq, rq, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(tk, rk, atol=tol * 4, rtol=tol)


def test_triton_strided_views_of_qkv() -> None:
    tokens, hq, hkv, dim = 5, 4, 2, 32
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim)
    q = qkv[:, : hq * dim].view(tokens, hq, dim)
    k = qkv[:, hq * dim : (hq + hkv) * dim].view(tokens, hkv, dim)
    pos = torch.arange(tokens)
    before = qkv.clone()
    tq, tk = apply_rotary_emb_triton(pos, q, k, _cos_sin_cache(dim))
    rq, rk = apply_rotary_emb_ref(pos, q, k, _cos_sin_cache(dim))
    assert torch.equal(tq, rq) and torch.equal(tk, rk)
    assert torch.equal(qkv, before)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("heads", [(32, 32), (32, 8)])
def test_gpu_within_one_ulp_of_reference(heads: tuple[int, int]) -> None:
    pos, q, k = _inputs(1000, *heads, 128, torch.bfloat16, device="cuda")
    cache = _cos_sin_cache(128).cuda()
    tq, tk = apply_rotary_emb_triton(pos, q, k, cache)
    rq, rk = apply_rotary_emb_ref(pos, q, k, cache)
    # The kernel computes x*cos - y*sin in fp32 and rounds once; the reference rounds each
    # bf16 product as HF does. On the H200 about 19 % of outputs differ, each by at most one
    # bf16 ulp of the products (|x| < 4 here, so 2^-6), which the tolerance below allows.
    torch.testing.assert_close(tq, rq, atol=2.0**-5, rtol=2.0**-7)
    torch.testing.assert_close(tk, rk, atol=2.0**-5, rtol=2.0**-7)
