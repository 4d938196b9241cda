"""The split-K epilogue of the one-row GEMVs, in the kernel itself: each K split of an output
block stores its float32 partial sums, and the last of the block's splits to arrive (counted
with one atomic per program) adds them and writes the output, so no second kernel runs and
the partial buffer is never zeroed. The counter is reset by that last program, ready for the
next call and every CUDA graph replay."""

from __future__ import annotations

import torch

from asyncengine_kernels._triton_utils import tl, triton

__all__ = ["check_gemv_counters", "finish_gemv_row", "gemv_counters", "store_gemv_row"]


def gemv_counters(rows: int, n: int, device: torch.device | str,
                  min_block_n: int = 16) -> torch.Tensor:  # fmt: skip
    """Zeroed split-K arrival counters for a GEMV ending in `finish_gemv_row`
    (`asyncengine_kernels.quant_linear.quant_gemv`, `asyncengine_kernels.fp8_linear.fp8_gemv`) on up
    to `rows` rows and N = n, for output blocks of at least `min_block_n` columns; the kernel leaves
    them zeroed, so a layer allocates them once and every call and graph replay reuses them."""
    return torch.zeros(rows * triton.cdiv(n, min_block_n), dtype=torch.int32, device=device)


def check_gemv_counters(counters: torch.Tensor, rows: int, blocks: int) -> None:
    """`counters` cover `rows` rows of `blocks` output blocks (one counter each)."""
    if counters.numel() < rows * blocks:
        raise ValueError(f"{counters.numel()} split-K counters; {rows} rows of {blocks} "
                         f"output blocks need {rows * blocks}")  # fmt: skip


@triton.jit
def finish_gemv_row(y, b_ptr, y_ptr, part_ptr, count_ptr, row, pid_n, pid_k, M, N,
                    stride_ym, offs_n, n_mask, HAS_BIAS: tl.constexpr,
                    SPLIT_K: tl.constexpr):  # fmt: skip
    """Store one program's sums y [BLOCK_N]: directly without K splits; with them, as a
    partial sum that the last of the block's splits adds up."""
    if SPLIT_K == 1:
        store_gemv_row(y, b_ptr, y_ptr + row * stride_ym, offs_n, n_mask, HAS_BIAS)
    else:
        # SPLIT_K is a power of two at least the grid's splits (axis 1); the blocks are
        # axis 0.
        n_splits = tl.num_programs(1)
        tl.store(part_ptr + (pid_k * M + row) * N + offs_n, y, mask=n_mask)
        tl.debug_barrier()
        counter = count_ptr + row * tl.num_programs(0) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == n_splits - 1:
            tl.debug_barrier()
            splits = tl.arange(0, SPLIT_K)
            parts = tl.load(part_ptr + (splits[:, None] * M + row) * N + offs_n[None, :],
                            mask=(splits < n_splits)[:, None] & n_mask[None, :], other=0.0,
                            cache_modifier=".cg")  # fmt: skip
            tl.atomic_xchg(counter, 0)
            store_gemv_row(tl.sum(parts, axis=0), b_ptr, y_ptr + row * stride_ym, offs_n,
                           n_mask, HAS_BIAS)  # fmt: skip


@triton.jit
def store_gemv_row(y, b_ptr, y_row, offs_n, n_mask, HAS_BIAS: tl.constexpr):
    """y [BLOCK_N] (+ bias) in the output's dtype."""
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_row + offs_n, y.to(y_row.dtype.element_ty), mask=n_mask)
