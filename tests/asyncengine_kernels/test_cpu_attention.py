"""The CPU attention step equals the reference ops (rotary + KV write, paged attention) on
decode, fresh prefill, chunks over a cached prefix, their mix and padding slots, with a 16-bit
or an FP8 cache."""

from __future__ import annotations

import pytest
import torch

import asyncengine_kernels.cpu_attention as cpu_attention
from asyncengine_kernels.cpu_attention import CpuStepIndex, cpu_attention_step
from asyncengine_kernels.kv_cache_write import FP8_KV_DTYPE, quantize_kv, write_kv_cache_ref
from asyncengine_kernels.paged_attention import paged_attention_ref
from asyncengine_kernels.rotary_kv_cache import rotary_and_write_kv_ref
from models.layers import compute_cos_sin_cache

HQ, HKV, D, BLOCK, NUM_BLOCKS = 6, 2, 16, 4, 40
SCALE = D**-0.5


def _step(
    chunks: list[tuple[int, int]], pad: int = 0, gen: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """Sequence b has `cached` tokens in the cache and `new` tokens in the step (b owns
    blocks [8b, 8b + 8), shuffled); `pad` trailing padding tokens have slot -1."""
    gen = gen or torch.Generator().manual_seed(0)
    b = len(chunks)
    perm = torch.randperm(NUM_BLOCKS, generator=gen)[: 8 * b].view(b, 8).to(torch.int32)
    positions, slots, qsl = [], [], [0]
    for i, (cached, new) in enumerate(chunks):
        for p in range(cached, cached + new):
            positions.append(p)
            slots.append(int(perm[i, p // BLOCK]) * BLOCK + p % BLOCK)
        qsl.append(qsl[-1] + new)
    positions += [0] * pad
    slots += [-1] * pad
    return {
        "positions": torch.tensor(positions),
        "slot_mapping": torch.tensor(slots),
        "query_start_loc": torch.tensor(qsl, dtype=torch.int32),
        "seq_lens": torch.tensor([c + n for c, n in chunks], dtype=torch.int32),
        "block_tables": perm,
    }


def _qkv(t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as views of one fused projection output, as the model hands them over."""
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=gen)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    return q.view(t, HQ, D), k.view(t, HKV, D), v.view(t, HKV, D)


CASES = {
    "decode": ([(5, 1), (12, 1), (0, 1), (31, 1)], 0),
    "fresh prefill": ([(0, 7), (0, 1), (0, 13)], 0),
    "cached prefix": ([(9, 6), (4, 3)], 0),
    "mixed with padding": ([(0, 9), (6, 1), (10, 5), (3, 1)], 3),
}


@pytest.mark.parametrize("c_kernel", [True, False], ids=["c-decode", "torch-decode"])
@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_step_equals_the_reference(
    case: str, rotary: bool, c_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode rows through the C kernel (`asyncengine_kernels.cpu_decode_attention`, where it
    builds) or through the gather and SDPA."""
    if c_kernel and not cpu_attention.decode_attention_available():
        pytest.skip("no C compiler for the decode attention kernel")
    if not c_kernel:
        monkeypatch.setattr(cpu_attention, "decode_attention_available", lambda: False)
    chunks, pad = CASES[case]
    gen = torch.Generator().manual_seed(1)
    step = _step(chunks, pad, gen)
    t = step["positions"].numel()
    q, k, v = _qkv(t, gen)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, HKV, D, generator=gen)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, HKV, D, generator=gen)
    table = compute_cos_sin_cache(D, 64, 10000.0, None) if rotary else None
    decode_only = all(n == 1 for _, n in chunks) and pad == 0

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    if table is not None:
        q_ref = rotary_and_write_kv_ref(
            step["positions"], q, k, v, table, ref_k, ref_v, step["slot_mapping"]
        )
    else:
        q_ref = q
        rows = step["slot_mapping"] >= 0
        ref_k.view(-1, HKV, D)[step["slot_mapping"][rows]] = k[rows]
        ref_v.view(-1, HKV, D)[step["slot_mapping"][rows]] = v[rows]
    expected = paged_attention_ref(
        q_ref, ref_k, ref_v, step["block_tables"], step["query_start_loc"], step["seq_lens"],
        SCALE, decode_only=decode_only,
    )  # fmt: skip

    index = CpuStepIndex(
        step["positions"], step["slot_mapping"], step["query_start_loc"], step["seq_lens"],
        step["block_tables"], BLOCK, decode_only, None,
    )  # fmt: skip
    out = cpu_attention_step(
        index, q, k, v, table, k_cache, v_cache, step["block_tables"], SCALE
    )
    # The cache writes are the same float operations; attention differs in summation order.
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0)
    real = t - pad
    torch.testing.assert_close(out[:real], expected[:real], atol=1e-5, rtol=1e-5)


def test_separate_q_and_k_tensors_rotate_alike() -> None:
    """q and k that are not adjacent heads of one tensor take the per-tensor rotation."""
    gen = torch.Generator().manual_seed(2)
    step = _step([(0, 6), (2, 3)], 0, gen)
    q, k, v = _qkv(9, gen)
    table = compute_cos_sin_cache(D, 64, 10000.0, None)
    outs = []
    for qq, kk, vv in ((q, k, v), (q.clone(), k.clone(), v.clone())):
        k_cache = torch.zeros(NUM_BLOCKS, BLOCK, HKV, D)
        v_cache = torch.zeros(NUM_BLOCKS, BLOCK, HKV, D)
        index = CpuStepIndex(
            step["positions"], step["slot_mapping"], step["query_start_loc"], step["seq_lens"],
            step["block_tables"], BLOCK, False, None,
        )  # fmt: skip
        out = cpu_attention_step(
            index, qq, kk, vv, table, k_cache, v_cache, step["block_tables"], SCALE
        )
        outs.append((out, k_cache))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=0, rtol=0)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=0, rtol=0)


def test_the_step_index_reads_the_rotary_table_once_per_table() -> None:
    step = _step([(3, 1), (7, 1)])
    index = CpuStepIndex(
        step["positions"], step["slot_mapping"], step["query_start_loc"], step["seq_lens"],
        step["block_tables"], BLOCK, True, None,
    )  # fmt: skip
    table = compute_cos_sin_cache(D, 64, 10000.0, None)
    first = index.rotary(table, torch.float32)
    assert index.rotary(table, torch.float32) is first
    other = index.rotary(table.clone(), torch.float32)
    assert other is not first
    torch.testing.assert_close(other.cos, first.cos, atol=0, rtol=0)


@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_step_with_fp8_cache_equals_the_reference(case: str, rotary: bool) -> None:
    chunks, pad = CASES[case]
    gen = torch.Generator().manual_seed(2)
    step = _step(chunks, pad, gen)
    t = step["positions"].numel()
    q, k, v = _qkv(t, gen)
    k_scale = torch.tensor([0.01, 0.02])
    v_scale = torch.tensor([0.015, 0.005])
    k_cache = quantize_kv(torch.randn(NUM_BLOCKS, BLOCK, HKV, D, generator=gen), k_scale)
    v_cache = quantize_kv(torch.randn(NUM_BLOCKS, BLOCK, HKV, D, generator=gen), v_scale)
    table = compute_cos_sin_cache(D, 64, 10000.0, None) if rotary else None
    decode_only = all(n == 1 for _, n in chunks) and pad == 0
    scales = {"k_scale": k_scale, "v_scale": v_scale}

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    if table is not None:
        q_ref = rotary_and_write_kv_ref(
            step["positions"], q, k, v, table, ref_k, ref_v, step["slot_mapping"], **scales
        )
    else:
        q_ref = q
        write_kv_cache_ref(k, v, ref_k, ref_v, step["slot_mapping"], **scales)
    expected = paged_attention_ref(
        q_ref, ref_k, ref_v, step["block_tables"], step["query_start_loc"], step["seq_lens"],
        SCALE, decode_only=decode_only, **scales,
    )  # fmt: skip
    index = CpuStepIndex(
        step["positions"], step["slot_mapping"], step["query_start_loc"], step["seq_lens"],
        step["block_tables"], BLOCK, decode_only, None,
    )  # fmt: skip
    out = cpu_attention_step(
        index, q, k, v, table, k_cache, v_cache, step["block_tables"], SCALE, k_scale, v_scale
    )
    assert k_cache.dtype == FP8_KV_DTYPE
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    real = t - pad
    torch.testing.assert_close(out[:real], expected[:real], atol=1e-5, rtol=1e-5)
