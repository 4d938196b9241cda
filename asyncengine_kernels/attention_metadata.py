"""The attention metadata of one flattened step: where each token's K/V go in the paged cache
and what each sequence attends to.

A plain shape that the kernels read (the CPU attention step derives its index from it) and
the model runner fills; it lives on the kernels' floor so that the kernels never import the
models above them. `models.forward_context` hands it to every layer of a forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncengine_kernels.cpu_attention import CpuStepIndex
from asyncengine_kernels.paged_attention import DecodePlan

__all__ = ["AttentionMetadata"]


@dataclass
class AttentionMetadata:
    """Where each token of the step goes in the paged KV cache and what it attends to."""

    slot_mapping: torch.Tensor  # [T] int: block_id * block_size + offset, -1 = padding
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int | None = None  # host-side hint for kernel selection
    decode_only: bool = False
    max_seq_len: int | None = None  # host-side hint: the longest context
    # How a decode-only step runs attention, decided once per step by the model runner;
    # None (or a step with prefill) runs without split-KV and with the separate rotary.
    decode_plan: DecodePlan | None = None
    # CPU only: what every layer of the step needs from this metadata, derived by the first
    # layer that asks (`asyncengine_kernels.cpu_attention.step_index`) and shared by the rest.
    cpu_step_index: CpuStepIndex | None = field(default=None, repr=False, compare=False)
