"""Shared helpers of the kernel tests: the GPU skip mark, random paged-attention batches (16-bit
or FP8 caches) and a naive attention oracle."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from asyncengine_kernels.kv_cache_write import FP8_E4M3_MAX, dequantize_kv, quantize_kv

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B]
    scale: float
    k_scale: torch.Tensor | None = None  # float32 [Hkv], with an FP8 cache
    v_scale: torch.Tensor | None = None

    def scales(self) -> dict[str, torch.Tensor]:
        """The FP8 scales as keyword arguments of the ops (none for a 16-bit cache)."""
        if self.k_scale is None or self.v_scale is None:
            return {}
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.query_start_loc,
            self.seq_lens,
            self.scale,
        )


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    table_pad: int = -1,
    extra_blocks: int = 3,
    seed: int = 0,
) -> PagedBatch:
    """Random batch with shuffled blocks, NaN in every unwritten cache slot and `table_pad` in
    every block-table entry past a sequence's blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    max_blocks = max([*blocks_per_seq, 1]) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float32)
    v_cache = torch.full(shape, float("nan"), dtype=torch.float32)
    tables = torch.full((len(seq_lens), max_blocks), table_pad, dtype=torch.int32)
    used = 0
    for b, (n_blocks, s_len) in enumerate(zip(blocks_per_seq, seq_lens, strict=True)):
        ids = perm[used : used + n_blocks]
        used += n_blocks
        tables[b, :n_blocks] = ids.to(torch.int32)
        for p in range(s_len):
            blk, off = int(ids[p // block_size]), p % block_size
            k_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=gen)
    return PagedBatch(
        q=q.to(dtype).to(device),
        k_cache=k_cache.to(dtype).to(device),
        v_cache=v_cache.to(dtype).to(device),
        block_tables=tables.to(device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )


def llama_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    seed: int,
    block_size: int = 16,
    device: str | torch.device = "cuda",
) -> PagedBatch:
    """A GPU test batch at Llama sizes: head_dim 128, bf16, eight spare (NaN) blocks."""
    return make_paged_batch(
        q_lens, seq_lens, num_heads, num_kv_heads, head_dim=128, block_size=block_size,
        dtype=torch.bfloat16, device=device, seed=seed, extra_blocks=8,
    )  # fmt: skip


def naive_paged_attention(batch: PagedBatch) -> torch.Tensor:
    """Token-by-token, head-by-head attention in float64 (the oracle of the reference)."""
    q = batch.q.double().cpu()
    k_cache, v_cache = batch.k_cache.double().cpu(), batch.v_cache.double().cpu()
    tables = batch.block_tables.cpu()
    qsl = batch.query_start_loc.tolist()
    lens = batch.seq_lens.tolist()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    for b, seq_len in enumerate(lens):
        q_len = qsl[b + 1] - qsl[b]
        for j in range(q_len):
            pos = seq_len - q_len + j
            if pos < 0:
                continue
            keys = torch.arange(pos + 1)
            blk = tables[b, keys // block_size].long()
            k = k_cache[blk, keys % block_size]  # [n, Hkv, D]
            v = v_cache[blk, keys % block_size]
            for h in range(q.shape[1]):
                s = k[:, h // group] @ q[qsl[b] + j, h] * batch.scale
                out[qsl[b] + j, h] = torch.softmax(s, 0) @ v[:, h // group]
    return out


def to_fp8(batch: PagedBatch, per_head: bool) -> PagedBatch:
    """The batch with its caches quantized to e4m3 (NaN slots stay NaN). Scales map each
    head's (or the whole cache's) largest finite value to 3/4 of the e4m3 range."""
    scales = []
    for cache in (batch.k_cache, batch.v_cache):
        amax = torch.nan_to_num(cache.float(), nan=0.0).abs().amax(dim=(0, 1, 3))
        if not per_head:
            amax = amax.max().expand_as(amax)
        scales.append((amax.clamp(min=1e-6) / (0.75 * FP8_E4M3_MAX)).contiguous())
    k_scale, v_scale = scales
    return replace(
        batch,
        k_cache=quantize_kv(batch.k_cache, k_scale),
        v_cache=quantize_kv(batch.v_cache, v_scale),
        k_scale=k_scale,
        v_scale=v_scale,
    )


def dequantized(batch: PagedBatch) -> PagedBatch:
    """An FP8 batch with its caches dequantized to float32 (what its reference computes on)."""
    return replace(
        batch,
        k_cache=dequantize_kv(batch.k_cache, batch.k_scale),
        v_cache=dequantize_kv(batch.v_cache, batch.v_scale),
        k_scale=None,
        v_scale=None,
    )


def assert_only_long_rows_written(
    out: torch.Tensor,
    ref: torch.Tensor,
    query_start_loc: torch.Tensor,
    min_query_len: int,
    fill: float,
    atol: float,
) -> None:
    """A prefill launch's output: the rows of sequences with at least `min_query_len` query
    tokens match `ref`; the other sequences' rows still hold `fill`."""
    qsl = query_start_loc.tolist()
    for b in range(len(qsl) - 1):
        rows = slice(qsl[b], qsl[b + 1])
        if qsl[b + 1] - qsl[b] >= min_query_len:
            torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=atol, rtol=0)
        else:
            assert torch.equal(out[rows], torch.full_like(out[rows], fill))
