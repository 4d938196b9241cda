"""Decode attention with rotary and the KV write folded in, against rotary_and_write_kv then
paged attention (the two kernels it replaces), over a 16-bit or an FP8 cache."""

from __future__ import annotations

import pytest
import torch

from asyncengine_kernels.paged_attention import DecodeRotary, paged_attention_triton
from asyncengine_kernels.rotary_paged_attention import (
    paged_decode_attention_with_rotary,
    paged_decode_attention_with_rotary_ref,
    paged_decode_attention_with_rotary_triton,
)
from tests.asyncengine_kernels.kernel_cases import make_paged_batch, requires_cuda, to_fp8
from tests.asyncengine_kernels.test_rotary import _cos_sin_cache

HEAD_DIM, BLOCK = 32, 8
# 16: the new key ends a full tile (it is read by the unmasked loop); 0: a padding row.
LENS = [9, 1, 40, 16, 0]


def _case(
    heads: tuple[int, int],
    dtype: torch.dtype,
    lens: list[int] = LENS,
    device: str = "cpu",
    head_dim: int = HEAD_DIM,
    block: int = BLOCK,
    fp8: bool = False,
) -> tuple:
    hq, hkv = heads
    batch = make_paged_batch([1] * len(lens), lens, hq, hkv, head_dim, block, dtype, device, seed=3)
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(len(lens), (hq + 2 * hkv) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, : hq * head_dim].view(-1, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(-1, hkv, head_dim)
    v = qkv[:, (hq + hkv) * head_dim :].view(-1, hkv, head_dim)
    slots = []
    for b, n in enumerate(lens):
        if n == 0:
            slots.append(-1)
            continue
        slot = int(batch.block_tables[b, (n - 1) // block]) * block + (n - 1) % block
        slots.append(slot)
        # The new token's slot is unwritten: whatever reads it before the write gets NaN.
        for cache in (batch.k_cache, batch.v_cache):
            cache.view(-1, hkv, head_dim)[slot] = float("nan")
    if fp8:
        batch = to_fp8(batch, per_head=True)
    positions = torch.tensor([max(n - 1, 0) for n in lens], device=device)
    rotary = DecodeRotary(
        positions,
        _cos_sin_cache(head_dim, max_pos=max(lens) + 1).to(device),
        k,
        v,
        torch.tensor(slots, device=device),
    )
    return batch, q, rotary


def _run_both(heads: tuple[int, int], dtype: torch.dtype, case: dict | None = None, **kwargs):
    batch, q, rotary = _case(heads, dtype, **(case or {}))
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    tail = (batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale)
    want = paged_decode_attention_with_rotary_ref(
        q, rotary, k_ref, v_ref, *tail, **batch.scales()
    )
    got = paged_decode_attention_with_rotary_triton(
        q, rotary, batch.k_cache, batch.v_cache, *tail, **batch.scales(), **kwargs
    )
    return got, want, (batch.k_cache, batch.v_cache), (k_ref, v_ref)


@pytest.mark.parametrize("segments", [1, 4])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_equals_rotary_then_attention(
    segments: int, heads: tuple[int, int], dtype: torch.dtype
) -> None:
    got, want, caches, ref_caches = _run_both(heads, dtype, num_segments=segments)
    atol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    assert torch.isfinite(got).all()
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))  # the padding row
    # The rotated k and the v land in their slots exactly as the separate kernel writes them.
    for cache, ref in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(cache, ref, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("segments", [1, 4])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_fp8_cache_equals_rotary_then_attention(
    segments: int, heads: tuple[int, int], dtype: torch.dtype
) -> None:
    """The new k and v are quantized into their slot and attended to as stored."""
    got, want, caches, ref_caches = _run_both(
        heads, dtype, {"fp8": True}, num_segments=segments
    )
    atol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    assert torch.isfinite(got).all()
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))
    for cache, ref in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(cache.float(), ref.float(), atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("segments", [1, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_core_tiles_equal_rotary_then_attention(segments: int, fp8: bool) -> None:
    """The CUDA-core decode tiles (`VECTOR`, no MMA) take the new key and value from
    registers like the MMA tiles: same result, same cache writes."""
    batch, q, rotary = _case((4, 4), torch.float16, fp8=fp8)
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    tail = (batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale)
    want = paged_decode_attention_with_rotary_ref(
        q, rotary, k_ref, v_ref, *tail, **batch.scales()
    )
    tiles = {"VECTOR": 1, "TILE": 16, "num_warps": 1}
    got = paged_attention_triton(
        q, batch.k_cache, batch.v_cache, *tail, decode_only=True, num_segments=segments,
        rotary=rotary, small_tiles=tiles, **batch.scales(),
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))
    for cache, ref in zip((batch.k_cache, batch.v_cache), (k_ref, v_ref), strict=True):
        torch.testing.assert_close(cache.float(), ref.float(), atol=0, rtol=0, equal_nan=True)


def test_dispatcher_uses_the_reference_on_cpu_tensors() -> None:
    batch, q, rotary = _case((4, 2), torch.float32)
    tail = (batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale)
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    got = paged_decode_attention_with_rotary(q, rotary, batch.k_cache, batch.v_cache, *tail)
    want = paged_decode_attention_with_rotary_ref(q, rotary, k_ref, v_ref, *tail)
    assert torch.equal(got, want)


def test_rejects_a_step_that_is_not_all_decodes() -> None:
    batch, q, rotary = _case((4, 2), torch.float32)
    tail = (batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale)
    with pytest.raises(ValueError, match="one query token per sequence"):
        paged_decode_attention_with_rotary_triton(
            torch.cat([q, q]), rotary, batch.k_cache, batch.v_cache, *tail
        )


def test_rejects_k_with_strided_head_dim() -> None:
    batch, q, rotary = _case((4, 2), torch.float32)
    tail = (batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale)
    strided_k = torch.randn(*rotary.k.shape[:2], 2 * HEAD_DIM)[..., ::2]
    bad = DecodeRotary(rotary.positions, rotary.cos_sin_cache, strided_k, rotary.v,
                       rotary.slot_mapping)  # fmt: skip
    with pytest.raises(ValueError, match="contiguous heads"):
        paged_decode_attention_with_rotary_triton(q, bad, batch.k_cache, batch.v_cache, *tail)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("segments", [1, 4, 16])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8)])
def test_gpu_llama_sizes(segments: int, heads: tuple[int, int]) -> None:
    case = dict(lens=[1000, 1, 600, 64, 0], device="cuda", head_dim=128, block=16)
    got, want, caches, ref_caches = _run_both(heads, torch.bfloat16, case, num_segments=segments)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    for cache, ref in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(cache, ref, atol=2e-2, rtol=0, equal_nan=True)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("segments", [1, 4, 16])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8)])
def test_gpu_fp8_cache_llama_sizes(segments: int, heads: tuple[int, int]) -> None:
    case = dict(lens=[4000, 1, 600, 64, 0], device="cuda", head_dim=128, block=16, fp8=True)
    got, want, caches, ref_caches = _run_both(heads, torch.bfloat16, case, num_segments=segments)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    # A rotated k may sit one bf16 ulp off the reference's, and so one e4m3 step.
    for cache, ref in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(cache.float(), ref.float(), atol=2e-2, rtol=2.0**-3,
                                   equal_nan=True)  # fmt: skip
