"""Write this step's K/V rows into the paged KV cache through a slot mapping.

slot = block_id * block_size + offset; slot -1 marks a padding token (CUDA-graph padding,
tokens without a cache slot) and is skipped. The caches are
[num_blocks, block_size, num_kv_heads, head_dim] and are updated in place.

An FP8 cache (`torch.float8_e4m3fn`, `kv_cache_dtype="fp8"`) stores x / scale, clamped to the
e4m3 range (±448) and rounded to nearest: K and V each have a float32 scale per KV head
([num_kv_heads]; per-tensor scales are the same value in every entry), kept on the device so
CUDA graphs read whatever the scales hold. The write kernels quantize as they store; the
attention kernels load the e4m3 values and fold the scales into their math
(`asyncengine_kernels.paged_attention`). The helpers below are the torch side of the same format.
"""

from __future__ import annotations

import torch

from asyncengine_kernels._triton_utils import (
    interpreter_enabled,
    next_power_of_2,
    tl,
    triton,
    use_triton,
)
from asyncengine_kernels.fp8_format import FP8_DTYPE, FP8_E4M3_MAX, round_to_e4m3_grid

__all__ = [
    "FP8_E4M3_MAX",
    "FP8_KV_DTYPE",
    "as_bytes",
    "check_kv_scales",
    "dequantize_kv",
    "is_fp8_kv",
    "quantize_kv",
    "write_kv_cache",
    "write_kv_cache_ref",
    "write_kv_cache_triton",
]

FP8_KV_DTYPE = FP8_DTYPE


def is_fp8_kv(cache: torch.Tensor) -> bool:
    """Whether a KV cache stores e4m3 (and so needs its scales)."""
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, D] -> e4m3 of x / scale, clamped to ±448; scale float32 [Hkv]."""
    y = x.float() / scale[:, None]
    return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows [..., Hkv, D] in float32: e4m3 values times their head's scale; other
    dtypes are upcast as they are."""
    if x.dtype != FP8_KV_DTYPE:
        return x.float()
    assert scale is not None
    return x.float() * scale[:, None]


def check_kv_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """An FP8 cache needs float32 K and V scales of one entry per KV head."""
    if not is_fp8_kv(k_cache):
        return
    heads = k_cache.shape[2]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"an fp8 KV cache needs {name}")
        if s.dtype != torch.float32 or s.shape != (heads,) or s.device != k_cache.device:
            raise ValueError(
                f"{name} must be float32 [{heads}] on {k_cache.device}, got {s.dtype} "
                f"{list(s.shape)} on {s.device}"
            )


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache (or rows of one) as its bytes, to move or scatter: CPU torch has no
    index_copy_ or indexed assignment for float8. Other dtypes as they are."""
    return cache.view(torch.uint8) if cache.dtype == FP8_KV_DTYPE else cache


# The interpreter's float -> e4m3 cast truncates (`asyncengine_kernels.fp8_format`); there
# `quantize_fp8` rounds to the e4m3 grid first, so the cast has nothing left to round.
_EMULATE_FP8_ROUNDING = tl.constexpr(interpreter_enabled())


@triton.jit
def quantize_fp8(x, scale):
    """x / scale (IEEE division, as torch divides), clamped to ±448, as e4m3 (rounded to
    nearest even, as torch casts)."""
    y = tl.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if _EMULATE_FP8_ROUNDING:
        y = round_to_e4m3_grid(y)
    return y.to(tl.float8e4nv)


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Plain torch (the CPU path): copy the rows of tokens whose slot is >= 0 (quantized
    for an FP8 cache)."""
    check_kv_scales(k_cache, k_scale, v_scale)
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    if bool((slots >= 0).all()):
        idx, kept = None, slots
    else:
        idx = torch.nonzero(slots >= 0).flatten()
        kept = slots[idx]
    keys = key if idx is None else key[idx]
    values = value if idx is None else value[idx]
    for cache, rows, scale in ((k_cache, keys, k_scale), (v_cache, values, v_scale)):
        rows = quantize_kv(rows, scale) if scale is not None and is_fp8_kv(cache) else rows
        if cache.is_contiguous():
            # One index_copy_ into the [slots, heads, dim] view: the cheapest scatter on CPU.
            flat = as_bytes(cache.view(-1, *cache.shape[2:]))
            flat.index_copy_(0, kept, as_bytes(rows.to(cache.dtype)))
        else:  # strided views: index by (block, offset)
            as_bytes(cache)[kept // block_size, kept % block_size] = as_bytes(
                rows.to(cache.dtype)
            )


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    KV_FP8: tl.constexpr = False,
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
    if KV_FP8:
        ks = tl.load(k_scale_ptr + offs_h, mask=offs_h < NUM_KV_HEADS, other=1.0)
        k = quantize_fp8(k, ks[:, None])
    dst = blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    src = token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    v = tl.load(value_ptr + src, mask=mask)
    if KV_FP8:
        vs = tl.load(v_scale_ptr + offs_h, mask=offs_h < NUM_KV_HEADS, other=1.0)
        v = quantize_fp8(v, vs[:, None])
    dst = blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """One program per token copies its [Hkv, D] rows; int64 address math, no host sync."""
    num_tokens, num_kv_heads, head_dim = key.shape
    check_kv_scales(k_cache, k_scale, v_scale)
    fp8 = is_fp8_kv(k_cache)
    if num_tokens == 0:
        return
    for t in (key, value, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("write_kv_cache needs a contiguous last (head_dim) dimension")
    h_pad, d_pad = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else key, v_scale if fp8 else key,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, H_PAD=h_pad, D_PAD=d_pad,
        BLOCK_SIZE=k_cache.shape[1], KV_FP8=fp8,
        num_warps=max(1, min(8, h_pad * d_pad // 256)),
    )  # fmt: skip


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store key/value [T, Hkv, D] at `slot_mapping` [T] (-1 = skip) in the caches, in place.
    An FP8 cache needs `k_scale` and `v_scale` (float32 [Hkv]); other caches ignore them."""
    fn = write_kv_cache_triton if use_triton(key) else write_kv_cache_ref
    fn(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
