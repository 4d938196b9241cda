"""Matrix-vector product for one-token decode steps: y[1, N] = x[1, K] @ W[N, K]^T (+ bias).

At batch 1 a decode step is a stream of weight reads; each program reads BLOCK_N whole rows
of W with wide loads and reduces them against x in fp32, with no split-K partials to write
back and no second reduction kernel. Whether it beats the BLAS library depends on the shape
and the GPU, so `tune_gemv` times both on the device, and `models/linear_tuning.py` puts
the winner for each group of layers into their matmul plans.

The kernel can also form its input from the previous layer's output, saving a kernel at
batch 1: SiLU-and-mul of a [gate, up] input (`gated`), or the residual add and RMSNorm
(`rms_norm_gemv`), each rounded as the separate kernel rounds it. Every program then
repeats that work on the whole input row, so the tuner also times the unfused form.
Likewise it can apply SiLU-and-mul to its own output (`glu`): a program owns the same rows
of the gate and the up halves of a [gate; up] weight, so the MLP's gate/up projection
hands the down projection its activated input with no kernel in between.

A config's type is its form: `TiledGemvConfig` (the kernel above, `GEMV_CONFIGS`) or
`WholeRowGemvConfig`, a second, persistent form (`PERSISTENT_GEMV_CONFIGS`) that launches a
few programs per multiprocessor; each forms the whole input row once and streams whole row
blocks of W against it, so the input transform is not repeated per row block. The tuner
times it beside the tiled configs for rows up to `PERSISTENT_GEMV_MAX_K` long
(`gemv_candidates`); a caller that wants only some forms passes `configs=` to `tune_gemv`.

The whole-row form also reads e4m3 weight rows with one float32 scale per row (`scale=`, the
layout of `asyncengine_kernels.fp8_linear`), applied to each row's sum before the bias: an FP8
layer's decode step then gets the same fused input transforms as a 16-bit one. The tiled
form reads 16-bit weights only and refuses a scale.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from asyncengine_kernels._triton_utils import num_sms, pdl_kwargs, pdl_wait, tl, triton, use_pdl
from asyncengine_kernels.activation import silu_and_mul, silu_times
from asyncengine_kernels.half_pairs import (
    E4M3_X_SCALE,
    check_pair_activation,
    check_pair_words,
    e4m3_word_dot,
    pack_f16_pair,
)
from asyncengine_kernels.rms_norm import check_norm_inputs, fused_add_rms_norm

__all__ = [
    "GEMV_CONFIGS",
    "PERSISTENT_GEMV_CONFIGS",
    "GemvChoice",
    "GemvConfig",
    "TiledGemvConfig",
    "WholeRowGemvConfig",
    "fastest_against_library",
    "gemv_candidates",
    "gemv_ref",
    "gemv_triton",
    "rms_norm_gemv",
    "tune_gemv",
    "whole_row_max_k",
]


@dataclass(frozen=True)
class TiledGemvConfig:
    """The tiled batch-1 GEMV (`_gemv_kernel`): each program owns `block_n` rows and walks K
    in `block_k` tiles. It reads 16-bit weights only: an e4m3 weight's row scales are a
    whole-row option."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.block_k <= 0:
            raise ValueError("a tiled GEMV config needs block_k > 0")

    def __str__(self) -> str:
        """Short and unique, as timing tables, plan caches and logs name it:
        tiled[block_n, block_k, num_warps, num_stages]."""
        return f"tiled[{self.block_n}, {self.block_k}, {self.num_warps}, {self.num_stages}]"


@dataclass(frozen=True)
class WholeRowGemvConfig:
    """The persistent whole-row GEMV (`_gemv_rows_kernel`): a grid of at most
    `programs_per_sm` programs per multiprocessor (fewer where fewer stay resident), each
    holding the whole input row and streaming `block_n` whole rows of W at a time.
    `pairs` (e4m3 weights): products in half-precision pairs (`asyncengine_kernels.half_pairs`)."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int
    pairs: bool = False

    def __post_init__(self) -> None:
        if self.programs_per_sm <= 0:
            raise ValueError("a whole-row GEMV config needs programs_per_sm > 0")

    def __str__(self) -> str:
        """Short and unique, as timing tables, plan caches and logs name it:
        whole_row[block_n, programs_per_sm, num_warps, num_stages], then " pairs" for pairs."""
        name = (f"whole_row[{self.block_n}, {self.programs_per_sm}, {self.num_warps}, "
                f"{self.num_stages}]")  # fmt: skip
        return name + (" pairs" if self.pairs else "")


# One launch configuration of the batch-1 GEMV; its type is its form.
GemvConfig = TiledGemvConfig | WholeRowGemvConfig


# Few rows per program for the small-N shapes (enough programs to keep every multiprocessor
# streaming), more for the large ones.
GEMV_CONFIGS: list[TiledGemvConfig] = [
    TiledGemvConfig(4, 512, 4, 4),
    TiledGemvConfig(4, 1024, 4, 3),
    TiledGemvConfig(8, 512, 4, 4),
    TiledGemvConfig(8, 256, 4, 4),
    TiledGemvConfig(16, 256, 4, 3),
    TiledGemvConfig(16, 512, 8, 3),
    TiledGemvConfig(32, 128, 4, 4),
]
DEFAULT_GEMV_CONFIG = TiledGemvConfig(8, 512, 4, 4)
# The whole-row kernel holds the input row in registers: only for rows up to this long.
PERSISTENT_GEMV_MAX_K = 8192
# In half-precision pairs it holds the row as f16x2 words, half the registers of float32
# values: rows twice as long fit (an FP8 down projection's 11,008 or 14,336).
PERSISTENT_PAIRS_GEMV_MAX_K = 16384
PERSISTENT_GEMV_CONFIGS: list[WholeRowGemvConfig] = [
    WholeRowGemvConfig(1, 4, 4, programs_per_sm=8),
    WholeRowGemvConfig(2, 4, 3, programs_per_sm=4),
    WholeRowGemvConfig(2, 8, 3, programs_per_sm=4),
    WholeRowGemvConfig(4, 8, 2, programs_per_sm=2),
]


def whole_row_max_k(config: WholeRowGemvConfig) -> int:
    """The longest input row a whole-row config holds (a tiled config takes any length)."""
    return PERSISTENT_PAIRS_GEMV_MAX_K if config.pairs else PERSISTENT_GEMV_MAX_K


def gemv_candidates(k: int) -> list[GemvConfig]:
    """Every config the tuner times for rows of length k: the tiled ones, and the whole-row
    ones where the row fits."""
    return GEMV_CONFIGS + (PERSISTENT_GEMV_CONFIGS if k <= PERSISTENT_GEMV_MAX_K else [])


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


@triton.jit
def _load_vec(ptr, kk, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptr + kk)
    return tl.load(ptr + kk, mask=kk < K, other=0.0)


@triton.jit
def load_gemv_input(
    x_ptr, res_ptr, norm_w_ptr, rstd, kk, K,
    EVEN_K: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """The GEMV's input x[kk] in fp32, formed as the unfused kernels would form and round it:
    GATED: x holds [gate, up] and this is silu(gate) * up (as `silu_and_mul`);
    NORM: this is rms_norm(x (+ residual)) with the row's precomputed rstd (as `rms_norm`)."""
    dt = x_ptr.dtype.element_ty
    x = _load_vec(x_ptr, kk, K, EVEN_K)
    if GATED:
        gate = x.to(tl.float32)
        up = _load_vec(x_ptr + K, kk, K, EVEN_K).to(tl.float32)
        x = silu_times(gate, up).to(dt)
    if NORM:
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + _load_vec(res_ptr, kk, K, EVEN_K).to(tl.float32)).to(dt)
        normed = (x.to(tl.float32) * rstd).to(dt).to(tl.float32)
        x = (normed * _load_vec(norm_w_ptr, kk, K, EVEN_K).to(tl.float32)).to(dt)
    return x.to(tl.float32)


@triton.jit
def _load_w(w_rows, kk, K, n_mask, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_rows + kk[None, :], mask=n_mask[:, None], other=0.0)
    return tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def row_rstd(x_ptr, res_ptr, res_out_ptr, K, eps, K_PAD: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr):  # fmt: skip
    """RMSNorm's 1 / rms of the row x (+ residual); program 0 also writes x + residual, the
    new residual. Every program needs the whole row's rstd: each reads the row (from L2) and
    reduces it, which costs less than a separate norm kernel's launch and round trip."""
    offs = tl.arange(0, K_PAD)
    row = tl.load(x_ptr + offs, mask=offs < K, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + offs, mask=offs < K, other=0.0)
        row = (row.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if tl.program_id(0) == 0:
            tl.store(res_out_ptr + offs, row, mask=offs < K)
    rowf = row.to(tl.float32)
    return tl.rsqrt(tl.sum(rowf * rowf, axis=0) / K + eps)


@triton.jit
def _store_rows(
    acc, acc_up, offs_n, n_mask, N, b_ptr, s_ptr, y_ptr, HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr, GLU: tl.constexpr, PAIRS: tl.constexpr = False,
):  # fmt: skip
    """Reduce the [BLOCK_N, BLOCK_K] products to the rows' outputs, apply the rows' weight
    scales (HAS_SCALE: an e4m3 weight; PAIRS: products in units of 1 / E4M3_X_SCALE), add
    the bias and, for a GLU output, apply SiLU-and-mul; store them."""
    y = tl.sum(acc, axis=1)
    if PAIRS:
        y = y * E4M3_X_SCALE
    if HAS_SCALE:
        y = y * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if GLU:
        # Rounded as the plain GEMV's [gate, up] output, then as `silu_and_mul` rounds.
        up = tl.sum(acc_up, axis=1)
        if PAIRS:
            up = up * E4M3_X_SCALE
        if HAS_SCALE:
            up = up * tl.load(s_ptr + N + offs_n, mask=n_mask, other=0.0)
        if HAS_BIAS:
            up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        gate = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(y_ptr.dtype.element_ty).to(tl.float32)
        y = silu_times(gate, up)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, res_ptr, norm_w_ptr, res_out_ptr, eps, N, K, stride_wn,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, GLU: tl.constexpr, K_PAD: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    # GLU: W is [gate; up] with N rows each, and this program owns the same N rows of both,
    # so it can apply SiLU-and-mul to its own outputs.
    up_rows = w_ptr + (offs_n.to(tl.int64) + N)[:, None] * stride_wn
    # The weights never depend on the previous kernel: the first tile is requested before
    # waiting for it, so under programmatic dependent launch it streams in while that
    # kernel finishes.
    w = _load_w(w_rows, offs_k, K, n_mask, EVEN_K)
    w_up = w
    if GLU:
        w_up = _load_w(up_rows, offs_k, K, n_mask, EVEN_K)
    pdl_wait(USE_PDL)
    rstd = 0.0
    if NORM:
        rstd = row_rstd(x_ptr, res_ptr, res_out_ptr, K, eps, K_PAD, HAS_RESIDUAL)
    x = load_gemv_input(x_ptr, res_ptr, norm_w_ptr, rstd, offs_k, K, EVEN_K, GATED, NORM,
                        HAS_RESIDUAL)  # fmt: skip
    acc = w.to(tl.float32) * x[None, :]
    acc_up = acc
    if GLU:
        acc_up = w_up.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + offs_k
        w = _load_w(w_rows, kk, K, n_mask, EVEN_K)
        if GLU:
            w_up = _load_w(up_rows, kk, K, n_mask, EVEN_K)
        x = load_gemv_input(x_ptr, res_ptr, norm_w_ptr, rstd, kk, K, EVEN_K, GATED, NORM,
                            HAS_RESIDUAL)  # fmt: skip
        acc += w.to(tl.float32) * x[None, :]
        if GLU:
            acc_up += w_up.to(tl.float32) * x[None, :]
    # 16-bit weights have no row scales: the scale pointer (y_ptr here) is never read.
    _store_rows(acc, acc_up, offs_n, n_mask, N, b_ptr, y_ptr, y_ptr, HAS_BIAS, False, GLU)


@triton.jit
def _load_row_block(w_ptr, rb, N, K, stride_wn, offs_k, BLOCK_N: tl.constexpr,
                    GLU: tl.constexpr):  # fmt: skip
    """Whole rows [rb * BLOCK_N, +BLOCK_N) of W (and, for GLU, the same rows of its up half)."""
    offs_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w = _load_w(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn, offs_k, K, n_mask, False)
    w_up = w
    if GLU:
        up_rows = w_ptr + (offs_n.to(tl.int64) + N)[:, None] * stride_wn
        w_up = _load_w(up_rows, offs_k, K, n_mask, False)
    return w, w_up, offs_n, n_mask


@triton.jit
def _pairs_input(x_ptr, res_ptr, norm_w_ptr, rstd, K, K_PAD: tl.constexpr, GATED: tl.constexpr,
                 NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):  # fmt: skip
    """The formed input as the f16x2 pairs (x0, x1), (x2, x3) of each 4-byte weight word
    (`asyncengine_kernels.half_pairs.e4m3_word_dot`); zero past K. It is formed in one contiguous
    pass, as the float32 form forms it, and split into the four values of each word after."""
    x = load_gemv_input(x_ptr, res_ptr, norm_w_ptr, rstd, tl.arange(0, K_PAD), K, False, GATED,
                        NORM, HAS_RESIDUAL)  # fmt: skip
    # [K / 4, 2, 2]: (word, a, b) holds value 4 word + 2 a + b.
    lo, hi = tl.split(tl.reshape(x, (K_PAD // 4, 2, 2)))
    x0, x2 = tl.split(lo)
    x1, x3 = tl.split(hi)
    return pack_f16_pair(x0, x1, E4M3_X_SCALE), pack_f16_pair(x2, x3, E4M3_X_SCALE)


@triton.jit
def _row_block_products(w, w_up, x, x01, x23, PAIRS: tl.constexpr):
    """A row block's products with the input: per value in float32, or with PAIRS (w, w_up
    as e4m3 words) per word in half-precision pairs, in units of 1 / E4M3_X_SCALE."""
    if PAIRS:
        return e4m3_word_dot(w, x01[None, :], x23[None, :]), e4m3_word_dot(
            w_up, x01[None, :], x23[None, :]
        )
    return w.to(tl.float32) * x[None, :], w_up.to(tl.float32) * x[None, :]


@triton.jit
def _gemv_rows_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, res_ptr, norm_w_ptr, res_out_ptr, eps, N, K, stride_wn,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, GLU: tl.constexpr, K_PAD: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_SCALE: tl.constexpr = False, PAIRS: tl.constexpr = False,
):  # fmt: skip
    """The persistent whole-row form: a grid of a few programs per multiprocessor, each of
    which forms the input row once (its norm or activation included) and then streams whole
    row blocks pid, pid + G, ... of W against it. The input's transform and the row's rstd
    are paid once per program rather than once per row block and K tile.

    PAIRS (e4m3 weights, HAS_SCALE): w_ptr is the weight viewed as int32 words (stride_wn
    in words) and the products run in half-precision pairs, two values an instruction; at a
    byte per weight the float32 form issues about twice the instructions per byte of the
    16-bit weights' form."""
    pid = tl.program_id(0)
    offs_k = tl.arange(0, K_PAD // 4 if PAIRS else K_PAD)
    # The columns a row block masks against: words with PAIRS (K is a multiple of 4).
    k_cols = K // 4 if PAIRS else K
    # As in `_gemv_kernel`, the first weights are requested before waiting.
    w, w_up, offs_n, n_mask = _load_row_block(w_ptr, pid, N, k_cols, stride_wn, offs_k, BLOCK_N,
                                              GLU)  # fmt: skip
    pdl_wait(USE_PDL)
    rstd = 0.0
    if NORM:
        rstd = row_rstd(x_ptr, res_ptr, res_out_ptr, K, eps, K_PAD, HAS_RESIDUAL)
    if PAIRS:
        x01, x23 = _pairs_input(x_ptr, res_ptr, norm_w_ptr, rstd, K, K_PAD, GATED, NORM,
                                HAS_RESIDUAL)  # fmt: skip
        x = x01
    else:
        x = load_gemv_input(x_ptr, res_ptr, norm_w_ptr, rstd, offs_k, K, False, GATED, NORM,
                            HAS_RESIDUAL)  # fmt: skip
        x01, x23 = x, x
    acc, acc_up = _row_block_products(w, w_up, x, x01, x23, PAIRS)
    _store_rows(acc, acc_up, offs_n, n_mask, N, b_ptr, s_ptr, y_ptr, HAS_BIAS, HAS_SCALE, GLU,
                PAIRS)  # fmt: skip
    for rb in range(pid + tl.num_programs(0), tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        w, w_up, offs_n, n_mask = _load_row_block(
            w_ptr, rb, N, k_cols, stride_wn, offs_k, BLOCK_N, GLU
        )
        acc, acc_up = _row_block_products(w, w_up, x, x01, x23, PAIRS)
        _store_rows(acc, acc_up, offs_n, n_mask, N, b_ptr, s_ptr, y_ptr, HAS_BIAS, HAS_SCALE,
                    GLU, PAIRS)  # fmt: skip


def _check(x: torch.Tensor, weight: torch.Tensor, width: int, what: str) -> None:
    if x.numel() != width or x.shape[-1] != x.numel():
        raise ValueError(f"gemv needs x [1, {what}], got {tuple(x.shape)}")
    if weight.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("gemv needs contiguous rows of x and weight")


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
    *,
    gated: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    glu: bool = False,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, k = weight.shape
    if scale is not None and isinstance(config, TiledGemvConfig):
        raise ValueError(f"the tiled GEMV {config} reads 16-bit weights only; weight scales "
                         "(an e4m3 weight) take a whole-row config")  # fmt: skip
    if scale is not None and (scale.shape != (n,) or scale.dtype != torch.float32):
        raise ValueError(f"the weight scales must be float32 [{n}], one per weight row")
    if scale is None and weight.dtype == torch.float8_e4m3fn:
        raise ValueError("an e4m3 weight needs its row scales")
    pairs = isinstance(config, WholeRowGemvConfig) and config.pairs
    if pairs:
        _check_pairs(x, weight)
    if glu:
        if n % 2:
            raise ValueError(f"a GLU output needs [gate; up] weight rows, got {n} rows")
        n //= 2
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    norm_weight, eps = norm if norm is not None else (y, 0.0)
    pdl = use_pdl(x)
    # A tensor the launch goes without is passed as y: the kernel never reads it.
    b_arg, res_arg, res_out_arg = (t if t is not None else y for t in (bias, residual, res_out))
    flags = {
        "HAS_BIAS": bias is not None, "GATED": gated, "NORM": norm is not None,
        "HAS_RESIDUAL": residual is not None, "GLU": glu, "USE_PDL": pdl,
        "BLOCK_N": config.block_n, "num_warps": config.num_warps,
        "num_stages": config.num_stages, **pdl_kwargs(pdl),
    }  # fmt: skip
    if isinstance(config, TiledGemvConfig):
        _gemv_kernel[(triton.cdiv(n, config.block_n),)](
            x, weight, b_arg, y, res_arg, norm_weight, res_out_arg, float(eps), n, k,
            weight.stride(0), EVEN_K=k % config.block_k == 0,
            K_PAD=triton.next_power_of_2(k) if norm else 1, BLOCK_K=config.block_k, **flags,
        )  # fmt: skip
        return y, res_out
    if k > whole_row_max_k(config):
        raise ValueError(f"the whole-row GEMV {config} takes rows up to "
                         f"{whole_row_max_k(config)} long")  # fmt: skip
    # Pairs read the e4m3 rows as int32 words.
    w_arg, stride_wn = (weight.view(torch.int32), weight.stride(0) // 4) if pairs else (
        weight, weight.stride(0))  # fmt: skip
    args = (
        x, w_arg, b_arg, scale if scale is not None else y, y, res_arg, norm_weight,
        res_out_arg, float(eps), n, k, stride_wn,
    )  # fmt: skip
    flags.update(HAS_SCALE=scale is not None, K_PAD=triton.next_power_of_2(k), PAIRS=pairs)
    per_sm = config.programs_per_sm
    if x.is_cuda:
        # No more programs than stay resident at once: a second wave would be a tail.
        per_sm = min(per_sm, _resident_rows_programs(x.device, args, flags))
    sms = num_sms(x.device.index or 0) if x.is_cuda else 1
    grid = min(triton.cdiv(n, config.block_n), per_sm * sms)
    _gemv_rows_kernel[(grid,)](*args, **flags)
    return y, res_out


def _check_pairs(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Pairs take e4m3 rows of whole, aligned 4-byte words and a 16-bit activation."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"half-precision pairs read e4m3 weights, got {weight.dtype}")
    check_pair_activation(x)
    check_pair_words(weight)


_resident: dict[tuple, int] = {}


def _resident_rows_programs(device: torch.device, args: tuple, flags: dict) -> int:
    """How many programs of this whole-row kernel variant fit on one multiprocessor at once,
    from its compiled register and shared-memory use (compiled here if it is not yet)."""
    key = (device.index, tuple(sorted(flags.items())), args[0].dtype, args[1].dtype)
    if key not in _resident:
        kernel = _gemv_rows_kernel.warmup(*args, grid=(1,), **flags)
        kernel._init_handles()  # loads the binary, which fills in n_regs
        props = torch.cuda.get_device_properties(device)
        threads = 32 * flags["num_warps"]
        regs = getattr(props, "regs_per_multiprocessor", 65536)
        smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
        max_threads = getattr(props, "max_threads_per_multi_processor", 2048)
        fits = [regs // max(kernel.n_regs * threads, 1), max_threads // threads, 32]
        if kernel.metadata.shared:
            fits.append(smem // kernel.metadata.shared)
        _resident[key] = max(1, min(fits))
    return _resident[key]


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig = DEFAULT_GEMV_CONFIG,
    *,
    gated: bool = False,
    glu: bool = False,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [1, K] (or [K]); weight [N, K] with contiguous rows; returns [1, N] in x.dtype.

    scale: float32 [N], one per weight row: the weight is stored scaled (an e4m3 `weight`,
    `asyncengine_kernels.fp8_linear`'s layout) and the row's sum is multiplied by it before the
    bias. Whole-row configs only: a tiled config refuses it.

    gated: x is [1, 2K] holding [gate, up], and the product is taken with silu(gate) * up
    (the MLP's down projection, without a separate activation kernel).
    glu: weight is [gate; up] (2N rows) and the result is silu(gate) * up, [1, N] (the MLP's
    gate/up projection with the activation in its epilogue)."""
    k = weight.shape[1]
    _check(x, weight, 2 * k if gated else k, f"2 * {k}" if gated else str(k))
    return _launch(x, weight, bias, config, gated=gated, glu=glu, scale=scale)[0]


def rms_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig = DEFAULT_GEMV_CONFIG,
    *,
    glu: bool = False,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x + residual) @ weight^T (+ bias) at batch 1 in one kernel, rounded as the
    separate `fused_add_rms_norm` then GEMV would round it (with `glu`, then SiLU-and-mul of
    the [gate, up] product, and with `scale`, an e4m3 weight's row scales, as in
    `gemv_triton`). Returns (y [1, N], the new residual x + residual, or x itself without a
    residual)."""
    k = weight.shape[1]
    _check(x, weight, k, str(k))
    check_norm_inputs(x, residual, norm_weight)
    y, res_out = _launch(
        x, weight, bias, config, norm=(norm_weight.contiguous(), eps), residual=residual, glu=glu,
        scale=scale,
    )  # fmt: skip
    return y, res_out if res_out is not None else x


def graph_time_ms(
    call: Callable[[torch.Tensor, torch.Tensor | None], object],
    pairs: list[tuple[torch.Tensor, torch.Tensor | None]],
    reps: int,
) -> float:
    """GPU time of one call, as a decode CUDA graph runs it: one graph that calls it once
    per weight in `pairs` (distinct weights, as the layers are, so L2 holds none of them)."""
    for w, b in pairs:  # compile and warm up outside the capture
        call(w, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w, b in pairs:
            call(w, b)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(pairs))
    times.sort()
    return times[len(times) // 2]


Call = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
Candidate = tuple[str, object, bool, Call]  # name, config, fuses the input, the call


_compiling = threading.local()


@contextmanager
def compile_only() -> Iterator[None]:
    """Within it, on this thread, `fastest_against_library` (so `tune_gemv` and
    `asyncengine_kernels.skinny_gemm.tune_skinny`) runs the library's call and each
    candidate's once, untimed, and picks the library: a pass from a pool of threads that
    compiles a tuner's Triton kernels side by side (Triton releases the GIL while it
    compiles) before the serial pass times them."""
    _compiling.on = True
    try:
        yield
    finally:
        _compiling.on = False


def fastest_against_library(
    library: Call, candidates: Sequence[Candidate], pairs: list[tuple[torch.Tensor,
    torch.Tensor | None]], reps: int,
) -> tuple[object | None, bool, float, dict[str, float]]:  # fmt: skip
    """Time the library's call and each candidate's (`graph_time_ms`); a candidate counts
    only if it agrees with the library and beats it by 2 % (a tie within timing noise keeps
    the library). Returns the fastest such candidate's config and whether it fuses the
    input (None, False: the library), its ms per call, and every time, by name: the fields
    of `GemvChoice` and `SkinnyChoice`. Under `compile_only`: each call runs once and the
    library is returned, timed as 0."""
    if getattr(_compiling, "on", False):
        with torch.inference_mode():
            library(*pairs[0])
            for _, _, _, call in candidates:
                with suppress(Exception):  # the timed pass skips it too
                    call(*pairs[0])
        return None, False, 0.0, {}
    with torch.inference_mode():
        timings = {"blas": graph_time_ms(library, pairs, reps)}
        want = library(*pairs[0]).float()
        tol = 0.02 * float(want.abs().max()) + 1e-3
        best: Candidate | None = None
        for cand in candidates:
            name, _, _, call = cand
            try:
                if float((call(*pairs[0]).float() - want).abs().max()) > tol:
                    continue
                timings[name] = graph_time_ms(call, pairs, reps)
            except Exception:  # a config this GPU cannot run (resources): skip it
                continue
            if timings[name] < 0.98 * timings["blas"] and (
                best is None or timings[name] < timings[best[0]]
            ):
                best = cand
    if best is None:
        return None, False, timings["blas"], timings
    return best[1], best[2], timings[best[0]], timings


class GemvChoice(NamedTuple):
    """What `tune_gemv` chose for one weight shape."""

    config: GemvConfig | None  # the Triton config, or None for the BLAS library
    fuses_input: bool  # whether that config takes the input's transform in its prologue
    ms: float  # GPU time of the chosen form, per call
    timings: dict[str, float]  # every form timed, in ms per call


def tune_gemv(
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None] | None = None,
    reps: int = 5,
    gated: bool = False,
    normed: bool = False,
    glu: bool = False,
    configs: Sequence[GemvConfig] | None = None,
) -> GemvChoice:
    """Time the BLAS library and every config at batch 1 over these same-shape weights (CUDA
    only; the layers' own weights, so nothing is copied and nothing is served from L2).

    gated: the input is [gate, up] and needs SiLU-and-mul; normed: it needs the residual add
    and RMSNorm (`rms_norm_gemv`). Such an input transform can run inside the GEMV ("fused")
    or as its own kernel before a plain GEMV or the library; all three are timed, since the
    fused form repeats the transform in every program.

    glu: the weight is [gate; up] and the output goes through SiLU-and-mul: the Triton forms
    apply it in their epilogue, the library form as a kernel of its own after the matmul.

    configs: the Triton configs to try (default `gemv_candidates(K)`); whole-row ones are
    skipped where the row is too long for them.

    A config is timed only if its result agrees with the library's (within 2 % of the
    output's largest magnitude); the fastest is kept only when it beats the library by 2 %.
    """
    pairs = list(zip(weights, biases or [None] * len(weights), strict=True))
    k = weights[0].shape[1]
    x = torch.randn(1, 2 * k if gated else k, dtype=weights[0].dtype, device=weights[0].device)
    residual, norm_w = torch.randn_like(x), torch.ones(k, dtype=x.dtype, device=x.device)
    transformed = gated or normed

    def transform(x: torch.Tensor) -> torch.Tensor:
        if normed:
            return fused_add_rms_norm(x, residual, norm_w, 1e-5)[0]
        return silu_and_mul(x) if gated else x

    def fused(w: torch.Tensor, b: torch.Tensor | None, cfg: GemvConfig) -> torch.Tensor:
        if normed:
            return rms_norm_gemv(x, residual, norm_w, 1e-5, w, b, cfg, glu=glu)[0]
        return gemv_triton(x, w, b, cfg, gated=gated, glu=glu)

    def library(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(transform(x), w, b)
        return silu_and_mul(y) if glu else y

    candidates: list[Candidate] = []
    tried = gemv_candidates(k) if configs is None else configs
    fits = [c for c in tried if isinstance(c, TiledGemvConfig) or k <= whole_row_max_k(c)]
    for cfg in fits:
        candidates.append((str(cfg), cfg, transformed, lambda w, b, c=cfg: fused(w, b, c)))
        if transformed:
            candidates.append((
                f"unfused {cfg}", cfg, False,
                lambda w, b, c=cfg: gemv_triton(transform(x), w, b, c, glu=glu),
            ))  # fmt: skip
    return GemvChoice(*fastest_against_library(library, candidates, pairs, reps))
