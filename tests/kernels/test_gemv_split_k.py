"""`kernels.gemv_split_k`: the in-kernel split-K epilogue's counters (the epilogue itself is
exercised by the quantized and FP8 GEMV tests, which split K)."""

from __future__ import annotations

import torch

from kernels.gemv_split_k import gemv_counters


def test_counters_cover_every_block_of_every_row_zeroed() -> None:
    counters = gemv_counters(3, 100, "cpu")
    assert counters.dtype == torch.int32 and counters.numel() == 3 * 7  # ceil(100 / 16)
    assert not counters.any()
    assert gemv_counters(1, 100, "cpu", min_block_n=4).numel() == 25
