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
(`asyncengine_kernels.gemv`) does. A prologue that formed rms_norm(x + residual) lost to
the norm kernel before this one in every start-up plan of three designs (H200 and H100,
2026-12-03 to 12-06) and was removed (docs/performance.md). `tune_skinny` times the configs
against the BLAS library at a row count, for `models.linear_tuning` to plan the winner per
row range.
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
from asyncengine_kernels.rms_norm import fused_add_rms_norm

__all__ = [
    "SKINNY_CONFIGS",
    "SKINNY_MAX_ROWS",
    "SkinnyChoice",
    "SkinnyConfig",
    "pipeline_stages",
    "skinny_counters",
    "skinny_gemm",
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
    """ptr[rows, kk] of a weight: rows are in range (wrapped by the caller),
    only a ragged K is masked."""
    ptrs = ptr + rows[:, None] + kk[None, :]
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(kk < K)[None, :], other=0.0)


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


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    split_tiles,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr, GLU: tl.constexpr,
    IEEE: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
    MAX_SPLITS: tl.constexpr = 1,
):  # fmt: skip
    """Grid (column blocks, K splits). N is the output's columns (GLU: W has 2N rows, the
    gate's then the up's). SPLIT (more than one K split): the grid's splits add up through
    part_ptr [splits, (GLU: 2,) M, N] float32 and count_ptr (one zeroed counter per column
    block). The grid's split count is a run-time argument up to MAX_SPLITS, the config's."""
    BLOCK_M: tl.constexpr = 16
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M and columns past N read a real row or column again (their results are
    # never stored), so no load needs a row or column mask and every tile pipelines alike.
    x_rows = (offs_m % M).to(tl.int64) * stride_xm
    w_rows = (offs_n % N).to(tl.int64) * stride_wn
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
    if GLU:
        w_up = _load_tile(w_ptr, up_rows, kk, K, EVEN_K)
    pdl_wait(USE_PDL)
    x = _load_x_tile(x_ptr, x_rows, kk, K, EVEN_K, GATED)
    acc = _tile_product(w, x, IEEE, DOT_FP32)
    acc_up = acc
    if GLU:
        acc_up = _tile_product(w_up, x, IEEE, DOT_FP32)
    for t in range(1, tiles):
        kk = (first_tile + t) * BLOCK_K + offs_k
        w = _load_tile(w_ptr, w_rows, kk, K, EVEN_K)
        x = _load_x_tile(x_ptr, x_rows, kk, K, EVEN_K, GATED)
        acc += _tile_product(w, x, IEEE, DOT_FP32)
        if GLU:
            w_up = _load_tile(w_ptr, up_rows, kk, K, EVEN_K)
            acc_up += _tile_product(w_up, x, IEEE, DOT_FP32)
    # Stored as [16, BLOCK_N].
    y = tl.trans(acc)
    y_up = tl.trans(acc_up)
    if not SPLIT:
        _store_output(y, y_up, b_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS, GLU)
    else:
        n_splits = tl.num_programs(1)
        halves: tl.constexpr = 2 if GLU else 1
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        part = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + (pid_k * halves) * M * N, y, mask=mask)
        if GLU:
            tl.store(part + (pid_k * 2 + 1) * M * N, y_up, mask=mask)
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
            for s in tl.static_range(MAX_SPLITS):
                # The split test as a tile: the interpreter refuses a scalar in a mask.
                here = mask & (tl.full((BLOCK_M, BLOCK_N), s, tl.int32) < n_splits)
                total += tl.load(part + (s * halves) * M * N, mask=here, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
                if GLU:
                    total_up += tl.load(part + (s * 2 + 1) * M * N, mask=here, other=0.0,
                                        cache_modifier=".cg")  # fmt: skip
            tl.atomic_xchg(counter, 0)
            _store_output(total, total_up, b_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym,
                          HAS_BIAS, GLU)  # fmt: skip


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
    blocks = triton.cdiv(n, config.block_n)
    # Splits of whole tiles; the last may be shorter, and fewer splits than asked may run.
    per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    splits = triton.cdiv(k, per_split)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if splits > 1:
        if counters is None:
            counters = skinny_counters(n, x.device)
        if counters.numel() < blocks:
            raise ValueError(f"{counters.numel()} split-K counters; {blocks} column blocks "
                             "need one each")  # fmt: skip
        part = torch.empty((splits * (2 if glu else 1) * m * n,), dtype=torch.float32,
                           device=x.device)  # fmt: skip
    else:
        counters = part = y
    pdl = use_pdl(x)
    _skinny_gemm_kernel[(blocks, splits)](
        x, weight, bias if bias is not None else y, y, part, counters, m, n, k, x.stride(0),
        weight.stride(0), y.stride(0), per_split // config.block_k,
        HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0, GATED=gated, GLU=glu,
        IEEE=x.dtype == torch.float32,
        DOT_FP32=interpreter_enabled() and x.dtype == torch.bfloat16,
        SPLIT=splits > 1, MAX_SPLITS=config.split_k if splits > 1 else 1,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_PDL=pdl, num_warps=config.num_warps,
        num_stages=pipeline_stages(config, x.element_size(), gated, glu),
        **pdl_kwargs(pdl),
    )  # fmt: skip
    return y


class SkinnyChoice(NamedTuple):
    """What `tune_skinny` chose for one weight shape at one row count."""

    config: SkinnyConfig | None  # None: the BLAS library
    fuses_input: bool  # whether the config forms the (gated) input in its prologue
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
    input needs the residual add and RMSNorm, timed as the norm kernel before either; glu: the
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

    def library(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(transform(x), w, b)
        return silu_and_mul(y) if glu else y

    candidates: list[Candidate] = []
    for cfg in SKINNY_CONFIGS if configs is None else configs:
        if not normed:  # the norm has no form inside the kernel
            candidates.append((str(cfg), cfg, gated, lambda w, b, c=cfg: skinny_gemm(
                x, w, b, c, counters, gated=gated, glu=glu)))  # fmt: skip
        if gated or normed:
            candidates.append((f"unfused {cfg}", cfg, False, lambda w, b, c=cfg: skinny_gemm(
                transform(x), w, b, c, counters, glu=glu)))  # fmt: skip
    return SkinnyChoice(*fastest_against_library(library, candidates, pairs, reps))
