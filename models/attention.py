"""Paged attention layer: writes this step's K/V into the cache (rotating q and k on the way
when given the rotary table), then attends over it."""

from __future__ import annotations

import torch
from torch import nn

from kernels import paged_attention, rotary_and_write_kv, write_kv_cache
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
        )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
