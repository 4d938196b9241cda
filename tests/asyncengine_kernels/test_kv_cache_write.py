"""KV-cache write through the slot mapping: padding slots skipped, other slots untouched; an
FP8 cache stores each head's values quantized with its scale."""

from __future__ import annotations

import pytest
import torch

from asyncengine_kernels import write_kv_cache
from asyncengine_kernels.kv_cache_write import (
    FP8_KV_DTYPE,
    dequantize_kv,
    quantize_kv,
    write_kv_cache_ref,
    write_kv_cache_triton,
)
from tests.asyncengine_kernels.kernel_cases import requires_cuda


def _case(tokens: int, hkv: int, dim: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator().manual_seed(tokens)
    num_blocks, block_size = tokens // 4 + 3, 8
    key = torch.randn(tokens, hkv, dim, generator=gen).to(device=device, dtype=dtype)
    value = torch.randn(tokens, hkv, dim, generator=gen).to(device=device, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::3] = -1  # padding tokens
    cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen).to(device, dtype)
    return key, value, cache, slots.to(device)


def test_reference_writes_valid_slots_only() -> None:
    key, value, k_cache, slots = _case(12, 2, 8, torch.float32)
    v_cache = k_cache.clone() + 1
    k_before, v_before = k_cache.clone(), v_cache.clone()
    write_kv_cache(key, value, k_cache, v_cache, slots.to(torch.int32))
    block_size = k_cache.shape[1]
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s // block_size, s % block_size], key[t])
            assert torch.equal(v_cache[s // block_size, s % block_size], value[t])
            written[s // block_size, s % block_size] = True
    assert torch.equal(k_cache[~written], k_before[~written])
    assert torch.equal(v_cache[~written], v_before[~written])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hkv,dim", [(2, 16), (3, 40)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_triton_matches_reference(
    dtype: torch.dtype, hkv: int, dim: int, slot_dtype: torch.dtype
) -> None:
    key, value, k_cache, slots = _case(10, hkv, dim, dtype)
    v_cache = k_cache.flip(0).contiguous()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(key, value, k_ref, v_ref, slots)
    write_kv_cache_triton(key, value, k_cache, v_cache, slots.to(slot_dtype))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_triton_strided_key_and_stacked_cache() -> None:
    """key/value as views of a fused qkv; caches as the two halves of one stacked tensor."""
    tokens, hq, hkv, dim = 6, 4, 2, 16
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim)
    key = qkv[:, hq * dim : (hq + hkv) * dim].view(tokens, hkv, dim)
    value = qkv[:, (hq + hkv) * dim :].view(tokens, hkv, dim)
    kv = torch.zeros(5, 2, 8, hkv, dim)
    slots = torch.tensor([0, 9, -1, 17, 39, 22])
    ref = kv.clone()
    write_kv_cache_ref(key, value, ref[:, 0], ref[:, 1], slots)
    write_kv_cache_triton(key, value, kv[:, 0], kv[:, 1], slots)
    assert torch.equal(kv, ref)
    assert torch.equal(kv[1, 0, 1], key[1])


@pytest.mark.gpu
@requires_cuda
def test_gpu_large_cache() -> None:
    key, value, k_cache, slots = _case(4096, 8, 128, torch.bfloat16, device="cuda")
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(key, value, k_ref, v_ref, slots)
    write_kv_cache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("per_head", [False, True])
def test_gpu_fp8_large_cache(per_head: bool) -> None:
    key, value, _, slots = _case(4096, 8, 128, torch.bfloat16, device="cuda")
    k_scale, v_scale = _fp8_scales(8, per_head, device="cuda")
    k_cache = torch.zeros(1027, 8, 8, 128, dtype=FP8_KV_DTYPE, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(key, value, k_ref, v_ref, slots, k_scale, v_scale)
    write_kv_cache_triton(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    # The same division and rounding on the device as in torch: the same bytes.
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


def _fp8_scales(hkv: int, per_head: bool, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """Scales that move values across the e4m3 range: some rows saturate at ±448 (tiny
    scales), others fall into the subnormals (large ones)."""
    if per_head:
        k_scale = torch.logspace(-3, 0.5, hkv, dtype=torch.float32)
    else:
        k_scale = torch.full((hkv,), 0.37, dtype=torch.float32)
    return k_scale.to(device), (2 * k_scale).to(device)


def test_fp8_reference_quantizes_with_each_heads_scale() -> None:
    key, value, _, slots = _case(12, 3, 8, torch.float32)
    k_scale, v_scale = _fp8_scales(3, per_head=True)
    k_cache = torch.zeros(6, 8, 3, 8, dtype=FP8_KV_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    write_kv_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for cache, x, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
            want = (x[t] / scale[:, None]).clamp(-448, 448).to(FP8_KV_DTYPE)
            assert torch.equal(cache[s // 8, s % 8].view(torch.uint8), want.view(torch.uint8))
    assert quantize_kv(torch.full((1, 3, 2), 1e6), k_scale).float().max() == 448.0
    deq = dequantize_kv(k_cache, k_scale)
    assert deq.dtype == torch.float32 and torch.isfinite(deq).all()


def test_fp8_cache_needs_scales_of_one_entry_per_head() -> None:
    key, value, _, slots = _case(4, 2, 8, torch.float32)
    k_cache = torch.zeros(4, 8, 2, 8, dtype=FP8_KV_DTYPE)
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_cache(key, value, k_cache, k_cache.clone(), slots)
    bad = torch.ones(3)
    with pytest.raises(ValueError, match=r"v_scale must be float32 \[2\]"):
        write_kv_cache(key, value, k_cache, k_cache.clone(), slots, torch.ones(2), bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("hkv,dim", [(2, 16), (3, 40)])
def test_triton_fp8_matches_reference(
    dtype: torch.dtype, per_head: bool, hkv: int, dim: int
) -> None:
    key, value, _, slots = _case(10, hkv, dim, dtype)
    key, value = key * 200, value * 200  # reach past ±448 * scale
    k_scale, v_scale = _fp8_scales(hkv, per_head)
    k_cache = torch.zeros(5, 8, hkv, dim, dtype=FP8_KV_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(key, value, k_ref, v_ref, slots, k_scale, v_scale)
    write_kv_cache_triton(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    # Both divide in IEEE float32 and round to nearest even: the same bytes.
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    assert (k_cache.float().abs() == 448).any()  # saturated, not NaN
    assert not torch.isnan(k_cache.float()).any()
