"""`asyncengine_kernels.gemv_split_k`: the in-kernel split-K epilogue's counters (the epilogue
itself is exercised by the quantized and FP8 GEMV tests, which split K)."""

from __future__ import annotations

import pytest
import torch

from asyncengine_kernels.gemv_split_k import check_gemv_counters, gemv_counters


def test_counters_cover_every_block_of_every_row_zeroed() -> None:
    counters = gemv_counters(3, 100, "cpu")
    assert counters.dtype == torch.int32 and counters.numel() == 3 * 7  # ceil(100 / 16)
    assert not counters.any()
    assert gemv_counters(1, 100, "cpu", min_block_n=4).numel() == 25


def test_too_few_counters_are_refused() -> None:
    counters = gemv_counters(2, 100, "cpu")  # 2 rows x 7 blocks
    check_gemv_counters(counters, 2, 7)
    with pytest.raises(ValueError, match="14 split-K counters; 3 rows of 7 output blocks"):
        check_gemv_counters(counters, 3, 7)
