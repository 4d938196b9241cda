"""The step's packed buffer: the header and every field survive a pack/unpack round trip, at
16-byte aligned offsets, with the field list's dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncengine.step_buffer import ALIGN, STEP_FIELDS, StepHeader, layout, pack, unpack
from asyncengine_kernels.paged_attention import DecodePlan

HEADER = StepHeader(
    num_tokens=5,
    num_seqs=3,
    table_width=3,
    num_logits=2,
    num_fills=1,
    max_query_len=3,
    max_seq_len=40,
    decode_segments=0,
    num_swap_out=1,
    num_copy=2,
    num_prompt_rows=2,
)


def _arrays(header: StepHeader, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f.name: rng.integers(-(2**30), 2**30, f.length(header)).astype(np.int64)
        for f in STEP_FIELDS
    }


def test_pack_unpack_round_trip() -> None:
    arrays = _arrays(HEADER)
    flat = pack(HEADER, arrays)
    assert flat.dtype == np.uint8 and flat.size == layout(HEADER)[1]
    parts = unpack(HEADER, torch.from_numpy(flat))
    assert list(parts) == [f.name for f in STEP_FIELDS]
    for field in STEP_FIELDS:
        part = parts[field.name]
        assert part.dtype == field.dtype
        assert part.tolist() == arrays[field.name].tolist()
        assert part.data_ptr() % ALIGN == 0


def test_fields_follow_the_header_sizes() -> None:
    placed, total = layout(HEADER)
    sizes = {f.name: size // f.dtype.itemsize for f, _, size in placed}
    assert sizes == {
        "input_ids": 5, "positions": 5, "slot_mapping": 5, "query_start_loc": 4, "seq_lens": 3,
        "block_tables": 9, "logits_indices": 2, "fills": 2, "prompt_rows": 2,
        "prompt_targets": 2,
    }  # fmt: skip
    assert all(at % ALIGN == 0 for _, at, _ in placed) and total % ALIGN == 0


def test_unpacked_fields_are_views_of_the_buffer() -> None:
    """Writing a field writes the buffer (rank 0 fills ids into it before broadcasting it)."""
    buffer = torch.from_numpy(pack(HEADER, _arrays(HEADER)))
    parts = unpack(HEADER, buffer)
    parts["input_ids"][0] = 42
    assert unpack(HEADER, buffer)["input_ids"][0] == 42


def test_a_field_of_the_wrong_size_is_refused() -> None:
    arrays = _arrays(HEADER)
    arrays["seq_lens"] = arrays["seq_lens"][:-1]
    with pytest.raises(ValueError, match="seq_lens"):
        pack(HEADER, arrays)
    with pytest.raises(ValueError, match="bytes expected"):
        unpack(HEADER, torch.zeros(8, dtype=torch.uint8))


def test_header_round_trip_as_ints() -> None:
    decode = StepHeader(4, 4, 2, 4, max_query_len=1, decode_segments=8, fuse_rotary=True)
    for header in (HEADER, decode):
        values = header.to_ints()
        assert all(type(v) is int for v in values)
        assert StepHeader.from_ints([*values, 0, 0]) == header
    assert HEADER.decode_plan is None and HEADER.num_moves == 3
    assert decode.decode_plan == DecodePlan(8, fuse_rotary=True)
