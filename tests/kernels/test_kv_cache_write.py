"""KV-cache write through the slot mapping: padding slots skipped, other slots untouched."""

from __future__ import annotations

import pytest
import torch

from kernels import write_kv_cache
from kernels.kv_cache_write import write_kv_cache_ref, write_kv_cache_triton
from tests.kernels.kernel_cases import requires_cuda


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
