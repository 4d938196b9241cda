"""Rotary embedding fused with the KV-cache write: one pass per token for the attention input.

q is rotated into a new tensor; k is rotated straight into its cache slot and v copied beside
it, so the rotated k never makes a round trip through memory and each layer launches one
kernel instead of two. Slot -1 (padding) rotates q only. Same conventions as
`kernels.rotary` (HF rounding) and `kernels.kv_cache_write` (cache layout, slots).
"""

from __future__ import annotations

import torch

from kernels._triton_utils import (
    next_power_of_2,
    pdl_kwargs,
    pdl_wait,
    tl,
    triton,
    use_pdl,
    use_triton,
)
from kernels.kv_cache_write import write_kv_cache_ref
from kernels.rotary import _load_cos_sin, _rotate_heads, apply_rotary_emb_ref, rotary_launch_args

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
) -> torch.Tensor:
    q_rot, k_rot = apply_rotary_emb_ref(positions, q, k, cos_sin_cache)
    write_kv_cache_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot


@triton.jit
def _rotary_and_write_kv_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_cos_sin,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    REST_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
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
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    for t in (q, k, v, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("rotary_and_write_kv needs a contiguous last (head_dim) dimension")
    if k.dtype != q.dtype or k_cache.dtype != q.dtype:
        raise ValueError("q, k and the K cache must share a dtype")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    cache, sizes = rotary_launch_args(cos_sin_cache, num_q_heads, num_kv_heads, head_dim)
    pdl = use_pdl(q)
    _rotary_and_write_kv_kernel[(num_tokens,)](
        positions, q, k, v, q_out, k_cache, v_cache, slot_mapping, cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cache.stride(0),
        D_PAD=next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1], USE_PDL=pdl, **sizes,
        **pdl_kwargs(pdl),
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
) -> torch.Tensor:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] at `positions` [T]; store the rotated k and v
    [T, Hkv, D] at `slot_mapping` [T] (-1 = skip) in the caches; return the rotated q."""
    fn = rotary_and_write_kv_triton if use_triton(q) else rotary_and_write_kv_ref
    return fn(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
