"""Weight-only int4/int8 matmuls: y = x W^T (+ b) with W stored as packed integers.

One internal layout serves every checkpoint format (GPTQ, AWQ and compressed-tensors are
repacked into it at load, `models.quantization`):
- `qweight` int32 [K / pack, N]: `pack = 32 // bits` consecutive input rows of one output
  column per word, row k in bits [(k % pack) * bits, ...): a program reading a [BLOCK_K,
  BLOCK_N] tile loads words contiguous along N;
- `scales` [G, N] and `zeros` [G, N] in the activation dtype (zeros integer-valued), one row
  per group of `group_size` consecutive input rows: W[n, k] = (q[k, n] - zeros[g, n]) *
  scales[g, n] with g = k // group_size.

`quant_matmul_ref` (dequantize, then matmul) is the CPU path and the oracle of the two Triton
kernels: `quant_gemm` (tensor-core tiles: each weight tile dequantized in registers to the
activation dtype with its scales applied, as `dequantize_weight` rounds it, then chained
into one fp32 accumulator; tiles inside a group or spanning whole groups, K optionally
split) from a few rows to prefill, and `quant_gemv` (one program per output block, input
row and K split, all of a program's tiles loaded at once, dequantization fused, products
in half-precision pairs, fp32 partial sums reduced after) for decode batches of a few rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asyncengine_kernels._triton_utils import (
    interpreter_enabled,
    pdl_kwargs,
    pdl_wait,
    tl,
    triton,
    use_pdl,
)
from asyncengine_kernels.gemv_split_k import check_gemv_counters, finish_gemv_row, gemv_counters
from asyncengine_kernels.half_pairs import (
    INT4_X_SCALE,
    INT8_X_SCALE,
    check_pair_activation,
    int4_word_dot,
    int8_word_dot,
    int_x_pairs,
    zero_pairs,
)

__all__ = [
    "QuantAtOnceGemvConfig",
    "QuantGemmConfig",
    "at_once_gemv_config",
    "dequantize_weight",
    "dequantize_weight_triton",
    "gemm_block_k",
    "gemm_config",
    "pack_int_weight",
    "quant_gemm",
    "quant_gemm_candidates",
    "quant_gemv",
    "quant_gemv_candidates",
    "quant_matmul_ref",
    "unpack_int_weight",
]


def pack_int_weight(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer values q [N, K] (0 <= q < 2^bits) -> int32 [K / pack, N], the kernels' layout."""
    pack = 32 // bits
    n, k = q.shape
    if k % pack:
        raise ValueError(f"{bits}-bit weights need an input dimension divisible by {pack}, got {k}")
    cols = q.t().to(torch.int64).reshape(k // pack, pack, n)
    shifts = torch.arange(pack, device=q.device, dtype=torch.int64).view(1, pack, 1) * bits
    words = (cols << shifts).sum(dim=1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement int32
    return words.to(torch.int32).contiguous()


def unpack_int_weight(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [K / pack, N] -> the integer values [K, N] (int32)."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=qweight.device, dtype=torch.int32).view(1, pack, 1) * bits
    vals = (qweight.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(-1, qweight.shape[1])


def dequantize_weight(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
    group_size: int, dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """W^T [K, N] in `dtype` (default: the scales')."""
    q = unpack_int_weight(qweight, bits).to(torch.float32)
    z = zeros.to(torch.float32).repeat_interleave(group_size, dim=0)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    return ((q - z) * s).to(dtype or scales.dtype)


def quant_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    bits: int, group_size: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] -> x W^T (+ b) [M, N]: dequantize to x's dtype, then the library's matmul."""
    w_t = dequantize_weight(qweight, scales, zeros, bits, group_size, x.dtype)
    y = x @ w_t
    return y if bias is None else y + bias


def _check(x: torch.Tensor, qweight: torch.Tensor, bits: int, group_size: int, block_k: int,
           gated: bool = False, whole_groups: bool = False) -> tuple[int, int, int]:  # fmt: skip
    """(M, N, K) of a launch whose tiles are BLOCK_K input rows: inside one group, or with
    `whole_groups` (the GEMM) also spanning whole groups."""
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    if gated and x.shape[1] % 2:
        raise ValueError(f"a gated input holds [gate, up]: an even width, got {x.shape[1]}")
    n = qweight.shape[1]
    if qweight.shape[0] * (32 // bits) != k:
        raise ValueError(f"x has {k} columns; the {bits}-bit weight has {qweight.shape[0]} words")
    if block_k & (block_k - 1) or block_k < 32 // bits:
        raise ValueError(f"BLOCK_K={block_k} must be a power of two of at least a word's values")
    spans = whole_groups and block_k % group_size == 0 and group_size % (32 // bits) == 0
    if (group_size % block_k and not spans) or k % block_k:
        spanning = " (or be a multiple of the group)" if whole_groups else ""
        raise ValueError(f"BLOCK_K={block_k} must divide the group size {group_size} and "
                         f"K={k}{spanning}")  # fmt: skip
    if x.stride(1) != 1:
        raise ValueError("the quantized matmuls need x with contiguous rows")
    return m, n, k


@dataclass(frozen=True)
class QuantGemmConfig:
    """Tile shape of `quant_gemm`; `split_k` > 1 splits K across that many programs per
    output tile, the last to finish adding the others' fp32 partial sums in a fixed order."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1

    def __str__(self) -> str:
        split = f" split{self.split_k}" if self.split_k > 1 else ""
        return (f"gemm {self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} "
                f"s{self.num_stages}{split}")  # fmt: skip


@dataclass(frozen=True)
class QuantAtOnceGemvConfig:
    """Blocking of `quant_gemv` (`_quant_gemv_at_once_kernel`): output columns per program,
    and `tiles` tiles of `block_k` input rows that each program loads at once, with no K
    loop; the K splits follow from them. Its products are always in half-precision pairs,
    and it runs one stage (there is no loop to pipeline)."""

    block_n: int
    block_k: int
    tiles: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.tiles <= 0 or self.tiles & (self.tiles - 1):
            raise ValueError(f"{self}: loading tiles at once needs a power-of-two tile count")

    def __str__(self) -> str:
        return f"gemv n{self.block_n} k{self.block_k}x{self.tiles} at once w{self.num_warps} pairs"


def gemm_block_k(block_k: int, group_size: int, k: int) -> int:
    """BLOCK_K as `quant_gemm` runs it: narrowed to the largest divisor of the group where it
    neither divides the group nor spans whole groups (a group of 96: 32), then to one of K
    (a K of 64)."""
    bk = block_k if block_k % group_size == 0 else math.gcd(block_k, group_size)
    return math.gcd(bk, k)  # a multiple of the group still, where bk was one (K is one too)


def gemm_config(
    group_size: int, k: int, block_m: int, block_n: int, block_k: int, num_warps: int,
    num_stages: int, split_k: int = 1,
) -> QuantGemmConfig | None:  # fmt: skip
    """A `quant_gemm` tile shape with BLOCK_K fitted to the group and K (`gemm_block_k`), or
    None where the tiles cannot fit."""
    bk = gemm_block_k(block_k, group_size, k)
    if bk & (bk - 1) or bk < 16 or split_k & (split_k - 1) or k // bk < split_k:
        return None
    return QuantGemmConfig(block_m, block_n, bk, num_warps, num_stages, split_k)


def at_once_gemv_config(
    group_size: int, k: int, block_n: int, values: int, num_warps: int
) -> QuantAtOnceGemvConfig | None:
    """The at-once `quant_gemv` whose programs each load `values` input rows as tiles of
    up to 128 rows (a tile within one group), or None where that does not fit the group
    and K (or K is shorter than one program's rows)."""
    bk = min(128, group_size)
    if group_size % bk or bk & (bk - 1) or k % bk or k < values:
        return None
    tiles = values // bk
    if not tiles or tiles & (tiles - 1):
        return None
    return QuantAtOnceGemvConfig(block_n, bk, tiles, num_warps)


# Every config the start-up tuner can time (`ASYNCENGINE_TUNE_ALL_KINDS`; by default it
# times the few its rule table names, `models.quantization.kinds`): those that won a Llama-2-7B
# shape at some row count on the H200 in int4 or int8, or came within 10 % of the winner.
# The others were removed; docs/quantization.md records what they measured.
# GEMM tiles (block_m, block_n, block_k, warps, stages, split_k) and what each won on the
# H200 against dequantize + cuBLAS (2026-12-03: Llama-2-7B layers in int4 and int8 g128 at
# 16-256 rows; the table is in docs/quantization.md, "The integer GEMM on 16-bit tiles"):
# - 16x64x128 w4 s4 split 4: every layer in both widths at 16 rows (gate/up int4 0.0501 ms
#   against 0.1132, bf16 cuBLAS 0.0488); the K split fills the multiprocessors that the 64
#   column tiles of a 4096-wide layer leave idle, and wins on the wide layers too;
# - 64x64x128 w4 s3: 64 rows on gate/up (int4 0.0661 ms against 0.1142, int8 0.0686 against
#   0.1229) and q/k/v int8 (0.057 against 0.0703); 128 rows on q/k/v int8 (0.0692 against
#   0.0714), q/k/v int4 0.2 % behind;
# - the same, split 2: 64 rows on q/k/v int4 (0.039 against 0.0642) and down (int4 0.0611
#   against 0.0621, int8 0.0648 against 0.0667); within 10 % at 128 rows on o and down int8;
# - 128x64x64 w4 s3: 128 rows on gate/up (int4 0.0886 against 0.1156, int8 0.0891 against
#   0.1247).
# Dequantize + cuBLAS won the rest: o at 64 rows, o, down and q/k/v int4 at 128, every layer
# at 256 (by 1.15-1.97x over the best tile). Removed for winning nothing and never coming
# within 10 % of the winner (best ratio to it over the 32 cases): 16x64x128 w4 s4 unsplit
# 1.14, 128x128x64 w8 s3 1.11, 256x128x64 w8 s3 1.31.
QUANT_GEMM_SHAPES = ((16, 64, 128, 4, 4, 4), (64, 64, 128, 4, 3, 1), (64, 64, 128, 4, 3, 2),
                     (128, 64, 64, 4, 3, 1))  # fmt: skip
# GEMVs loading all of a program's tiles at once (block_n, input rows per program, warps):
# many small programs of 32 int4 words a thread came out best at 1-4 rows.
QUANT_AT_ONCE_GEMV_SHAPES = ((32, 256, 1), (32, 512, 1), (32, 1024, 4), (32, 256, 2),
                             (32, 512, 2), (32, 2048, 4))  # fmt: skip


def quant_gemm_candidates(group_size: int, k: int) -> list[QuantGemmConfig]:
    """Every tile shape the start-up tuner can time (BLOCK_K divides the group or spans
    whole groups)."""
    out = (gemm_config(group_size, k, *shape) for shape in QUANT_GEMM_SHAPES)
    return list(dict.fromkeys(c for c in out if c is not None))


def quant_gemv_candidates(group_size: int, k: int) -> list[QuantAtOnceGemvConfig]:
    """Every GEMV blocking the start-up tuner can time (those of `QUANT_AT_ONCE_GEMV_SHAPES`
    that fit the group and K)."""
    out = (at_once_gemv_config(group_size, k, *shape) for shape in QUANT_AT_ONCE_GEMV_SHAPES)
    return list(dict.fromkeys(c for c in out if c is not None))


# Integers below 2^23 OR'ed into this float's mantissa read back as 2^23 + q: unpacking with
# integer ops and one subtraction instead of a slower int-to-float conversion per value.
_MAGIC_BITS = tl.constexpr(0x4B000000)
_MAGIC = tl.constexpr(8388608.0)


@triton.jit
def _dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_mask, N, GROUP_SIZE: tl.constexpr,
                  BITS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """W^T's rows k0..k0 + BLOCK_K [BLOCK_K, BLOCK_N] in DTYPE, scaled: (q - zero) * scale
    formed in fp32 and rounded once, as `dequantize_weight` rounds it (|q - zero| < 2^8 and
    a 16-bit scale make the product exact in fp32). The tile lies inside one group
    (BLOCK_K | GROUP_SIZE) or spans whole groups (GROUP_SIZE | BLOCK_K): its words are read
    as [groups, words of a group, BLOCK_N], so each group's scales and zeros broadcast over
    its own rows and no row gathers its scale."""
    PACK: tl.constexpr = 32 // BITS
    GROUP_K: tl.constexpr = BLOCK_K if BLOCK_K < GROUP_SIZE else GROUP_SIZE
    GROUPS: tl.constexpr = BLOCK_K // GROUP_K
    GROUP_W: tl.constexpr = GROUP_K // PACK
    offs_g = tl.arange(0, GROUPS)
    rows = k0 // PACK + offs_g[:, None] * GROUP_W + tl.arange(0, GROUP_W)[None, :]
    words = tl.load(qw_ptr + rows[:, :, None] * N + offs_n[None, None, :],
                    mask=n_mask[None, None, :], other=0)  # fmt: skip
    sz = (k0 // GROUP_SIZE + offs_g)[:, None] * N + offs_n[None, :]
    s = tl.load(s_ptr + sz, mask=n_mask[None, :], other=0.0).to(tl.float32)
    z = tl.load(z_ptr + sz, mask=n_mask[None, :], other=0.0).to(tl.float32)
    # Word w holds input rows w * PACK + i at bit i * BITS: [groups, words, PACK, BLOCK_N].
    shifts = tl.arange(0, PACK) * BITS
    q = (words[:, :, None, :] >> shifts[None, None, :, None]) & ((1 << BITS) - 1)
    q = (q | _MAGIC_BITS).to(tl.float32, bitcast=True)
    w = (q - (z + _MAGIC)[:, None, None, :]) * s[:, None, None, :]
    return tl.reshape(w.to(DTYPE), (BLOCK_K, offs_n.shape[0]))


@triton.jit
def _quant_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm,
    stride_ym, K_PER_SPLIT, GROUP_SIZE: tl.constexpr, BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT: tl.constexpr = False, DOT_FP32: tl.constexpr = False,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] output tile over one K split. The product is formed transposed,
    y^T = W x^T: the dequantized weight tile is the MMA's left operand, which Hopper's
    tensor cores take from registers (the right one must sit in shared memory, where x
    arrives by asynchronous copy), and the rows of a decode batch (16-64) are a legal MMA
    width while the left operand's 64 rows are not. DOT_FP32: the interpreter multiplies
    bf16 bit patterns in tl.dot, so the operands are upcast there."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        w = _dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_mask, N, GROUP_SIZE, BITS,
                          BLOCK_K, x_ptr.dtype.element_ty)  # fmt: skip
        x_t = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None],
                      mask=m_mask[None, :], other=0.0)  # fmt: skip
        if DOT_FP32:
            w, x_t = w.to(tl.float32), x_t.to(tl.float32)
        # Scaled before the dot: one accumulator over every group, the MMAs chained.
        acc = tl.dot(tl.trans(w), x_t, acc)
    acc = tl.trans(acc)
    if not SPLIT:
        _store_gemm_tile(acc, b_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, stride_ym, HAS_BIAS)
    else:
        # The last of a tile's splits to arrive (one atomic per program) adds the partial
        # sums in split order, whichever finished last: the same result every run.
        mask = m_mask[:, None] & n_mask[None, :]
        part = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()
        counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
        n_splits = tl.num_programs(2)
        if tl.atomic_add(counter, 1, sem="acq_rel") == n_splits - 1:
            tl.debug_barrier()
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in range(0, n_splits):
                acc += tl.load(part + split * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counter, 0)
            _store_gemm_tile(acc, b_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, stride_ym,
                             HAS_BIAS)  # fmt: skip


@triton.jit
def _store_gemm_tile(acc, b_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, stride_ym,
                     HAS_BIAS: tl.constexpr):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] (+ bias) in the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip


def quant_gemm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    bits: int, group_size: int, bias: torch.Tensor | None = None,
    config: QuantGemmConfig = QuantGemmConfig(), counters: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`quant_matmul_ref` as one Triton GEMM (any number of rows). With K splits, `counters`
    (`gemv_counters`, zeroed; the kernel leaves them zeroed) count each output tile's
    finished splits; fresh ones are made where none are given or they are too few."""
    block_k = gemm_block_k(config.block_k, group_size, x.shape[1])
    m, n, k = _check(x, qweight, bits, group_size, block_k, whole_groups=True)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles_m, tiles_n = triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n)
    # Splits of whole tiles; the last may be shorter, and fewer splits than asked may run.
    per_split = triton.cdiv(triton.cdiv(k, config.split_k), block_k) * block_k
    splits = triton.cdiv(k, per_split)
    if splits > 1:
        if counters is None or counters.numel() < tiles_m * tiles_n:
            counters = gemv_counters(tiles_m, n, x.device, config.block_n)
        part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    else:
        counters = part = y  # not read
    _quant_gemm_kernel[(tiles_m, tiles_n, splits)](
        x, qweight, scales, zeros, bias if bias is not None else y, y, part, counters, m, n, k,
        x.stride(0), y.stride(0), per_split, GROUP_SIZE=group_size, BITS=bits,
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=block_k, SPLIT=splits > 1,
        DOT_FP32=interpreter_enabled() and x.dtype == torch.bfloat16,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return y


@triton.jit
def _quant_gemv_at_once_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm,
    stride_ym, GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr,
    USE_PDL: tl.constexpr, GATED: tl.constexpr = False,
):  # fmt: skip
    """One row's products over TILES * BLOCK_K input rows per program, in half-precision
    pairs, every load issued before any arithmetic: a [TILES, BLOCK_W, BLOCK_N] word tile,
    each tile's scales and zeros (a tile lies inside one group), and x in the layout the
    dots consume (no K loop, so nothing waits on one tile before the next is asked for).
    The weights never depend on the previous kernel: under programmatic dependent launch
    they stream in while it finishes, and only x waits for it. GATED: x holds [gate, up]
    (2K wide) and the product is taken with silu(gate) * up, formed as `silu_and_mul`
    rounds it (each thread forms only the x of its own word rows)."""
    PACK: tl.constexpr = 32 // BITS
    BLOCK_W: tl.constexpr = BLOCK_K // PACK
    x_scale: tl.constexpr = INT4_X_SCALE if BITS == 4 else INT8_X_SCALE
    pid_n, pid_k, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_t = tl.arange(0, TILES)
    k_tile = pid_k * (TILES * BLOCK_K) + offs_t * BLOCK_K  # [TILES] first input row
    t_mask = k_tile < K  # the last split may hold fewer tiles
    word_row = k_tile[:, None] // PACK + tl.arange(0, BLOCK_W)[None, :]  # [TILES, BLOCK_W]
    w_mask = t_mask[:, None, None] & n_mask[None, None, :]
    words = tl.load(qw_ptr + word_row[:, :, None] * N + offs_n[None, None, :], mask=w_mask,
                    other=0)  # fmt: skip
    sz_offs = (k_tile // GROUP_SIZE)[:, None] * N + offs_n[None, :]
    sz_mask = t_mask[:, None] & n_mask[None, :]
    s = tl.load(s_ptr + sz_offs, mask=sz_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + sz_offs, mask=sz_mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    # Rows past K read x as 0 (their words are 0 too): their products vanish.
    xk = x_ptr + row * stride_xm + word_row * PACK
    if GATED:
        xa, xb, xc, xd = int_x_pairs(xk, BITS, word_row * PACK < K, K)
    else:
        xa, xb, xc, xd = int_x_pairs(xk, BITS, word_row * PACK < K)
    zb, zh = zero_pairs(z, BITS)
    if BITS == 4:
        part = int4_word_dot(words, xa[:, :, None], xb[:, :, None], xc[:, :, None],
                             xd[:, :, None], zb[:, None, :], zh[:, None, :],
                             z[:, None, :])  # fmt: skip
    else:
        part = int8_word_dot(words, xa[:, :, None], xb[:, :, None], zb[:, None, :],
                             z[:, None, :])  # fmt: skip
    y = tl.sum(tl.sum(part, axis=1) * (s * x_scale), axis=0)
    finish_gemv_row(y, b_ptr, y_ptr, part_ptr, count_ptr, row, pid_n, pid_k, M, N,
                    stride_ym, offs_n, n_mask, HAS_BIAS, SPLIT_K)  # fmt: skip


@triton.jit
def _dequantize_kernel(
    qw_ptr, s_ptr, z_ptr, w_ptr, N, GROUP_SIZE: tl.constexpr, BITS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    PACK: tl.constexpr = 32 // BITS
    BLOCK_W: tl.constexpr = BLOCK_K // PACK
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    n_mask = offs_n < N
    words = tl.load(qw_ptr + (k0 // PACK + offs_w)[:, None] * N + offs_n[None, :],
                    mask=n_mask[None, :], other=0)  # fmt: skip
    g = k0 // GROUP_SIZE
    s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    for i in tl.static_range(PACK):
        field = ((words >> (i * BITS)) & ((1 << BITS) - 1)) | _MAGIC_BITS
        w = (field.to(tl.float32, bitcast=True) - (z + _MAGIC)[None, :]) * s[None, :]
        # Row k0 + w * PACK + i of W^T: each row's store is contiguous along N.
        tl.store(w_ptr + (k0 + offs_w * PACK + i)[:, None] * N + offs_n[None, :],
                 w.to(w_ptr.dtype.element_ty), mask=n_mask[None, :])  # fmt: skip


def dequantize_weight_triton(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
    group_size: int, dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """`dequantize_weight` in one Triton pass (W^T [K, N], rounded as the reference rounds:
    (q - zero) * scale in fp32, then to `dtype`), for the library's matmul to read."""
    pack = 32 // bits
    k, n = qweight.shape[0] * pack, qweight.shape[1]
    block_k = math.gcd(group_size, 64)
    if block_k < pack or block_k & (block_k - 1):
        raise ValueError(f"group size {group_size} needs a power-of-two divisor of at least "
                         f"{pack} up to 64")  # fmt: skip
    w_t = torch.empty((k, n), dtype=dtype or scales.dtype, device=qweight.device)
    grid = (k // block_k, triton.cdiv(n, 128))
    _dequantize_kernel[grid](qweight, scales, zeros, w_t, n, GROUP_SIZE=group_size, BITS=bits,
                             BLOCK_K=block_k, BLOCK_N=128, num_warps=4)  # fmt: skip
    return w_t


def quant_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    bits: int, group_size: int, bias: torch.Tensor | None = None,
    config: QuantAtOnceGemvConfig = QuantAtOnceGemvConfig(32, 128, tiles=2, num_warps=1),
    counters: torch.Tensor | None = None, *, gated: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`quant_matmul_ref` for a few rows of 16-bit activations: each program reads one
    output block's weights once per row and K split (later rows find them in L2), all of
    its tiles at once, dequantization fused; with K splits, the last split of a block adds
    the others' fp32 partial sums. `config`'s tiles narrow to the group where it is
    shorter (default: the blocking that won one-row int4 on the H200). `counters`: from
    `gemv_counters` (default: fresh ones). gated: x is [M, 2K] holding [gate, up] and the
    product is taken with silu(gate) * up."""
    block_k = min(config.block_k, group_size)
    m, n, k = _check(x, qweight, bits, group_size, block_k, gated)
    check_pair_activation(x)
    splits = triton.cdiv(k, config.tiles * block_k)
    split = triton.next_power_of_2(splits)
    blocks = triton.cdiv(n, config.block_n)
    if counters is None:
        counters = gemv_counters(m, n, x.device)
    check_gemv_counters(counters, m, blocks)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((splits, m, n) if split > 1 else (1,), dtype=torch.float32,
                       device=x.device)  # fmt: skip
    pdl = use_pdl(x)
    _quant_gemv_at_once_kernel[(blocks, splits, m)](
        x, qweight, scales, zeros, bias if bias is not None else y, y, part, counters, m, n, k,
        x.stride(0), y.stride(0), GROUP_SIZE=group_size, BITS=bits, HAS_BIAS=bias is not None,
        SPLIT_K=split, BLOCK_N=config.block_n, BLOCK_K=block_k, TILES=config.tiles,
        USE_PDL=pdl, GATED=gated, num_warps=config.num_warps, num_stages=1, **pdl_kwargs(pdl),
    )  # fmt: skip
    return y
