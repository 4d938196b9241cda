"""The attention layer's CPU path: rotary, the KV-cache write and paged attention of one step,
with what every layer would otherwise derive again from the step's metadata worked out once.

On the CPU each torch op costs microseconds of dispatch whatever its size, and a decode step
runs the same ops in every layer: so `CpuStepIndex` (built by the first layer of a step, kept
on the step's metadata, read by the rest) holds the slots to write, the rotary factors at the
step's positions, the decode rows' block gather index and key mask, and the host copy of the
prefill layout. Per layer that leaves rotary of q and k together in four ops, two
`index_copy_`s for the cache and the attention itself:
- decode rows: with a float32 cache, one C kernel that reads their blocks in place
  (`asyncengine_kernels.cpu_decode_attention`); else one gather of their blocks and one masked SDPA
  (`paged_attention`'s reference does the same, `_decode_rows_ref`);
- a prefill chunk with no cached prefix attends over the step's own fresh k and v, causally,
  one SDPA per sequence, with no gather from the cache and no mask tensor; the query heads of a
  KV head attend over one broadcast view of its keys (no repeated K/V, and the CPU flash kernel
  stays in use, which `enable_gqa` with `is_causal` leaves);
- a chunk over a cached prefix gathers its blocks, as the reference does.

Results equal the references (`rotary_and_write_kv_ref`, `paged_attention_ref`): the rotary
products and sums are the same float operations, and attention differs by summation order
only. The layer takes this path only where the rotary table covers the whole head.

An FP8 cache stores e4m3 (`asyncengine_kernels.kv_cache_write.quantize_kv`) and attention runs in
float32 on the dequantized values; a fresh chunk attends over its own k and v quantized and
dequantized the same way, so every path sees the keys the cache holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from asyncengine_kernels.cpu_decode_attention import (
    decode_attention_available,
    paged_decode_attention_cpu,
)
from asyncengine_kernels.kv_cache_write import (
    check_kv_scales,
    dequantize_kv,
    is_fp8_kv,
    quantize_kv,
)
from asyncengine_kernels.paged_attention import decode_gather_index, decode_rows_attention

if TYPE_CHECKING:
    from asyncengine_kernels.attention_metadata import AttentionMetadata

__all__ = ["CpuStepIndex", "cpu_attention_step", "step_index"]


@dataclass
class _Rotary:
    """cos and signed sin at the step's positions, each [T, 1, D]: rot(x) = x * cos +
    swap_halves(x) * sin, the same products and sums as `asyncengine_kernels.rotary`'s reference."""

    table: torch.Tensor  # the cos/sin cache these were read from
    cos: torch.Tensor
    sin: torch.Tensor


# Chunks over a cached prefix of at most this many tokens attend row by row, as decodes.
SHORT_CHUNK_AS_ROWS = 16


class CpuStepIndex:
    """What every layer of one step needs from the attention metadata, derived once."""

    def __init__(
        self,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        decode_only: bool,
        max_seq_len: int | None,
    ) -> None:
        self.positions = positions.to(torch.int64)
        slots = slot_mapping.to(torch.int64)
        if bool((slots >= 0).all()):
            self.write_rows: torch.Tensor | None = None
            self.write_slots = slots
        else:
            self.write_rows = torch.nonzero(slots >= 0).flatten()
            self.write_slots = slots[self.write_rows]
        self._rotary: _Rotary | None = None
        lens = seq_lens.to(torch.int64)
        num_seqs, num_tokens = lens.numel(), slot_mapping.numel()
        self.decode_only = num_tokens == num_seqs and (
            decode_only or bool((query_start_loc.diff() == 1).all())
        )
        # Decode rows: token rows, their block tables and context lengths (for the C kernel,
        # `asyncengine_kernels.cpu_decode_attention`), and the longest context (for the gather
        # index).
        self.decode_tokens: torch.Tensor | None = None
        self.decode_rows: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._decode_gather: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.block_size = block_size
        # Multi-token sequences: (sequence, first token, query length, context length, fresh).
        self.chunks: list[tuple[int, int, int, int, bool]] = []
        if self.decode_only:
            max_len = max_seq_len if max_seq_len is not None else (
                int(lens.max()) if num_seqs else 0
            )  # fmt: skip
            if max_len > 0:
                self.decode_rows = (block_tables.to(torch.int64), lens, max_len)
            return
        starts, lens_host = query_start_loc.tolist(), lens.tolist()
        # Single tokens, and each token of a short chunk over a cached prefix (a speculative
        # verify step's last token and drafts), attend as decode rows: row i of a chunk sees
        # the context up to itself, which is causal attention without a mask or a gather.
        row_tokens: list[int] = []
        row_seqs: list[int] = []
        row_lens: list[int] = []
        for b in range(num_seqs):
            start, q_len, seq_len = starts[b], starts[b + 1] - starts[b], lens_host[b]
            if seq_len <= 0 or q_len < 1:
                continue
            if q_len == 1 or (q_len <= SHORT_CHUNK_AS_ROWS and q_len < seq_len):
                row_tokens.extend(range(start, start + q_len))
                row_seqs.extend([b] * q_len)
                row_lens.extend(range(seq_len - q_len + 1, seq_len + 1))
            else:
                self.chunks.append((b, start, q_len, seq_len, q_len == seq_len))
        if row_tokens:
            seqs = torch.tensor(row_seqs, dtype=torch.int64)
            self.decode_tokens = torch.tensor(row_tokens, dtype=torch.int64)
            self.decode_rows = (
                block_tables.index_select(0, seqs).to(torch.int64),
                torch.tensor(row_lens, dtype=torch.int64),
                max(row_lens),
            )

    @property
    def decode_gather(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The decode rows' gather index and key mask (`decode_gather_index`), built on
        first use: only the torch path reads it."""
        if self._decode_gather is None and self.decode_rows is not None:
            tables, lens, max_len = self.decode_rows
            self._decode_gather = decode_gather_index(tables, lens, max_len, self.block_size)
        return self._decode_gather

    def rotary(self, cos_sin_cache: torch.Tensor, dtype: torch.dtype) -> _Rotary:
        """The rotary factors read from this table, once per step for layers that share one
        table (`models.layers.RotaryEmbedding` shares it between equal configs)."""
        rot = self._rotary
        if rot is not None and rot.table is cos_sin_cache and rot.cos.dtype == dtype:
            return rot
        cos, sin = cos_sin_cache.index_select(0, self.positions).to(dtype).chunk(2, dim=-1)
        rot = _Rotary(
            cos_sin_cache,
            torch.cat((cos, cos), dim=-1).unsqueeze(1),
            torch.cat((-sin, sin), dim=-1).unsqueeze(1),
        )
        self._rotary = rot
        return rot


def step_index(meta: AttentionMetadata, positions: torch.Tensor,
               block_size: int) -> CpuStepIndex:  # fmt: skip
    """The step's `CpuStepIndex`, built by the first layer that asks and kept on `meta`
    (which a new step replaces)."""
    if meta.cpu_step_index is None:
        meta.cpu_step_index = CpuStepIndex(
            positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
            meta.block_tables, block_size, meta.decode_only, meta.max_seq_len,
        )  # fmt: skip
    return meta.cpu_step_index


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether k's heads follow q's in memory with the same strides (QKV output views)."""
    return (
        q.stride() == (q.stride(0), q.shape[2], 1) and k.stride() == q.stride()
        and k.dtype == q.dtype and k.shape[0] == q.shape[0]
        and k.data_ptr() == q.data_ptr() + q.shape[1] * q.shape[2] * q.element_size()
    )  # fmt: skip


def _rotate_qk(qk: torch.Tensor, rot: _Rotary) -> torch.Tensor:
    """Rotary on heads [T, H, D] (q and k side by side, or either) -> a new tensor."""
    half = qk.shape[-1] // 2
    swapped = qk.roll(half, dims=-1)  # [x2, x1]
    out = qk * rot.cos
    return out.add_(swapped.mul_(rot.sin))


def _fresh_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                  ) -> torch.Tensor:  # fmt: skip
    """Causal attention of a sequence over its own keys: q [L, Hq, D], k, v [L, Hkv, D] ->
    [L, Hq, D]."""
    length, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qg = q.view(length, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    shape = (num_kv_heads, group, length, head_dim)
    kg = k.transpose(0, 1).unsqueeze(1).expand(shape)
    vg = v.transpose(0, 1).unsqueeze(1).expand(shape)
    o = F.scaled_dot_product_attention(qg.float(), kg.float(), vg.float(), is_causal=True,
                                       scale=scale)  # fmt: skip
    return o.reshape(num_heads, length, head_dim).transpose(0, 1)


def _cached_chunk(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
    seq_len: int, scale: float, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """A chunk over a cached prefix: the reference's gather and masked SDPA."""
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    blocks = table[: -(-seq_len // block_size)].to(torch.int64)
    k = k_cache.flatten(1).index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
    v = v_cache.flatten(1).index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
    key_pos = torch.arange(seq_len)
    mask = key_pos[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]
    k, v = dequantize_kv(k, k_scale), dequantize_kv(v, v_scale)
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads,
    )  # fmt: skip
    return o.transpose(0, 1)


def _decode_rows(
    index: CpuStepIndex, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    scale: float, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """Attention of the step's decode rows -> [n, Hq, D] float32: the C kernel over the
    blocks in place where it applies (float32), else the gather and masked SDPA."""
    assert index.decode_rows is not None
    tables, lens, _ = index.decode_rows
    if (
        q.dtype == torch.float32 and k_cache.dtype == torch.float32
        and decode_attention_available()
    ):  # fmt: skip
        return paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, scale)
    gather = index.decode_gather
    assert gather is not None
    return decode_rows_attention(q, k_cache, v_cache, *gather, scale, k_scale, v_scale)


def cpu_attention_step(
    index: CpuStepIndex,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k (with a table), write k and v into the caches, attend; q [T, Hq, D],
    k, v [T, Hkv, D] -> [T, Hq, D] in q.dtype. With a table, q and k must be adjacent heads
    of one tensor (the fused QKV projection's output), which is rotated in one pass. An FP8
    cache takes `k_scale` and `v_scale` (float32 [Hkv])."""
    check_kv_scales(k_cache, k_scale, v_scale)
    fp8 = is_fp8_kv(k_cache)
    num_heads = q.shape[1]
    if cos_sin_cache is not None:
        rot = index.rotary(cos_sin_cache, q.dtype)
        if _adjacent_heads(q, k):
            t, head_dim = q.shape[0], q.shape[2]
            qk = q.as_strided((t, num_heads + k.shape[1], head_dim), (q.stride(0), head_dim, 1))
            qk = _rotate_qk(qk, rot)
            q, k = qk[:, :num_heads], qk[:, num_heads:]
        else:
            q, k = _rotate_qk(q, rot), _rotate_qk(k, rot)
    rows = index.write_rows
    if fp8:
        assert k_scale is not None and v_scale is not None
        # Quantized once: written to the cache (as bytes: CPU torch cannot index_copy_
        # float8) and, dequantized, the k and v a fresh chunk attends over.
        k8, v8 = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
        for cache, new in ((k_cache, k8), (v_cache, v8)):
            src = new if rows is None else new.index_select(0, rows)
            flat = cache.view(-1, *cache.shape[2:]).view(torch.uint8)
            flat.index_copy_(0, index.write_slots, src.view(torch.uint8))
        if index.chunks:
            k, v = dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale)
    else:
        for cache, new in ((k_cache, k), (v_cache, v)):
            src = new if rows is None else new.index_select(0, rows)
            flat = cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, index.write_slots, src.to(cache.dtype))
    scales = (k_scale, v_scale)
    if index.decode_only:
        if index.decode_rows is None:
            return torch.zeros_like(q)
        return _decode_rows(index, q, k_cache, v_cache, scale, *scales).to(q.dtype)
    out = torch.zeros(q.shape, dtype=torch.float32)
    if index.decode_rows is not None and index.decode_tokens is not None:
        tok = index.decode_tokens
        out[tok] = _decode_rows(index, q[tok], k_cache, v_cache, scale, *scales)
    for b, start, q_len, seq_len, fresh in index.chunks:
        end = start + q_len
        if fresh:
            o = _fresh_causal(q[start:end], k[start:end], v[start:end], scale)
        else:
            o = _cached_chunk(
                q[start:end], k_cache, v_cache, block_tables[b], seq_len, scale, *scales
            )
        out[start:end] = o
    return out.to(q.dtype)
