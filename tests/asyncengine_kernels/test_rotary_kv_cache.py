"""Rotary fused with the KV-cache write: equal to rotary followed by the cache write, into a
16-bit or an FP8 cache."""

from __future__ import annotations

import pytest
import torch

from asyncengine_kernels import rotary_and_write_kv
from asyncengine_kernels.kv_cache_write import FP8_KV_DTYPE, write_kv_cache_triton
from asyncengine_kernels.rotary import apply_rotary_emb_triton
from asyncengine_kernels.rotary_kv_cache import rotary_and_write_kv_ref, rotary_and_write_kv_triton
from tests.asyncengine_kernels.kernel_cases import requires_cuda
from tests.asyncengine_kernels.test_rotary import _cos_sin_cache

BLOCK_SIZE = 8


def _case(tokens: int, hq: int, hkv: int, dim: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator().manual_seed(tokens * 7 + hq)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=gen).to(device, dtype)
    # q/k/v as strided views of one fused projection, as the model passes them.
    q = qkv[:, : hq * dim].view(tokens, hq, dim)
    k = qkv[:, hq * dim : (hq + hkv) * dim].view(tokens, hkv, dim)
    v = qkv[:, (hq + hkv) * dim :].view(tokens, hkv, dim)
    num_blocks = tokens // BLOCK_SIZE + 3
    # K and V caches as the two halves of one stacked tensor, as the runner lays them out.
    kv = torch.randn(2, num_blocks, BLOCK_SIZE, hkv, dim, generator=gen).to(device, dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:tokens]
    slots[1::4] = -1  # padding rows
    pos = torch.randint(0, 256, (tokens,), generator=gen)
    return pos.to(device), q, k, v, kv, slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,dim,rot", [((4, 2), 32, 32), ((2, 2), 64, 64), ((3, 1), 48, 32)])
def test_triton_matches_reference(
    dtype: torch.dtype, heads: tuple[int, int], dim: int, rot: int
) -> None:
    pos, q, k, v, kv, slots = _case(11, *heads, dim, dtype)
    cache = _cos_sin_cache(rot)
    kv_ref = kv.clone()
    q_ref = rotary_and_write_kv_ref(pos, q, k, v, cache, kv_ref[0], kv_ref[1], slots)
    q_tri = rotary_and_write_kv_triton(pos, q, k, v, cache, kv[0], kv[1], slots)
    # The interpreter rounds to bf16 toward zero, GPUs to nearest: 1 bf16 ulp there.
    tol = 2.0**-6 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(q_tri, q_ref, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(kv, kv_ref, atol=tol * 4, rtol=tol)
    # V is copied bit for bit, and slots that were not written keep their old contents.
    written = slots[slots >= 0]
    assert torch.equal(kv[1].view(-1, *kv.shape[3:])[written], v[slots >= 0])
    untouched = torch.ones(kv.shape[1] * BLOCK_SIZE, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(kv.view(2, -1, *kv.shape[3:])[:, untouched],
                       kv_ref.view(2, -1, *kv.shape[3:])[:, untouched])


def test_equals_the_two_kernels_it_replaces() -> None:
    pos, q, k, v, kv, slots = _case(9, 4, 2, 32, torch.float16)
    cache = _cos_sin_cache(32)
    kv_two = kv.clone()
    q_two, k_two = apply_rotary_emb_triton(pos, q, k, cache)
    write_kv_cache_triton(k_two, v, kv_two[0], kv_two[1], slots)
    q_one = rotary_and_write_kv(pos, q, k, v, cache, kv[0], kv[1], slots)
    assert torch.equal(q_one, q_two) and torch.equal(kv, kv_two)


def test_inputs_are_left_untouched() -> None:
    pos, q, k, v, kv, slots = _case(6, 2, 2, 16, torch.float32)
    before = [t.clone() for t in (q, k, v)]
    rotary_and_write_kv_triton(pos, q, k, v, _cos_sin_cache(16), kv[0], kv[1], slots)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), before, strict=True))


def _fp8_case(tokens: int, hq: int, hkv: int, dim: int, dtype: torch.dtype, device: str = "cpu"):
    pos, q, k, v, kv, slots = _case(tokens, hq, hkv, dim, dtype, device)
    kv8 = torch.zeros(kv.shape, dtype=FP8_KV_DTYPE, device=device)
    k_scale = torch.linspace(0.05, 0.4, hkv, device=device)
    return pos, q, k * 20, v * 20, kv8, slots, k_scale, 2 * k_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,dim,rot", [((4, 2), 32, 32), ((3, 1), 48, 32)])
def test_triton_fp8_cache_matches_reference(
    dtype: torch.dtype, heads: tuple[int, int], dim: int, rot: int
) -> None:
    pos, q, k, v, kv, slots, k_scale, v_scale = _fp8_case(11, *heads, dim, dtype)
    cache = _cos_sin_cache(rot)
    kv_ref = kv.clone()
    q_ref = rotary_and_write_kv_ref(
        pos, q, k, v, cache, kv_ref[0], kv_ref[1], slots, k_scale, v_scale
    )
    q_tri = rotary_and_write_kv_triton(pos, q, k, v, cache, kv[0], kv[1], slots, k_scale, v_scale)
    tol = 2.0**-6 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(q_tri, q_ref, atol=tol * 4, rtol=tol)
    # V is quantized from the same values: the same bytes. K is rotated first; where the
    # interpreter's bf16 rounding (toward zero) moves a rotated value by an ulp of its terms
    # (x * cos and x * sin, which may nearly cancel), its e4m3 code moves by a step or more.
    assert torch.equal(kv[1].view(torch.uint8), kv_ref[1].view(torch.uint8))
    if dtype == torch.bfloat16:
        deq = kv[0].float() * k_scale[:, None]
        deq_ref = kv_ref[0].float() * k_scale[:, None]
        atol = 2.0**-6 * float(k.abs().max())
        torch.testing.assert_close(deq, deq_ref, rtol=2.0**-3, atol=atol)
    else:
        assert torch.equal(kv[0].view(torch.uint8), kv_ref[0].view(torch.uint8))
    assert kv[0].float().abs().max() == 448  # some rows saturate


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("heads", [(32, 32), (32, 8)])
def test_gpu_fp8_cache_equals_rotary_then_fp8_write(heads: tuple[int, int]) -> None:
    pos, q, k, v, kv, slots, k_scale, v_scale = _fp8_case(
        1000, *heads, 128, torch.bfloat16, device="cuda"
    )
    cache = _cos_sin_cache(128).cuda()
    kv_two = kv.clone()
    q_two, k_two = apply_rotary_emb_triton(pos, q, k, cache)
    write_kv_cache_triton(k_two, v, kv_two[0], kv_two[1], slots, k_scale, v_scale)
    q_one = rotary_and_write_kv_triton(
        pos, q, k, v, cache, kv[0], kv[1], slots, k_scale, v_scale
    )
    assert torch.equal(q_one, q_two)
    assert torch.equal(kv.view(torch.uint8), kv_two.view(torch.uint8))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("heads", [(32, 32), (32, 8)])
def test_gpu_equals_the_two_kernels_at_llama_size(heads: tuple[int, int]) -> None:
    pos, q, k, v, kv, slots = _case(1000, *heads, 128, torch.bfloat16, device="cuda")
    cache = _cos_sin_cache(128).cuda()
    kv_two = kv.clone()
    q_two, k_two = apply_rotary_emb_triton(pos, q, k, cache)
    write_kv_cache_triton(k_two, v, kv_two[0], kv_two[1], slots)
    q_one = rotary_and_write_kv_triton(pos, q, k, v, cache, kv[0], kv[1], slots)
    assert torch.equal(q_one, q_two) and torch.equal(kv, kv_two)
