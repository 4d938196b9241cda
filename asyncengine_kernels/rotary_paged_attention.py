"""Decode attention with rotary and the KV-cache write folded in (one kernel per layer).

At batch sizes where a decode step is latency-bound, the separate rotary/KV-write kernel is
a launch and a round trip per layer. Here the attention programs rotate their own q rows;
the one program per sequence and KV head whose split-KV segment holds the new key rotates
it, writes k and v to their cache slot and uses them from registers, so no program reads a
slot written in the same launch. The reference is the two separate ops. With an FP8 cache
the new k and v are quantized as they are stored and attended to as stored (see
`asyncengine_kernels.paged_attention`).
"""

from __future__ import annotations

import torch

from asyncengine_kernels._triton_utils import use_triton
from asyncengine_kernels.paged_attention import (
    DecodeRotary,
    paged_attention_ref,
    paged_attention_triton,
)
from asyncengine_kernels.rotary_kv_cache import rotary_and_write_kv_ref

__all__ = [
    "paged_decode_attention_with_rotary",
    "paged_decode_attention_with_rotary_ref",
    "paged_decode_attention_with_rotary_triton",
]


def paged_decode_attention_with_rotary_ref(
    q: torch.Tensor,
    rotary: DecodeRotary,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_segments: int = 1,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    del num_segments  # the Triton path's split-KV count
    q_rot = rotary_and_write_kv_ref(
        rotary.positions, q, rotary.k, rotary.v, rotary.cos_sin_cache, k_cache, v_cache,
        rotary.slot_mapping, k_scale, v_scale,
    )  # fmt: skip
    return paged_attention_ref(
        q_rot, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def paged_decode_attention_with_rotary_triton(
    q: torch.Tensor,
    rotary: DecodeRotary,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_segments: int = 1,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    if q.shape[0] != seq_lens.shape[0]:
        raise ValueError("a decode step has one query token per sequence")
    return paged_attention_triton(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
        decode_only=True, num_segments=num_segments, rotary=rotary, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip


def paged_decode_attention_with_rotary(
    q: torch.Tensor,
    rotary: DecodeRotary,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_segments: int = 1,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and this step's k (HF rounding), write k and v to the cache, attend; q [B,
    Hq, D] unrotated, one token per sequence. Returns [B, Hq, D] in q.dtype. `num_segments`
    is the split-KV count (the step's `DecodePlan.segments`); an FP8 cache takes `k_scale`
    and `v_scale` (float32 [Hkv])."""
    if use_triton(q):
        fn = paged_decode_attention_with_rotary_triton
    else:
        fn = paged_decode_attention_with_rotary_ref
    return fn(
        q, rotary, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, num_segments,
        k_scale, v_scale,
    )  # fmt: skip
