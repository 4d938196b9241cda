"""The paged attention layer: the fused decode-rotary switch takes its own path and gives
the same result as rotary + KV write + attention."""

from __future__ import annotations

import pytest
import torch

import models.attention
from models.attention import Attention
from models.forward_context import AttentionMetadata, set_forward_context
from models.layers import compute_cos_sin_cache

HQ, HKV, D, BLOCK = 4, 2, 16, 4


def _decode_step(seq_lens: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
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
    )
    return meta, torch.tensor([n - 1 for n in seq_lens])


def _layer_and_step() -> tuple[Attention, AttentionMetadata, tuple[torch.Tensor, ...]]:
    """A layer over a random cache and a decode step of four sequences (the longest 12):
    (layer, metadata, the layer's arguments q, k, v, positions, cos_sin)."""
    gen = torch.Generator().manual_seed(0)
    layer = Attention(HQ, HKV, D, D**-0.5)
    layer.k_cache = torch.randn(12, BLOCK, HKV, D, generator=gen)
    layer.v_cache = torch.randn(12, BLOCK, HKV, D, generator=gen)
    meta, positions = _decode_step([5, 9, 12, 1])
    q = torch.randn(4, HQ, D, generator=gen)
    k, v = torch.randn(4, HKV, D, generator=gen), torch.randn(4, HKV, D, generator=gen)
    cos_sin = compute_cos_sin_cache(D, 64, 10000.0, None)
    return layer, meta, (q, k, v, positions, cos_sin)


def _run(
    fused: bool, monkeypatch: pytest.MonkeyPatch, split_kv: bool = True
) -> tuple[torch.Tensor, torch.Tensor, int]:
    monkeypatch.setattr(models.attention, "FUSED_DECODE_ROTARY", fused)
    monkeypatch.setattr(models.attention, "decode_uses_split_kv", lambda *_: split_kv)
    calls = 0
    fused_op = models.attention.paged_decode_attention_with_rotary

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return fused_op(*args, **kwargs)

    monkeypatch.setattr(models.attention, "paged_decode_attention_with_rotary", counting)
    layer, meta, args = _layer_and_step()
    with set_forward_context(meta):
        out = layer(*args)
    return out, layer.k_cache, calls


def test_fused_decode_rotary_equals_the_separate_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    out_sep, cache_sep, calls_sep = _run(False, monkeypatch)
    out_fused, cache_fused, calls_fused = _run(True, monkeypatch)
    assert (calls_sep, calls_fused) == (0, 1)
    torch.testing.assert_close(out_fused, out_sep, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache_fused, cache_sep, atol=0, rtol=0)


def test_decode_batches_without_split_kv_keep_the_separate_rotary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode batch large enough to fill the GPU without split-KV takes the rotary/KV-write
    kernel and plain attention, where that measured faster."""
    out_big, cache_big, calls = _run(True, monkeypatch, split_kv=False)
    out_sep, cache_sep, _ = _run(False, monkeypatch)
    assert calls == 0
    torch.testing.assert_close(out_big, out_sep, atol=0, rtol=0)
    torch.testing.assert_close(cache_big, cache_sep, atol=0, rtol=0)


def test_split_kv_choice_follows_the_batch_size() -> None:
    from kernels.paged_attention import decode_uses_split_kv

    cpu = torch.device("cpu")  # one "multiprocessor": only a single program could split
    assert decode_uses_split_kv(1, 1, cpu)
    assert not decode_uses_split_kv(4, 2, cpu)


def test_the_layer_passes_the_longest_context_to_both_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The split-KV count follows the step's longest context, a host fact the layer hands on."""
    seen: list[object] = []
    fused_op = models.attention.paged_decode_attention_with_rotary
    plain_op = models.attention.paged_attention

    def fused(*args: object) -> torch.Tensor:
        seen.append(args[8])
        return fused_op(*args)

    def plain(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(kwargs["max_seq_len"])
        return plain_op(*args, **kwargs)

    monkeypatch.setattr(models.attention, "paged_decode_attention_with_rotary", fused)
    monkeypatch.setattr(models.attention, "paged_attention", plain)
    monkeypatch.setattr(models.attention, "decode_uses_split_kv", lambda *_: True)
    layer, meta, args = _layer_and_step()
    for fused_rotary in (True, False):
        monkeypatch.setattr(models.attention, "FUSED_DECODE_ROTARY", fused_rotary)
        with set_forward_context(meta):
            layer(*args)
    assert seen == [12, 12]
