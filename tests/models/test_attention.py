"""The paged attention layer follows the step's decode plan: a plan that fuses rotary takes
the fused kernel and gives the same result as rotary + KV write + attention, over a 16-bit or
an FP8 cache (with the layer's per-head scales, which checkpoints set per rank)."""

from __future__ import annotations

import pytest
import torch

import models.attention
from asyncengine_kernels.kv_cache_write import quantize_kv
from asyncengine_kernels.paged_attention import DecodePlan
from models.attention import Attention
from models.forward_context import AttentionMetadata, set_forward_context
from models.layers import compute_cos_sin_cache

HQ, HKV, D, BLOCK = 4, 2, 16, 4


def _decode_step(
    seq_lens: list[int], plan: DecodePlan | None
) -> tuple[AttentionMetadata, torch.Tensor]:
    """A decode-only step: sequence b owns blocks [3b, 3b+3), its new token at seq_len - 1."""
    b = len(seq_lens)
    tables = torch.arange(3 * b, dtype=torch.int32).view(b, 3)
    slots = torch.tensor([int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK
                          for i, n in enumerate(seq_lens)])  # fmt: skip
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(b + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=1,
        decode_only=True,
        max_seq_len=max(seq_lens),
        decode_plan=plan,
    )
    return meta, torch.tensor([n - 1 for n in seq_lens])


def _layer_and_step(
    plan: DecodePlan | None, fp8: bool = False
) -> tuple[Attention, AttentionMetadata, tuple[torch.Tensor, ...]]:
    """A layer over a random cache (e4m3 with per-head scales, with `fp8`) and a decode step
    of four sequences (the longest 12): (layer, metadata, the layer's arguments q, k, v,
    positions, cos_sin)."""
    gen = torch.Generator().manual_seed(0)
    layer = Attention(HQ, HKV, D, D**-0.5)
    layer.k_cache = torch.randn(12, BLOCK, HKV, D, generator=gen)
    layer.v_cache = torch.randn(12, BLOCK, HKV, D, generator=gen)
    if fp8:
        layer.load_kv_scale("k_scale", torch.tensor([0.01, 0.02]), HKV)
        layer.load_kv_scale("v_scale", torch.tensor([0.012, 0.02]), HKV)
        layer.k_cache = quantize_kv(layer.k_cache, layer.k_scale)
        layer.v_cache = quantize_kv(layer.v_cache, layer.v_scale)
    meta, positions = _decode_step([5, 9, 12, 1], plan)
    q = torch.randn(4, HQ, D, generator=gen)
    k, v = torch.randn(4, HKV, D, generator=gen), torch.randn(4, HKV, D, generator=gen)
    cos_sin = compute_cos_sin_cache(D, 64, 10000.0, None)
    return layer, meta, (q, k, v, positions, cos_sin)


def _run(
    plan: DecodePlan | None, monkeypatch: pytest.MonkeyPatch, fp8: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    calls = 0
    fused_op = models.attention.paged_decode_attention_with_rotary

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return fused_op(*args, **kwargs)

    monkeypatch.setattr(models.attention, "paged_decode_attention_with_rotary", counting)
    layer, meta, args = _layer_and_step(plan, fp8)
    with set_forward_context(meta):
        out = layer(*args)
    assert layer.k_cache is not None
    return out, layer.k_cache, calls


def test_fused_decode_rotary_equals_the_separate_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    out_sep, cache_sep, calls_sep = _run(DecodePlan(2, fuse_rotary=False), monkeypatch)
    out_fused, cache_fused, calls_fused = _run(DecodePlan(2, fuse_rotary=True), monkeypatch)
    assert (calls_sep, calls_fused) == (0, 1)
    torch.testing.assert_close(out_fused, out_sep, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache_fused, cache_sep, atol=0, rtol=0)


def test_fp8_cache_gives_the_same_step_on_every_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused rotary (the kernel's reference), the separate ops, and the CPU path (no plan)
    write the same e4m3 bytes and attend alike over them."""
    out_fused, cache_fused, calls = _run(DecodePlan(2, fuse_rotary=True), monkeypatch, True)
    out_sep, cache_sep, _ = _run(DecodePlan(2, fuse_rotary=False), monkeypatch, True)
    out_cpu, cache_cpu, _ = _run(None, monkeypatch, True)
    assert calls == 1 and cache_fused.dtype == torch.float8_e4m3fn
    assert torch.equal(cache_fused.view(torch.uint8), cache_sep.view(torch.uint8))
    assert torch.equal(cache_cpu.view(torch.uint8), cache_sep.view(torch.uint8))
    torch.testing.assert_close(out_fused, out_sep, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_cpu, out_sep, atol=1e-5, rtol=1e-5)
    out_16, _, _ = _run(DecodePlan(2, fuse_rotary=False), monkeypatch)
    assert (out_sep - out_16).abs().max() < 0.25  # e4m3 keeps 3 mantissa bits


def test_a_step_without_a_plan_keeps_the_separate_rotary(monkeypatch: pytest.MonkeyPatch) -> None:
    """No plan (a step built without one, like the memory profile's) runs unfused, unsplit."""
    out_none, cache_none, calls = _run(None, monkeypatch)
    out_sep, cache_sep, _ = _run(DecodePlan(1, fuse_rotary=False), monkeypatch)
    assert calls == 0
    torch.testing.assert_close(out_none, out_sep, atol=0, rtol=0)
    torch.testing.assert_close(cache_none, cache_sep, atol=0, rtol=0)


@pytest.mark.parametrize("fuse_rotary", [True, False])
def test_the_layer_passes_the_plans_split_count_on(
    monkeypatch: pytest.MonkeyPatch, fuse_rotary: bool
) -> None:
    """The kernels take the split-KV count from the plan; neither path derives its own."""
    seen: list[object] = []
    fused_op = models.attention.paged_decode_attention_with_rotary
    plain_op = models.attention.paged_attention

    def fused(*args: object) -> torch.Tensor:
        seen.append(args[8])
        return fused_op(*args)

    def plain(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(kwargs["num_segments"])
        return plain_op(*args, **kwargs)

    monkeypatch.setattr(models.attention, "paged_decode_attention_with_rotary", fused)
    monkeypatch.setattr(models.attention, "paged_attention", plain)
    layer, meta, args = _layer_and_step(DecodePlan(8, fuse_rotary))
    with set_forward_context(meta):
        layer(*args)
    assert seen == [8]


@pytest.mark.parametrize("tp,total,expected", [
    (1, 4, [[1.0, 2.0, 3.0, 4.0]]),
    (2, 4, [[1.0, 2.0], [3.0, 4.0]]),  # each rank its own KV heads
    (4, 2, [[1.0], [1.0], [2.0], [2.0]]),  # more ranks than KV heads: replicated in pairs
])  # fmt: skip
def test_per_head_kv_scales_follow_the_ranks_kv_heads(
    tp: int, total: int, expected: list[list[float]]
) -> None:
    from models.parallel import set_tensor_parallel

    values = torch.arange(1.0, total + 1)
    try:
        for rank in range(tp):
            set_tensor_parallel(rank, tp)
            attn = Attention(HQ, max(total // tp, 1), D, D**-0.5)
            attn.load_kv_scale("v_scale", values, total)
            assert attn.v_scale.tolist() == expected[rank]
            assert attn.k_scale.tolist() == [1.0] * len(expected[rank])  # untouched
    finally:
        set_tensor_parallel(0, 1)
