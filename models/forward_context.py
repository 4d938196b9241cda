"""The attention metadata of one flattened step, shared by every layer of a forward pass.

The model runner sets it around `model(...)`; attention layers read it. Keeping it out of the
forward signatures lets the same model run eagerly, under CUDA graphs (with static buffers)
and under tensor parallelism without threading metadata through every module. It is
per thread: two engines in one process (an `AsyncLLMEngine`'s step thread beside an
offline `LLM`, say) each see only their own step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kernels.cpu_attention import CpuStepIndex
from kernels.paged_attention import DecodePlan


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
    # layer that asks (`kernels.cpu_attention.step_index`) and shared by the rest.
    cpu_step_index: CpuStepIndex | None = field(default=None, repr=False, compare=False)


class _State(threading.local):
    current: AttentionMetadata | None = None


_state = _State()


def get_attention_metadata() -> AttentionMetadata:
    current = _state.current
    if current is None:
        raise RuntimeError(
            "attention metadata is not set: run the model inside set_forward_context"
        )
    return current


@contextmanager
def set_forward_context(meta: AttentionMetadata) -> Iterator[None]:
    previous, _state.current = _state.current, meta
    try:
        yield
    finally:
        _state.current = previous
