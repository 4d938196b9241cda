"""Write this step's K/V rows into the paged KV cache through a slot mapping.

slot = block_id * block_size + offset; slot -1 marks a padding token (CUDA-graph padding,
tokens without a cache slot) and is skipped. The caches are
[num_blocks, block_size, num_kv_heads, head_dim] and are updated in place.
"""

from __future__ import annotations

import torch

from kernels._triton_utils import next_power_of_2, tl, triton, use_triton

__all__ = ["write_kv_cache", "write_kv_cache_ref", "write_kv_cache_triton"]


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain torch (the CPU path): copy the rows of tokens whose slot is >= 0."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    if bool((slots >= 0).all()):
        idx, kept = None, slots
    else:
        idx = torch.nonzero(slots >= 0).flatten()
        kept = slots[idx]
    keys = key if idx is None else key[idx]
    values = value if idx is None else value[idx]
    for cache, rows in ((k_cache, keys), (v_cache, values)):
        if cache.is_contiguous():
            # One index_copy_ into the [slots, heads, dim] view: the cheapest scatter on CPU.
            cache.view(-1, *cache.shape[2:]).index_copy_(0, kept, rows.to(cache.dtype))
        else:  # strided views: index by (block, offset)
            cache[kept // block_size, kept % block_size] = rows.to(cache.dtype)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src = token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    k = tl.load(key_ptr + src, mask=mask)
    dst = blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    src = token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    v = tl.load(value_ptr + src, mask=mask)
    dst = blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """One program per token copies its [Hkv, D] rows; int64 address math, no host sync."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for t in (key, value, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("write_kv_cache needs a contiguous last (head_dim) dimension")
    h_pad, d_pad = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, H_PAD=h_pad, D_PAD=d_pad,
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=max(1, min(8, h_pad * d_pad // 256)),
    )  # fmt: skip


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value [T, Hkv, D] at `slot_mapping` [T] (-1 = skip) in the caches, in place."""
    fn = write_kv_cache_triton if use_triton(key) else write_kv_cache_ref
    fn(key, value, k_cache, v_cache, slot_mapping)
