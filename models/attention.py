"""Paged attention layer: writes this step's K/V into the cache (rotating q and k on the way
when given the rotary table), then attends over it.

A decode-only step whose plan (`AttentionMetadata.decode_plan`, decided by the model runner)
fuses rotary folds the rotary and the K/V write into the attention kernel itself
(`kernels.rotary_paged_attention`): one kernel per layer instead of two.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import (
    paged_attention,
    paged_decode_attention_with_rotary,
    rotary_and_write_kv,
    write_kv_cache,
)
from kernels.paged_attention import DecodeRotary
from models.forward_context import get_attention_metadata


class Attention(nn.Module):
    """Attention over the paged KV cache bound by the model runner (`k_cache`, `v_cache`)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        cos_sin_cache: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q/k/v [T, H, D]; with `positions` and `cos_sin_cache`, q and k are rotated first."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("KV cache is not bound: the model runner binds it before a step")
        meta = get_attention_metadata()
        plan = meta.decode_plan if meta.decode_only else None
        segments = 1 if plan is None else plan.segments
        if (
            plan is not None
            and plan.fuse_rotary
            and cos_sin_cache is not None
            and positions is not None
            and cos_sin_cache.shape[-1] == self.head_dim
        ):
            rotary = DecodeRotary(positions, cos_sin_cache, k, v, meta.slot_mapping)
            out = paged_decode_attention_with_rotary(
                q, rotary, self.k_cache, self.v_cache, meta.block_tables,
                meta.query_start_loc, meta.seq_lens, self.scale, segments,
            )  # fmt: skip
            return out.reshape(q.shape[0], self.num_heads * self.head_dim)
        if cos_sin_cache is not None:
            if positions is None:
                raise ValueError("rotary embedding needs the positions")
            q = rotary_and_write_kv(
                positions, q, k, v, cos_sin_cache, self.k_cache, self.v_cache, meta.slot_mapping
            )
        else:
            write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            max_query_len=meta.max_query_len,
            decode_only=meta.decode_only,
            max_seq_len=meta.max_seq_len,
            num_segments=segments,
        )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
