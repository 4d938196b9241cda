"""The flat buffer one step's inputs travel in: a named header of sizes and host hints, and one
field list that lays the step's arrays out in a single byte buffer.

The model runner packs the arrays once on the host and moves the buffer to the device in one
copy; under tensor parallelism rank 0 broadcasts that same device buffer and the header, and
the workers unpack it with the same field list. Each field starts on a 16-byte boundary:
Triton specializes kernels on pointer alignment, so a misaligned field (the positions after
an odd number of token ids, say) would compile a second kernel variant mid-serving.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from asyncengine_kernels.paged_attention import DecodePlan

ALIGN = 16


@dataclass(frozen=True)
class StepHeader:
    """The sizes that lay a step's buffer out, its host-side hints and the counts of the block
    moves that go with it. Crosses to tensor-parallel workers as ints, in field order."""

    num_tokens: int
    num_seqs: int
    table_width: int  # block-table columns
    num_logits: int  # rows that need logits
    num_fills: int = 0  # input ids taken on the device from the previous step's samples
    max_query_len: int = 0
    max_seq_len: int = 0
    decode_segments: int = 0  # the decode plan's split-KV count; 0: not a decode-only step
    fuse_rotary: bool = False  # the decode plan's rotary fusion
    num_swap_out: int = 0
    num_swap_in: int = 0
    num_copy: int = 0
    num_prompt_rows: int = 0  # rows scored for prompt logprobs (`asyncengine.prompt_logprobs`)

    @property
    def decode_plan(self) -> DecodePlan | None:
        if self.decode_segments == 0:
            return None
        return DecodePlan(self.decode_segments, self.fuse_rotary)

    @property
    def num_moves(self) -> int:
        return self.num_swap_out + self.num_swap_in + self.num_copy

    def to_ints(self) -> list[int]:
        return [int(getattr(self, f.name)) for f in dataclasses.fields(self)]

    @classmethod
    def from_ints(cls, values: list[int]) -> StepHeader:
        """The header from `to_ints`' values (and anything after them, ignored)."""
        fields = dataclasses.fields(cls)
        hints = typing.get_type_hints(cls)  # the annotations are strings here (PEP 563)
        kinds = [hints[f.name] for f in fields]  # int or bool, each a constructor
        return cls(*(kind(v) for kind, v in zip(kinds, values[: len(fields)], strict=True)))


@dataclass(frozen=True)
class StepField:
    name: str
    dtype: torch.dtype
    length: Callable[[StepHeader], int]


STEP_FIELDS: tuple[StepField, ...] = (
    StepField("input_ids", torch.int64, lambda h: h.num_tokens),
    StepField("positions", torch.int64, lambda h: h.num_tokens),
    StepField("slot_mapping", torch.int64, lambda h: h.num_tokens),  # -1 = padding
    StepField("query_start_loc", torch.int32, lambda h: h.num_seqs + 1),
    StepField("seq_lens", torch.int32, lambda h: h.num_seqs),
    StepField("block_tables", torch.int32, lambda h: h.num_seqs * h.table_width),
    StepField("logits_indices", torch.int64, lambda h: h.num_logits),
    # Where each fill goes in input_ids, then which row of the previous step's samples.
    StepField("fills", torch.int64, lambda h: 2 * h.num_fills),
    # Prompt logprobs: the rows scored, and the prompt token each predicts.
    StepField("prompt_rows", torch.int64, lambda h: h.num_prompt_rows),
    StepField("prompt_targets", torch.int64, lambda h: h.num_prompt_rows),
)

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


def layout(header: StepHeader) -> tuple[list[tuple[StepField, int, int]], int]:
    """(field, byte offset, byte size) of every field, and the buffer's size in bytes."""
    placed = []
    at = 0
    for field in STEP_FIELDS:
        size = field.length(header) * field.dtype.itemsize
        placed.append((field, at, size))
        at += -(-size // ALIGN) * ALIGN
    return placed, at


def pack(header: StepHeader, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """The step's arrays in one uint8 buffer (padding zeroed), laid out by `layout`."""
    placed, total = layout(header)
    flat = np.zeros(total, dtype=np.uint8)
    for field, at, size in placed:
        values = np.asarray(arrays[field.name]).reshape(-1)
        if values.size * field.dtype.itemsize != size:
            raise ValueError(f"{field.name} has {values.size} values, the header says otherwise")
        flat[at : at + size].view(_NUMPY[field.dtype])[:] = values
    return flat


def unpack(header: StepHeader, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of the fields in a packed buffer (uint8, on any device); no copies."""
    placed, total = layout(header)
    if buffer.dtype != torch.uint8 or buffer.numel() != total:
        raise ValueError(f"a step buffer of {total} bytes expected, got {buffer.numel()}")
    return {field.name: buffer[at : at + size].view(field.dtype) for field, at, size in placed}
