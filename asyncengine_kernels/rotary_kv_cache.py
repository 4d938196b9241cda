"""Rotary embedding fused with the KV-cache write: one pass per token for the attention input.

q is rotated into a new tensor; k is rotated straight into its cache slot and v copied beside
it, so the rotated k never makes a round trip through memory and each layer launches one
kernel instead of two. Slot -1 (padding) rotates q only. Same conventions as
`asyncengine_kernels.rotary` (HF rounding) and `asyncengine_kernels.kv_cache_write` (cache layout,
slots, and the FP8 cache: k is rotated in the model dtype, then quantized with its scale as it is
stored).
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
from asyncengine_kernels.kv_cache_write import (
    check_kv_scales,
    is_fp8_kv,
    quantize_fp8,
    write_kv_cache_ref,
)
from asyncengine_kernels.rotary import (
    _load_cos_sin,
    _rotate_heads,
    apply_rotary_emb_ref,
    rotary_launch_args,
    rotate_halves,
)

__all__ = ["rotary_and_write_kv", "rotary_and_write_kv_ref", "rotary_and_write_kv_triton"]


def rotary_and_write_kv_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    q_rot, k_rot = apply_rotary_emb_ref(positions, q, k, cos_sin_cache)
    write_kv_cache_ref(k_rot, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q_rot


@triton.jit
def _rotate_heads_fp8(
    x_ptr, o_ptr, scale_ptr, token, stride_xt, stride_xh, stride_oh, cos, sin, dt,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    H_PAD: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
):  # fmt: skip
    """`asyncengine_kernels.rotary._rotate_heads` into an e4m3 row at o_ptr: rotated and rounded in
    the model dtype `dt` exactly as there, then divided by the head's scale and quantized."""
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    h_mask = offs_h < NUM_HEADS
    mask = h_mask[:, None] & (offs_d < HALF)[None, :]
    x_row = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh
    o_row = o_ptr + offs_h[:, None] * stride_oh
    scale = tl.load(scale_ptr + offs_h, mask=h_mask, other=1.0)[:, None]
    x1 = tl.load(x_row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    first, second = rotate_halves(x1, x2, cos, sin, dt)
    tl.store(o_row + offs_d[None, :], quantize_fp8(first, scale), mask=mask)
    tl.store(o_row + HALF + offs_d[None, :], quantize_fp8(second, scale), mask=mask)
    if REST_PAD > 0:
        offs_r = tl.arange(0, REST_PAD)
        rmask = h_mask[:, None] & (offs_r < HEAD_DIM - 2 * HALF)[None, :]
        rest = tl.load(x_row + 2 * HALF + offs_r[None, :], mask=rmask)
        tl.store(o_row + 2 * HALF + offs_r[None, :], quantize_fp8(rest, scale), mask=rmask)


@triton.jit
def _rotary_and_write_kv_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    cos_sin_ptr, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_cos_sin,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    REST_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_PDL: tl.constexpr, KV_FP8: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _load_cos_sin(
        positions_ptr, cos_sin_ptr, token, stride_cos_sin, q_out_ptr.dtype.element_ty,
        HALF, HALF_PAD,
    )  # fmt: skip
    _rotate_heads(
        q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
        NUM_Q_HEADS, HEAD_DIM, HALF, HQ_PAD, HALF_PAD, REST_PAD,
    )  # fmt: skip
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        k_dst = k_cache_ptr + (slot // BLOCK_SIZE) * stride_kcb + (slot % BLOCK_SIZE) * stride_kcs
        if KV_FP8:
            _rotate_heads_fp8(
                k_ptr, k_dst, k_scale_ptr, token, stride_kt, stride_kh, stride_kch, cos, sin,
                q_out_ptr.dtype.element_ty, NUM_KV_HEADS, HEAD_DIM, HALF, HKV_PAD, HALF_PAD,
                REST_PAD,
            )  # fmt: skip
        else:
            # The cache slot is k's output row: token 0 with row stride 0.
            _rotate_heads(
                k_ptr, k_dst, token, stride_kt, stride_kh, 0, stride_kch, cos, sin,
                NUM_KV_HEADS, HEAD_DIM, HALF, HKV_PAD, HALF_PAD, REST_PAD,
            )  # fmt: skip
        offs_h = tl.arange(0, HKV_PAD)
        offs_v = tl.arange(0, D_PAD)
        vmask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_v < HEAD_DIM)[None, :]
        src = token * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :]
        val = tl.load(v_ptr + src, mask=vmask)
        if KV_FP8:
            vs = tl.load(v_scale_ptr + offs_h, mask=offs_h < NUM_KV_HEADS, other=1.0)
            val = quantize_fp8(val, vs[:, None])
        v_dst = (slot // BLOCK_SIZE) * stride_vcb + (slot % BLOCK_SIZE) * stride_vcs
        dst = v_dst + offs_h[:, None] * stride_vch + offs_v[None, :]
        tl.store(v_cache_ptr + dst, val.to(v_cache_ptr.dtype.element_ty), mask=vmask)


def rotary_and_write_kv_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    for t in (q, k, v, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("rotary_and_write_kv needs a contiguous last (head_dim) dimension")
    check_kv_scales(k_cache, k_scale, v_scale)
    fp8 = is_fp8_kv(k_cache)
    if k.dtype != q.dtype or (k_cache.dtype != q.dtype and not fp8):
        raise ValueError("q, k and the K cache must share a dtype (or the cache be fp8)")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    cache, sizes = rotary_launch_args(cos_sin_cache, num_q_heads, num_kv_heads, head_dim)
    pdl = use_pdl(q)
    _rotary_and_write_kv_kernel[(num_tokens,)](
        positions, q, k, v, q_out, k_cache, v_cache, slot_mapping, cache,
        k_scale if fp8 else q, v_scale if fp8 else q,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cache.stride(0),
        D_PAD=next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1], USE_PDL=pdl, KV_FP8=fp8,
        **sizes, **pdl_kwargs(pdl),
    )  # fmt: skip
    return q_out


def rotary_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] at `positions` [T]; store the rotated k and v
    [T, Hkv, D] at `slot_mapping` [T] (-1 = skip) in the caches; return the rotated q. An
    FP8 cache needs `k_scale` and `v_scale` (float32 [Hkv])."""
    fn = rotary_and_write_kv_triton if use_triton(q) else rotary_and_write_kv_ref
    return fn(
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale
    )
