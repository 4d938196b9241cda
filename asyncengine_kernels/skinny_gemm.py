"""Matmul for decode steps of a few rows: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M <= 16.

A decode step of a few requests, or a speculative verify step (k + 1 rows per request), is
as much a stream of weight reads as a one-row step: at 2-16 rows the arithmetic is tiny and
the time is the weight's bytes over the memory bandwidth. The BLAS library's kernels for such
shapes read the weight no faster than for a large batch, so this kernel streams each weight
tile once for all M rows and multiplies it on the tensor cores: each program owns BLOCK_N
output columns and a range of K, walks it in BLOCK_K tiles (Triton's pipeliner keeps
`num_stages` tiles in flight) and accumulates `tl.dot(w, x^T)` -> [BLOCK_N, 16] in fp32
("swap AB": the weight fills the tensor core's wide M side, so sm_90's wgmma applies; the
rows-first orientation, `tl.dot(x, w^T)`, won no shape on the H200 and was removed). The
rows are padded to 16
in registers (reads of rows past M repeat a real row, stores are masked), so x is never
copied.

K splits give small-N shapes (a 4096-column projection) enough programs: each split stores
its fp32 partial sums, and the last of a column block's splits to arrive (one atomic counter
per block, left zeroed for the next call and every CUDA graph replay) adds them up in split
order and writes the output, so the result does not depend on timing.

The prologue can form the input from a [gate, up] pair (`gated`: silu(gate) * up, rounded to
the dtype as `asyncengine_kernels.activation.silu_and_mul` rounds it) and the epilogue can apply
SiLU-and-mul to a [gate; up] weight's product (`glu`: a program owns the same columns of
both halves; each half rounded as the unfused output would be), as the one-row GEMV
(`asyncengine_kernels.gemv`) does. A normed layer's input, rms_norm(x + residual), is formed
in the K loop (`rms_norm_skinny_gemm`): each tile of x + residual times the norm weight is
the operand, and since the rows' 1 / rms is a factor of each output row, it scales the sums
at the end, from the sums of squares gathered on the way, so no program waits for a pass
over the whole rows before its first product. A QKV projection's epilogue can also do what
`asyncengine_kernels.rotary_and_write_kv` would do next (`skinny_qkv_rotary_kv`): a program
owns the same columns of a head's two halves, as GLU pairs gate and up, rotates q and k and
stores q, and k and v into the paged cache, rounded as the two kernels round. `tune_skinny`
times the configs against the BLAS library at a row count, for `models.linear_tuning` to
plan the winner per row range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from asyncengine_kernels._triton_utils import (
    interpreter_enabled,
    pdl_kwargs,
    pdl_wait,
    tl,
    triton,
    use_pdl,
)
from asyncengine_kernels.activation import silu_and_mul, silu_times
from asyncengine_kernels.gemv import Candidate, fastest_against_library
from asyncengine_kernels.kv_cache_write import check_kv_scales, is_fp8_kv, quantize_fp8
from asyncengine_kernels.rms_norm import check_norm_inputs, fused_add_rms_norm
from asyncengine_kernels.rotary import rotate_pair

__all__ = [
    "SKINNY_CONFIGS",
    "SKINNY_MAX_ROWS",
    "RotaryKVWrite",
    "SkinnyChoice",
    "SkinnyConfig",
    "pipeline_stages",
    "rms_norm_skinny_gemm",
    "skinny_counters",
    "skinny_gemm",
    "skinny_qkv_rotary_kv",
    "tune_skinny",
]

# The most rows the kernel takes: one tensor-core tile of rows.
SKINNY_MAX_ROWS = 16
# The narrowest column block of any config (sizes the split-K counters).
SKINNY_MIN_BLOCK_N = 32
# Shared memory a program may take on sm_90.
SKINNY_SHARED_BYTES = 227 * 1024


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration of `skinny_gemm`: `block_n` output columns and up to
    `split_k` K ranges per program grid, K walked in `block_k` tiles."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "split_k"):
            value = getattr(self, name)
            if value <= 0 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a positive power of two")
        if self.block_n < SKINNY_MIN_BLOCK_N or self.block_k < 16:
            raise ValueError(f"block_n must be at least {SKINNY_MIN_BLOCK_N} and block_k at "
                             "least 16")  # fmt: skip

    def __str__(self) -> str:
        """Short and unique, as timing tables and logs name it."""
        return (f"skinny[{self.block_n}, {self.block_k}, {self.split_k}, {self.num_warps}, "
                f"{self.num_stages}]")  # fmt: skip


# 64-column blocks of 128-deep tiles, the K range in 1-8 splits: four compiled kernels per
# form, one without splits and one per split count (the last split's reduction is unrolled
# to it). The engine's
# tuning on the H200 (Llama-2-7B shape, 2026-12-02) planned 2 and 4 splits for the
# 4096-column projections and cuBLAS for the wide ones; wider blocks, 64-deep tiles and the
# rows-first form won no plan entry and were removed, each of them a kernel to compile at
# start-up (docs/performance.md).
SKINNY_CONFIGS: list[SkinnyConfig] = [
    SkinnyConfig(64, 128, 1, 4, 4),
    SkinnyConfig(64, 128, 2, 4, 4),
    SkinnyConfig(64, 128, 4, 4, 4),
    SkinnyConfig(64, 128, 8, 4, 4),
]
DEFAULT_SKINNY_CONFIG = SKINNY_CONFIGS[1]


def pipeline_stages(config: SkinnyConfig, itemsize: int, gated: bool, glu: bool) -> int:
    """The config's `num_stages`, or fewer where its tiles would not fit shared memory: a
    GLU output streams two weight tiles a stage (a gated input is counted with two input
    tiles, to be safe), and the peeled first tile takes one stage's room of its own."""
    per_stage = ((2 if glu else 1) * config.block_n + (32 if gated else 16)) * config.block_k
    return max(1, min(config.num_stages, SKINNY_SHARED_BYTES // (per_stage * itemsize) - 1))


def skinny_counters(n: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed split-K arrival counters for `skinny_gemm` on up to n output columns; the
    kernel leaves them zeroed, so a layer allocates them once (outside any CUDA graph
    capture) and every call and replay reuses them."""
    return torch.zeros(triton.cdiv(n, SKINNY_MIN_BLOCK_N), dtype=torch.int32, device=device)


@triton.jit
def _load_tile(ptr, rows, kk, K, EVEN_K: tl.constexpr):
    """ptr[rows, kk] of a weight or the residual: rows are in range (wrapped by the caller),
    only a ragged K is masked."""
    ptrs = ptr + rows[:, None] + kk[None, :]
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(kk < K)[None, :], other=0.0)


@triton.jit
def _load_normed_tile(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, rows, kk, K, M, offs_m, write,
                      EVEN_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr):  # fmt: skip
    """The operand of the deferred RMSNorm at x[rows, kk]: h = x (+ residual), rounded to
    the dtype as `fused_add_rms_norm` rounds the sum (`write`: stored as the new residual),
    times the norm weight, rounded; and h's sum of squares per row over these columns. The
    rows' 1 / rms scales the product afterwards (`_finish`)."""
    dt = x_ptr.dtype.element_ty
    h = _load_tile(x_ptr, rows, kk, K, EVEN_K)
    if HAS_RESIDUAL:
        res = _load_tile(res_ptr, rows, kk, K, EVEN_K)
        h = (h.to(tl.float32) + res.to(tl.float32)).to(dt)
        # The rows as a tile test (the interpreter refuses a scalar in a mask).
        keep = (offs_m < tl.where(write, M, 0))[:, None] & (kk < K)[None, :]
        tl.store(res_out_ptr + rows[:, None] + kk[None, :], h, mask=keep)
    if EVEN_K:
        nw = tl.load(norm_w_ptr + kk)
    else:
        nw = tl.load(norm_w_ptr + kk, mask=kk < K, other=0.0)
    hf = h.to(tl.float32)
    return (hf * nw.to(tl.float32)[None, :]).to(dt), tl.sum(hf * hf, axis=1)


@triton.jit
def _load_x_tile(x_ptr, rows, kk, K, EVEN_K: tl.constexpr, GATED: tl.constexpr):
    """x[rows, kk] as the product's operand; GATED: silu(gate) * up of the [gate, up] row,
    rounded to the dtype first, as `silu_and_mul` rounds it."""
    ptrs = x_ptr + rows[:, None] + kk[None, :]
    if EVEN_K:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(kk < K)[None, :], other=0.0)
    if GATED:
        if EVEN_K:
            up = tl.load(ptrs + K)
        else:
            up = tl.load(ptrs + K, mask=(kk < K)[None, :], other=0.0)
        gate = x.to(tl.float32)
        x = silu_times(gate, up.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x


@triton.jit
def _tile_product(w, x, IEEE: tl.constexpr, DOT_FP32: tl.constexpr):
    """One tile's products [BLOCK_N, 16]. DOT_FP32: the interpreter multiplies bf16 bit
    patterns in tl.dot, so the operands are upcast there."""
    if DOT_FP32:
        w = w.to(tl.float32)
        x = x.to(tl.float32)
    # One return statement: the compiler checks every return's shape, taken or not.
    if IEEE:
        out = tl.dot(w, tl.trans(x), input_precision="ieee")
    else:
        out = tl.dot(w, tl.trans(x))
    return out


@triton.jit
def _store_output(y, y_up, b_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym,
                  HAS_BIAS: tl.constexpr, GLU: tl.constexpr):  # fmt: skip
    """Sums [16, BLOCK_N] (+ bias); GLU: SiLU-and-mul of the gate sums y and the up sums
    y_up, each rounded to the dtype first as the unfused [gate, up] output would be."""
    dt = y_ptr.dtype.element_ty
    n_mask = offs_n < N
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GLU:
        if HAS_BIAS:
            y_up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        gate = y.to(dt).to(tl.float32)
        y = silu_times(gate, y_up.to(dt).to(tl.float32))
    mask = (offs_m < M)[:, None] & n_mask[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(dt), mask=mask)


@triton.jit
def _store_rotary_kv(
    y1, y2, b_ptr, q_ptr, offs_m, offs_n, M, stride_qm, HAS_BIAS: tl.constexpr,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, pos_ptr, cos_sin_ptr,
    slot_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, stride_cs, stride_kcb,
    stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, q_heads, kv_heads, cache_block,
):  # fmt: skip
    """The epilogue of a QKV product's column pair: sums y1 [16, BLOCK_N] of a head's first
    half at columns offs_n and y2 of its second half (+ bias), each rounded to the dtype as
    the unfused output would be; then as `asyncengine_kernels.rotary_kv_cache` does with
    that output: a q head rotated at the rows' positions into q [M, q_heads * 2 * HALF], a k
    head rotated and a v head as is into their caches at the rows' slots (-1: none), FP8
    caches quantized with the KV head's scale."""
    dt = q_ptr.dtype.element_ty
    if HAS_BIAS:
        y1 += tl.load(b_ptr + offs_n).to(tl.float32)[None, :]
        y2 += tl.load(b_ptr + offs_n + HALF).to(tl.float32)[None, :]
    x1 = y1.to(dt).to(tl.float32)
    x2 = y2.to(dt).to(tl.float32)
    head = tl.program_id(0) // (HALF // BLOCK_N)
    d = offs_n - head * (2 * HALF)  # this program's columns of the head's first half
    rows = offs_m % M
    in_rows = offs_m < M
    if head < q_heads + kv_heads:  # q or k: rotated, cos and sin cast to the dtype first
        pos = tl.load(pos_ptr + rows).to(tl.int64)
        at = pos[:, None] * stride_cs + d[None, :]
        c = tl.load(cos_sin_ptr + at).to(dt).to(tl.float32)
        s = tl.load(cos_sin_ptr + at + HALF).to(dt).to(tl.float32)
        first, second = rotate_pair(x1, x2, c, s, dt)
    else:
        first, second = x1.to(dt), x2.to(dt)
    if head < q_heads:
        q_at = q_ptr + offs_m[:, None] * stride_qm + offs_n[None, :]
        tl.store(q_at, first, mask=in_rows[:, None])
        tl.store(q_at + HALF, second, mask=in_rows[:, None])
    else:
        slot = tl.load(slot_ptr + rows).to(tl.int64)
        mask = (in_rows & (slot >= 0))[:, None]
        block, offset = slot // cache_block, slot % cache_block
        if head < q_heads + kv_heads:
            kv_head = head - q_heads
            cache_ptr, scale_ptr = k_cache_ptr, k_scale_ptr
            at = block * stride_kcb + offset * stride_kcs + kv_head * stride_kch
        else:
            kv_head = head - q_heads - kv_heads
            cache_ptr, scale_ptr = v_cache_ptr, v_scale_ptr
            at = block * stride_vcb + offset * stride_vcs + kv_head * stride_vch
        dst = cache_ptr + at[:, None] + d[None, :]
        if KV_FP8:
            scale = tl.load(scale_ptr + kv_head)
            tl.store(dst, quantize_fp8(first, scale), mask=mask)
            tl.store(dst + HALF, quantize_fp8(second, scale), mask=mask)
        else:
            tl.store(dst, first.to(cache_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + HALF, second.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _finish(
    y, y_up, sumsq, b_ptr, y_ptr, offs_m, offs_n, M, N, K, eps, stride_ym,
    HAS_BIAS: tl.constexpr, GLU: tl.constexpr, NORM: tl.constexpr, ROTARY: tl.constexpr,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, pos_ptr, cos_sin_ptr,
    slot_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, stride_cs, stride_kcb,
    stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, q_heads, kv_heads, cache_block,
):  # fmt: skip
    """A column block's whole sums [16, BLOCK_N] (and its pair's): scaled by the rows'
    1 / rms from their sums of squares over K (NORM), then stored through the epilogue."""
    if NORM:
        rstd = tl.rsqrt(sumsq / K + eps)[:, None]
        y = y * rstd
        y_up = y_up * rstd
    if ROTARY:
        _store_rotary_kv(y, y_up, b_ptr, y_ptr, offs_m, offs_n, M, stride_ym, HAS_BIAS, HALF,
                         BLOCK_N, KV_FP8, pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr,
                         v_cache_ptr, k_scale_ptr, v_scale_ptr, stride_cs, stride_kcb,
                         stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, q_heads,
                         kv_heads, cache_block)  # fmt: skip
    else:
        _store_output(y, y_up, b_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS, GLU)


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, res_ptr, norm_w_ptr, res_out_ptr, eps,
    M, N, K, stride_xm, stride_wn, stride_ym, split_tiles,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr, GLU: tl.constexpr,
    IEEE: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
    NORM: tl.constexpr = False, HAS_RESIDUAL: tl.constexpr = False,
    MAX_SPLITS: tl.constexpr = 1, ROTARY: tl.constexpr = False, HALF: tl.constexpr = 0,
    KV_FP8: tl.constexpr = False,
    pos_ptr=None, cos_sin_ptr=None, slot_ptr=None, k_cache_ptr=None, v_cache_ptr=None,
    k_scale_ptr=None, v_scale_ptr=None, stride_cs=0, stride_kcb=0, stride_kcs=0, stride_kch=0,
    stride_vcb=0, stride_vcs=0, stride_vch=0, q_heads=0, kv_heads=0, cache_block=1,
):  # fmt: skip
    """Grid (column blocks, K splits). N is the output's columns (GLU: W has 2N rows, the
    gate's then the up's). SPLIT (more than one K split): the grid's splits add up through
    part_ptr [splits, (GLU: 2,) M, N] float32 and count_ptr (one zeroed counter per column
    block). The grid's split count is a run-time argument up to MAX_SPLITS, the config's.
    NORM: the product is of rms_norm(x (+ residual)) with weight norm_w, x and the residual
    [M, K] contiguous: the rows' 1 / rms is a factor of each output row, so it scales the
    sums at the end (`_finish`), from the sums of squares each program gathers over its K
    range as it forms the operand (`_load_normed_tile`; with K splits they add up as the
    partial sums do). The programs of column block 0 store x + residual to res_out [M, K].
    A norm pass before the first dot (every program reading the whole rows) lost to the
    norm kernel at 5 rows on the H200 (2026-12-06).
    ROTARY: W is a QKV projection of heads of 2 * HALF features (N its rows); a program owns
    BLOCK_N columns of the first half of a head and the same columns of its second half, and
    its epilogue is `_store_rotary_kv`'s (the arguments after KV_FP8 are its operands)."""
    BLOCK_M: tl.constexpr = 16
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    if ROTARY:
        # Column block pid_n: head pid_n // (HALF / BLOCK_N), its first half's columns.
        head_cols = (pid_n // (HALF // BLOCK_N)) * (2 * HALF)
        offs_n = head_cols + (pid_n % (HALF // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M and columns past N read a real row or column again (their results are
    # never stored), so no load needs a row or column mask and every tile pipelines alike.
    x_rows = (offs_m % M).to(tl.int64) * stride_xm
    w_rows = (offs_n % N).to(tl.int64) * stride_wn
    # The second weight tile of a pair: the up rows of a GLU, a head's second half (ROTARY).
    PAIRED: tl.constexpr = GLU or ROTARY
    if ROTARY:
        up_rows = w_rows + HALF * stride_wn
    else:
        up_rows = w_rows + N.to(tl.int64) * stride_wn
    # Splits of `split_tiles` whole tiles (the last may be shorter): every tile starts at a
    # multiple of BLOCK_K, which the compiler sees, so the loads vectorize and pipeline.
    first_tile = pid_k * split_tiles
    tiles = tl.minimum(tl.cdiv(K, BLOCK_K) - first_tile, split_tiles)
    # The first tile is peeled: its weights never depend on the previous kernel, so they
    # are requested before waiting for it, and under programmatic dependent launch they
    # stream in while that kernel finishes (as in `asyncengine_kernels.gemv`).
    kk = first_tile * BLOCK_K + offs_k
    w = _load_tile(w_ptr, w_rows, kk, K, EVEN_K)
    w_up = w
    if PAIRED:
        w_up = _load_tile(w_ptr, up_rows, kk, K, EVEN_K)
    pdl_wait(USE_PDL)
    write = pid_n == 0  # NORM with a residual: this K range's new residual
    if NORM:
        x, sumsq = _load_normed_tile(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, x_rows, kk, K, M,
                                     offs_m, write, EVEN_K, HAS_RESIDUAL)  # fmt: skip
    else:
        x = _load_x_tile(x_ptr, x_rows, kk, K, EVEN_K, GATED)
        sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = _tile_product(w, x, IEEE, DOT_FP32)
    acc_up = acc
    if PAIRED:
        acc_up = _tile_product(w_up, x, IEEE, DOT_FP32)
    for t in range(1, tiles):
        kk = (first_tile + t) * BLOCK_K + offs_k
        w = _load_tile(w_ptr, w_rows, kk, K, EVEN_K)
        if NORM:
            x, squares = _load_normed_tile(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, x_rows, kk,
                                           K, M, offs_m, write, EVEN_K, HAS_RESIDUAL)  # fmt: skip
            sumsq += squares
        else:
            x = _load_x_tile(x_ptr, x_rows, kk, K, EVEN_K, GATED)
        acc += _tile_product(w, x, IEEE, DOT_FP32)
        if PAIRED:
            w_up = _load_tile(w_ptr, up_rows, kk, K, EVEN_K)
            acc_up += _tile_product(w_up, x, IEEE, DOT_FP32)
    # Stored as [16, BLOCK_N].
    y = tl.trans(acc)
    y_up = tl.trans(acc_up)
    if not SPLIT:
        _finish(y, y_up, sumsq, b_ptr, y_ptr, offs_m, offs_n, M, N, K, eps, stride_ym,
                HAS_BIAS, GLU, NORM, ROTARY, HALF, BLOCK_N, KV_FP8, pos_ptr, cos_sin_ptr,
                slot_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, stride_cs,
                stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, q_heads,
                kv_heads, cache_block)  # fmt: skip
    else:
        n_splits = tl.num_programs(1)
        halves: tl.constexpr = 2 if PAIRED else 1
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        part = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + (pid_k * halves) * M * N, y, mask=mask)
        if PAIRED:
            tl.store(part + (pid_k * 2 + 1) * M * N, y_up, mask=mask)
        # NORM: this split's sums of squares, [column blocks, splits, 16] after the sums.
        squares_at = part_ptr + n_splits * halves * M * N + pid_n * n_splits * BLOCK_M + offs_m
        if NORM:
            tl.store(squares_at + pid_k * BLOCK_M, sumsq)
        tl.debug_barrier()
        counter = count_ptr + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == n_splits - 1:
            tl.debug_barrier()
            # Every split's sums are read back and added in split order, whichever arrived
            # last. The loop is unrolled to the config's split count, so its loads, which do
            # not depend on one another, are all in flight at once: this runs after the last
            # split's product, on the kernel's critical path, where a loop over the run-time
            # count waited an L2 round trip per split.
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            total_up = total
            total_squares = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(MAX_SPLITS):
                # The split test as a tile: the interpreter refuses a scalar in a mask.
                here = mask & (tl.full((BLOCK_M, BLOCK_N), s, tl.int32) < n_splits)
                total += tl.load(part + (s * halves) * M * N, mask=here, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
                if PAIRED:
                    total_up += tl.load(part + (s * 2 + 1) * M * N, mask=here, other=0.0,
                                        cache_modifier=".cg")  # fmt: skip
                if NORM:
                    in_grid = tl.full([BLOCK_M], s, tl.int32) < n_splits
                    total_squares += tl.load(squares_at + s * BLOCK_M, mask=in_grid, other=0.0,
                                             cache_modifier=".cg")  # fmt: skip
            tl.atomic_xchg(counter, 0)
            _finish(total, total_up, total_squares, b_ptr, y_ptr, offs_m, offs_n, M, N, K, eps,
                    stride_ym, HAS_BIAS, GLU, NORM, ROTARY, HALF, BLOCK_N, KV_FP8, pos_ptr,
                    cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                    stride_cs, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
                    stride_vch, q_heads, kv_heads, cache_block)  # fmt: skip


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig = DEFAULT_SKINNY_CONFIG,
    counters: torch.Tensor | None = None,
    *,
    gated: bool = False,
    glu: bool = False,
) -> torch.Tensor:
    """x [M, K] with M <= 16 (gated: [M, 2K] holding [gate, up], and the product is taken
    with silu(gate) * up); weight [N, K] with contiguous rows (glu: [gate; up], 2N rows, and
    the result is silu(gate) * up, [M, N]); bias [N] (glu: [2N]). Returns [M, N] in x.dtype.

    counters: from `skinny_counters` for at least N columns (default: fresh ones; a layer
    passes its own, so no zeroing kernel runs per call). The config's pipeline runs with
    fewer stages where its tiles would not fit shared memory (`pipeline_stages`)."""
    return _launch(x, weight, bias, config, counters, gated=gated, glu=glu)[0]


@dataclass(frozen=True)
class RotaryKVWrite:
    """What a QKV product's epilogue needs to rotate q and k and write k and v into the
    paged cache (`skinny_qkv_rotary_kv`), as `asyncengine_kernels.rotary_and_write_kv` takes
    them: the rows' positions and slots [M] (-1: no slot), the rotary table [max_pos, D]
    (cos then sin, over the whole head), the caches [blocks, block_size, Hkv, D] and, for an
    FP8 cache, the KV heads' scales."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def tiles(self, block_n: int) -> bool:
        """Whether column blocks of `block_n` tile half a head (each program's pair of
        blocks lies in one head)."""
        return (self.k_cache.shape[-1] // 2) % block_n == 0

    def check(self, weight: torch.Tensor, m: int, block_n: int) -> int:
        """Refuse what the epilogue cannot do; return the head size."""
        head_dim = self.k_cache.shape[-1]
        rows = (self.num_q_heads + 2 * self.num_kv_heads) * head_dim
        if weight.shape[0] != rows:
            raise ValueError(f"a QKV weight of {self.num_q_heads} + 2 x {self.num_kv_heads} "
                             f"heads of {head_dim} has {rows} rows, got {weight.shape[0]}")
        if self.cos_sin_cache.shape[-1] != head_dim or not self.tiles(block_n):
            raise ValueError(f"the epilogue rotates whole heads of {head_dim} features in "
                             f"blocks of {block_n} columns; the rotary table has "
                             f"{self.cos_sin_cache.shape[-1]}")  # fmt: skip
        if self.positions.shape[0] < m or self.slot_mapping.shape[0] < m:
            raise ValueError(f"{m} rows need {m} positions and slots")
        for t in (self.k_cache, self.v_cache, self.cos_sin_cache):
            if t.stride(-1) != 1:
                raise ValueError("the caches and the rotary table need contiguous rows")
        check_kv_scales(self.k_cache, self.k_scale, self.v_scale)
        if self.k_cache.dtype != weight.dtype and not is_fp8_kv(self.k_cache):
            raise ValueError("the K/V cache must have the weight's dtype (or be fp8)")
        return head_dim


def skinny_qkv_rotary_kv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig,
    counters: torch.Tensor | None,
    rotary: RotaryKVWrite,
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The QKV projection x @ weight^T (+ bias) of M <= 16 rows (with `norm`, (weight,
    eps): of rms_norm(x + residual), as `rms_norm_skinny_gemm`) whose epilogue does what
    `rotary_and_write_kv` would do next: k rotated and v written into the caches at the rows'
    slots, and q rotated. One kernel instead of two, with the same rounding. Returns (the
    rotated q [M, Hq * D], with `norm` the new residual: x + residual, or x without one)."""
    return _launch(x, weight, bias, config, counters, norm=norm, residual=residual,
                   rotary=rotary)  # fmt: skip


def rms_norm_skinny_gemm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig = DEFAULT_SKINNY_CONFIG,
    counters: torch.Tensor | None = None,
    *,
    glu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x + residual) @ weight^T (+ bias) for M <= 16 rows in one kernel (glu as
    `skinny_gemm`'s): the new residual is `fused_add_rms_norm`'s bit for bit; the product
    takes the rows' 1 / rms after the sums rather than before them, so it may differ from
    the norm kernel followed by `skinny_gemm` in the last bits. Returns (y, the new
    residual x + residual, or x itself without a residual)."""
    y, res_out = _launch(x, weight, bias, config, counters, glu=glu, norm=(norm_weight, eps),
                         residual=residual)  # fmt: skip
    assert res_out is not None  # a normed launch always gives the new residual
    return y, res_out


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig,
    counters: torch.Tensor | None,
    *,
    gated: bool = False,
    glu: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    rotary: RotaryKVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if norm is not None:  # the kernel reads x and the residual as [M, K] contiguous rows
        check_norm_inputs(x, residual, norm[0])
        x = x.contiguous()
        residual = residual.contiguous() if residual is not None else None
        norm = (norm[0].contiguous(), norm[1])
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError("skinny_gemm needs a 2-D x and weight")
    m = x.shape[0]
    n, k = weight.shape
    if not 1 <= m <= SKINNY_MAX_ROWS:
        raise ValueError(f"skinny_gemm takes 1 to {SKINNY_MAX_ROWS} rows, got {m}")
    want_k = 2 * k if gated else k
    if x.shape[1] != want_k:
        raise ValueError(f"x has {x.shape[1]} columns; the weight needs {want_k}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but the weight is {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and the weight need contiguous rows")
    if glu:
        if n % 2:
            raise ValueError(f"a GLU output needs [gate; up] weight rows, got {n} rows")
        n //= 2
    if bias is not None and bias.shape != ((2 * n,) if glu else (n,)):
        raise ValueError(f"the bias must be [{2 * n if glu else n}], got {list(bias.shape)}")
    rot_args: dict[str, object] = {}
    if rotary is not None:
        head_dim = rotary.check(weight, m, config.block_n)
        # A program per pair of column blocks (a head's first half and its second); the
        # output is q alone.
        blocks = n // (2 * config.block_n)
        y = torch.empty((m, rotary.num_q_heads * head_dim), dtype=x.dtype, device=x.device)
        rot_args = _rotary_args(rotary, head_dim, y)
    else:
        blocks = triton.cdiv(n, config.block_n)
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # Splits of whole tiles; the last may be shorter, and fewer splits than asked may run.
    per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    splits = triton.cdiv(k, per_split)
    paired = glu or rotary is not None
    if splits > 1:
        if counters is None:
            counters = skinny_counters(n, x.device)
        if counters.numel() < blocks:
            raise ValueError(f"{counters.numel()} split-K counters; {blocks} column blocks "
                             "need one each")  # fmt: skip
        # The splits' partial sums, then (NORM) their rows' sums of squares per column block.
        squares = blocks * splits * 16 if norm is not None else 0
        part = torch.empty((splits * (2 if paired else 1) * m * n + squares,),
                           dtype=torch.float32, device=x.device)  # fmt: skip
    else:
        counters = part = y
    res_out = torch.empty_like(x) if residual is not None else None
    norm_weight, eps = norm if norm is not None else (y, 0.0)
    pdl = use_pdl(x)
    _skinny_gemm_kernel[(blocks, splits)](
        x, weight, bias if bias is not None else y, y, part, counters,
        residual if residual is not None else y, norm_weight,
        res_out if res_out is not None else y, float(eps), m, n, k, x.stride(0),
        weight.stride(0), y.stride(0), per_split // config.block_k,
        HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0, GATED=gated, GLU=glu,
        IEEE=x.dtype == torch.float32,
        DOT_FP32=interpreter_enabled() and x.dtype == torch.bfloat16,
        SPLIT=splits > 1, MAX_SPLITS=config.split_k if splits > 1 else 1,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_PDL=pdl, num_warps=config.num_warps,
        num_stages=pipeline_stages(config, x.element_size(), gated or norm is not None, paired),
        NORM=norm is not None, HAS_RESIDUAL=residual is not None, **rot_args, **pdl_kwargs(pdl),
    )  # fmt: skip
    if norm is not None and res_out is None:
        res_out = x  # without a residual the new residual is x itself
    return y, res_out


def _rotary_args(rotary: RotaryKVWrite, head_dim: int, q: torch.Tensor) -> dict[str, object]:
    """The kernel's ROTARY arguments (`_store_rotary_kv`'s operands)."""
    kc, vc = rotary.k_cache, rotary.v_cache
    fp8 = is_fp8_kv(kc)
    return dict(
        ROTARY=True, HALF=head_dim // 2, KV_FP8=fp8, pos_ptr=rotary.positions,
        cos_sin_ptr=rotary.cos_sin_cache, slot_ptr=rotary.slot_mapping, k_cache_ptr=kc,
        v_cache_ptr=vc, k_scale_ptr=rotary.k_scale if fp8 else q,
        v_scale_ptr=rotary.v_scale if fp8 else q, stride_cs=rotary.cos_sin_cache.stride(0),
        stride_kcb=kc.stride(0), stride_kcs=kc.stride(1), stride_kch=kc.stride(2),
        stride_vcb=vc.stride(0), stride_vcs=vc.stride(1), stride_vch=vc.stride(2),
        q_heads=rotary.num_q_heads, kv_heads=rotary.num_kv_heads, cache_block=kc.shape[1],
    )  # fmt: skip


class SkinnyChoice(NamedTuple):
    """What `tune_skinny` chose for one weight shape at one row count."""

    config: SkinnyConfig | None  # None: the BLAS library
    fuses_input: bool  # whether the config forms the input (gated or normed) in its prologue
    ms: float  # GPU time of the chosen form, per call
    timings: dict[str, float]  # every form timed, in ms per call


def tune_skinny(
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None] | None = None,
    rows: int = 8,
    reps: int = 5,
    gated: bool = False,
    glu: bool = False,
    configs: Sequence[SkinnyConfig] | None = None,
    normed: bool = False,
) -> SkinnyChoice:
    """Time the BLAS library and each config (default `SKINNY_CONFIGS`) at `rows` rows over
    these same-shape CUDA weights, in a CUDA graph as decode runs them (the layers' own
    weights: nothing is copied and nothing is served from L2).

    gated: the input is [gate, up] and needs SiLU-and-mul, timed inside the kernel and as a
    kernel of its own before it (the library always takes it as its own kernel); normed: the
    input needs the residual add and RMSNorm, likewise timed in the kernel's prologue
    (`rms_norm_skinny_gemm`) and as the norm kernel before it; glu: the
    output goes through SiLU-and-mul, in the kernel's epilogue or, for the library, as a
    kernel after it. A config counts only if it agrees with the library (within 2 % of the
    output's largest magnitude); the fastest is kept only when it beats the library by 2 %."""
    pairs = list(zip(weights, biases or [None] * len(weights), strict=True))
    n, k = weights[0].shape
    device = weights[0].device
    x = torch.randn(rows, 2 * k if gated else k, dtype=weights[0].dtype, device=device)
    residual, norm_w = torch.randn_like(x), torch.ones(k, dtype=x.dtype, device=device)
    counters = skinny_counters(n, device)

    def transform(x: torch.Tensor) -> torch.Tensor:
        if normed:
            return fused_add_rms_norm(x, residual, norm_w, 1e-5)[0]
        return silu_and_mul(x) if gated else x

    def fused(w: torch.Tensor, b: torch.Tensor | None, cfg: SkinnyConfig) -> torch.Tensor:
        if normed:
            return rms_norm_skinny_gemm(x, residual, norm_w, 1e-5, w, b, cfg, counters,
                                        glu=glu)[0]  # fmt: skip
        return skinny_gemm(x, w, b, cfg, counters, gated=gated, glu=glu)

    def library(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(transform(x), w, b)
        return silu_and_mul(y) if glu else y

    transformed = gated or normed
    candidates: list[Candidate] = []
    for cfg in SKINNY_CONFIGS if configs is None else configs:
        candidates.append((str(cfg), cfg, transformed, lambda w, b, c=cfg: fused(w, b, c)))
        if transformed:
            candidates.append((f"unfused {cfg}", cfg, False, lambda w, b, c=cfg: skinny_gemm(
                transform(x), w, b, c, counters, glu=glu)))  # fmt: skip
    return SkinnyChoice(*fastest_against_library(library, candidates, pairs, reps))
