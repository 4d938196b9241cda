"""Rotary position embedding, NeoX / HF-Llama style (rotate_half on the two halves).

cos_sin_cache: float32 [max_position, R] with cos of the R/2 frequencies in [:, :R/2] and sin
in [:, R/2:]; R is the rotary dim (R == head_dim for Llama; R < head_dim rotates the first R
dims and passes the rest through). For x = (x1, x2) split at R/2:
out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin, computed like HF: cos/sin cast to q.dtype,
every product and sum rounded to q.dtype. Returns new tensors (inputs are left untouched).
"""

from __future__ import annotations

import torch

from asyncengine_kernels._triton_utils import next_power_of_2, tl, triton, use_triton

__all__ = ["apply_rotary_emb", "apply_rotary_emb_ref", "apply_rotary_emb_triton"]


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    c, s = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def apply_rotary_emb_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos_sin = cos_sin_cache[positions.to(torch.int64)]
    cos, sin = cos_sin.chunk(2, dim=-1)
    return _rotate_ref(q, cos, sin), _rotate_ref(k, cos, sin)


@triton.jit
def rotate_halves(x1, x2, cos, sin, dt):
    """The rotated halves [x1 cos - x2 sin, x2 cos + x1 sin] of fp32 rows x1, x2 (cos, sin:
    one row each), in dtype `dt`: each product, then the sum, rounded to the input dtype (HF
    computes in q.dtype); the products of two fp16/bf16 values are exact in fp32, so this
    follows torch's rounding. (Measured on an H200: a few bf16 outputs per million still
    differ by one ulp.)"""
    c = cos[None, :]
    s = sin[None, :]
    a1 = (x1 * c).to(dt).to(tl.float32)
    b1 = (x2 * s).to(dt).to(tl.float32)
    a2 = (x2 * c).to(dt).to(tl.float32)
    b2 = (x1 * s).to(dt).to(tl.float32)
    return (a1 - b1).to(dt), (a2 + b2).to(dt)


@triton.jit
def _rotate_heads(
    x_ptr, o_ptr, token, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    H_PAD: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
):  # fmt: skip
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HALF)[None, :]
    x_row = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh
    o_row = o_ptr + token * stride_ot + offs_h[:, None] * stride_oh
    dt = o_ptr.dtype.element_ty
    x1 = tl.load(x_row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    first, second = rotate_halves(x1, x2, cos, sin, dt)
    tl.store(o_row + offs_d[None, :], first, mask=mask)
    tl.store(o_row + HALF + offs_d[None, :], second, mask=mask)
    if REST_PAD > 0:
        offs_r = tl.arange(0, REST_PAD)
        rmask = (offs_h < NUM_HEADS)[:, None] & (offs_r < HEAD_DIM - 2 * HALF)[None, :]
        rest = tl.load(x_row + 2 * HALF + offs_r[None, :], mask=rmask)
        tl.store(o_row + 2 * HALF + offs_r[None, :], rest, mask=rmask)


@triton.jit
def _load_cos_sin(
    positions_ptr, cache_ptr, token, stride_cache, dt,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    """The token's cos and sin rows, cast to the input dtype first (as HF does), in fp32."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    dmask = offs_d < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d, mask=dmask, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_d, mask=dmask, other=0.0)
    return cos.to(dt).to(tl.float32), sin.to(dt).to(tl.float32)


def rotary_launch_args(
    cos_sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, dict[str, int]]:
    """The cos/sin table with a contiguous row and the head/rotary sizes of a launch
    (constexprs and num_warps), shared by every kernel that rotates q and k."""
    half = cos_sin_cache.shape[-1] // 2
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    rest = head_dim - 2 * half
    hq_pad, half_pad = next_power_of_2(num_q_heads), next_power_of_2(half)
    return cache, {
        "NUM_Q_HEADS": num_q_heads, "NUM_KV_HEADS": num_kv_heads, "HEAD_DIM": head_dim,
        "HALF": half, "HQ_PAD": hq_pad, "HKV_PAD": next_power_of_2(num_kv_heads),
        "HALF_PAD": half_pad, "REST_PAD": next_power_of_2(rest) if rest > 0 else 0,
        "num_warps": max(1, min(8, hq_pad * half_pad // 512)),
    }  # fmt: skip


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    REST_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _load_cos_sin(
        positions_ptr, cache_ptr, token, stride_cache, q_out_ptr.dtype.element_ty, HALF, HALF_PAD
    )
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        token,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        cos,
        sin,
        NUM_Q_HEADS,
        HEAD_DIM,
        HALF,
        HQ_PAD,
        HALF_PAD,
        REST_PAD,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        token,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        cos,
        sin,
        NUM_KV_HEADS,
        HEAD_DIM,
        HALF,
        HKV_PAD,
        HALF_PAD,
        REST_PAD,
    )


def apply_rotary_emb_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("apply_rotary_emb needs a contiguous last (head_dim) dimension")
    if k.dtype != q.dtype:
        raise ValueError("q and k must share a dtype")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    cache, sizes = rotary_launch_args(cos_sin_cache, num_q_heads, num_kv_heads, head_dim)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, q_out, k_out, cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cache.stride(0),
        **sizes,
    )  # fmt: skip
    return q_out, k_out


def apply_rotary_emb(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] at `positions` [T]; returns new (q, k)."""
    fn = apply_rotary_emb_triton if use_triton(q) else apply_rotary_emb_ref
    return fn(positions, q, k, cos_sin_cache)
