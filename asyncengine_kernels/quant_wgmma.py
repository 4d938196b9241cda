"""int4 and int8 weight-only matmul on Hopper's tensor cores: the packed codes become wgmma's
register operand (Gluon), for decode batches of up to 256 rows (128 a launch).

Marlin's idea on sm_90: the weights are repacked once, at load, so that what a thread loads
is already its share of the MMA's left operand; no shuffles and no shared-memory round trip
for the weights, which are the bytes that matter at decode batch sizes.

Layout (`pack_quant_wgmma`): the product is formed transposed, y^T [N, M] = W [N, K] x^T, one
warpgroup per 64 output features. Thread 32 w + 4 g + q (warp w, lane group g, lane in group
q) owns, at each 16-deep wgmma step j, the A fragment values at rows 16 w + 8 hr + g and
columns 16 j + 8 hc + 2 q + e (hr, hc, e in {0, 1}): wgmma's register-operand layout, four
32-bit registers r = hr + 2 hc of two values e each. A chunk of 64 input features is four
steps; a loop iteration is two chunks.
- int4: the thread's four words of a chunk (one per j) are one 16-byte load, the 128 threads'
  contiguous (2 KB). Nibble 4 e + r of a word holds register r's value e, so
  `(word >> 4 r) & 0x000f000f` puts both values in place, and OR'ed into 128.0's bf16 bits
  (`lop3`) they read as 128 + code: one shift and one `lop3` per two values.
- int8: eight words a chunk, two 16-byte loads (steps 0-1 and 2-3, each 2 KB contiguous over
  the threads). Word (j, hr) holds registers (hr, hc = 0) in bytes 0 and 2 and (hr, hc = 1)
  in bytes 1 and 3 (byte 2 e + hc). bf16 has 8 significant bits, so no single magic number
  takes a byte: the low seven bits OR'ed into 128.0 read 128 + low, the top bit XOR'ed
  into 256.0's bits reads 256 (clear) or 128 (set), and their difference is code - 128,
  exactly. Two `lop3` and one `sub` per register, both registers of a word from one shift.
- fp16 activations: fp16 has ten explicit mantissa bits, so 1024.0's bits take a nibble or a
  whole byte alike: one `lop3` per register reads 1024 + code, in int8 too.

The codes then lose the zero point with a 16-bit `sub` (exact): bf16 int4 (128 + code) -
(128 + zero); bf16 int8 (code - 128) - (zero - 128), skipped when every zero point is 128;
fp16 (1024 + code) - (1024 + zero), or - 1152 for int8 without zero points.
Groups of 64 input features are one chunk each: the two chunks of an iteration take their
own zero points and scales. Groups of 32 are half a chunk: steps 0-1 and 2-3 of a chunk (the
thread's words j < 2 and j >= 2; in int8 its two 16-byte loads) take two groups' values, so
the scale goes on the fragment there.
The scale is applied where it is cheapest:
- `SCALE_ON_ACC` (few rows): the integers (code - zero) enter the MMA exactly, each group's
  products accumulate in a float32 tile of their own, and the group's per-feature scale
  multiplies that tile once: a few float32 operations per group instead of one `mul` per
  two weight values. It is more exact than dequantizing (no rounding of the weights).
- otherwise (more rows, where the per-group float32 work grows with them): a 16-bit `mul.rn`
  on the fragment, rounding as `asyncengine_kernels.quant_linear.dequantize_weight` does.

Up to 16 rows the activation slice of a program's K range sits in shared memory for the
whole loop (the wgmma's second operand), loaded once; from 17 rows it streams through a ring
of 64-feature chunks, three in flight (the whole slice can still be asked for up to 64). The
weight words of the next iterations are loaded while the current one is multiplied; above
64 rows the wgmma can also run asynchronously, each chunk's next operand formed while its
wgmma runs (`QuantWgmmaConfig.async_mma`). K is split across programs so that the grid fills the
GPU at one row; the last split of a tile to arrive adds the others' float32 partial sums
(`asyncengine_kernels.gemv_split_k`'s counters), so one launch does it all.

Contract: `quant_matmul_ref`'s, for bf16 or fp16 activations (the scales in the same type),
4- or 8-bit codes, N a multiple of 64, K a multiple of 128, and groups of 32 or 64 input
features, of a multiple of 128, or one per row.
`available()` says whether this Triton build has Gluon's Hopper module; `supported()`
whether a launch qualifies.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from asyncengine_kernels._triton_utils import pdl_kwargs, use_pdl
from asyncengine_kernels.gemv_split_k import check_gemv_counters
from asyncengine_kernels.quant_linear import unpack_int_weight

try:  # Gluon ships with Triton 3.5+; CPU-only installs without it fall back.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    _GLUON = True
except Exception:
    _GLUON = False

__all__ = [
    "BITS",
    "QuantWgmmaConfig",
    "available",
    "max_rows",
    "pack_quant_wgmma",
    "quant_wgmma_config",
    "quant_wgmma_matmul",
    "reads_zeros",
    "serves_weight",
    "supported",
    "unpack_quant_wgmma",
]

BLOCK_N = 64  # output features per program: one warpgroup's wgmma M
CHUNK_K = 64  # input features of one packed chunk: four 16-deep wgmma steps
HALF_CHUNK_K = 32  # the smallest group served: half a chunk, whose scale goes on the weights
BITS = (4, 8)  # the code widths served
# The activation types served: the 16-bit operand types of wgmma with a float32 accumulator.
# fp16 matters as much as bf16: most GPTQ and AWQ checkpoints declare float16, which is what
# the engine then runs in.
DTYPES = (torch.bfloat16, torch.float16)
# Input features per loop iteration: two chunks, so that the loop's own instructions (the
# wgmma descriptors, the addresses, the branch) weigh on 64 weight values a thread, not 32.
ITER_K = 2 * CHUNK_K
MAX_ROWS = 256
# The most rows one launch takes: more run as launches of this many rows each. A 256-row
# launch (a 64 x 256 float32 accumulator, 254 registers a thread) took 400 us per 7B layer
# of four matmuls; two 128-row launches took 290 (bench_kernels --only int4, H200,
# 2026-12-04).
LAUNCH_MAX_ROWS = 128
# Up to 64 rows a program copies its whole activation slice into shared memory at once. It
# may take `X_SLICE_BYTES`: 32 rows of 1024 features (the 32-row optimum below), two programs
# to a multiprocessor at 64 rows.
SLICE_MAX_ROWS = 64
X_SLICE_BYTES = 64 * 1024
# Above 64 rows the slice streams through a ring of `X_RING` chunks (64 features each, 16 KB
# at 128 rows), `X_RING - 1` of them in flight, so a split may span all of K: at 128 rows
# the partial sums of short splits would cost as much traffic as the weights. K is split
# only to give each of the `RING_PROGRAMS` multiprocessors about `RING_PROGRAMS_PER_MP`
# programs: o and down have 64 tiles, split four ways. Three splits (192 programs) left 72
# of the 132 multiprocessors one program, the tensor pipe busy 27 % of the time (Nsight Compute,
# H200, 2026-12-05); four ran down 4-10 % faster and o 1 % (bench_kernels --only int4
# and int8 --quant-rows 128 256, H100, 2026-12-05: down at 128 rows 38.8 against 43.1 us in
# int4, 43.3 against 45.2 in int8).
X_RING = 4
RING_PROGRAMS = 132
RING_PROGRAMS_PER_MP = 2
# Above 64 rows the wgmma is issued asynchronously (`QuantWgmmaConfig.async_mma`) wherever
# the scale goes on the weights, except where it costs a wave: it takes more registers (181
# against 166 in int4 at 128 rows: two programs a multiprocessor instead of three), so int4
# gate/up's 344 tiles, one wave synchronous, took two (69.3 against 48.6 us at 128 rows).
# Elsewhere at 128 rows it ran 4-10 % faster (H100, 2026-12-05, the same bench: int4 q/k/v
# 35.5 against 38.1, o 21.9 against 23.2, down 37.3 against 38.8 at four splits; int8 q/k/v
# 37.5 against 40.6, gate/up 66.7 against 74.3, down 40.9 against 43.3; int8's synchronous
# launch already fits two programs a multiprocessor). At 17-64 rows it won nothing by more
# than the noise (int4 q/k/v at 64 rows 27.9 against 26.2), so there it is not used.
ASYNC_MIN_ROWS = SLICE_MAX_ROWS + 1
# The ring also serves 17-64 rows, where it beat the whole-slice launch on every 7B layer.
# int4 (bench_kernels --only int4 --quant-rows 32 64, H200, 2026-12-04; us per layer of
# four matmuls, the best split of each form): 81.4 against 102.0 at 32 rows, 104.6 against
# 206.7 at 64, where the best Triton GEMM took 189.8. int8 (--only int8, H100, 2026-12-05):
# 108.0 against 150.8 at 32 rows, 120.7 against 282.2 at 64. There the best splits gave the
# grid about three programs a multiprocessor (q/k/v 2 splits, gate/up 1, o and down 6:
# `RING_FEW_ROWS_PROGRAMS`). The scale goes on the accumulator up to 32 rows in int4
# (`RING_ACC_MAX_ROWS`); in int8 on the weights, which was faster on every layer at 32 rows
# (q/k/v 27.5 against 31.0 us, gate/up 40.2 against 47.8).
RING_MIN_ROWS = 17
RING_ACC_MAX_ROWS = {4: 32, 8: 0}
RING_FEW_ROWS_PROGRAMS = 3 * RING_PROGRAMS
# int8 launches the ring 128 rows at a time above 64 rows, as int4 does. A single 256-row
# int8 launch needed more than 255 registers a thread (the 64 x 256 float32 accumulator and
# three iterations of 16 words) and spilled; the 128-row launch builds on sm_90 to 193-220
# registers with the scale on the weights, without spills (`scripts/compile_kernels.py
# --asm-stats`).
# Programs to aim for: 16 per multiprocessor of an H200 up to 8 rows, fewer as the rows
# grow (each split's float32 partial sums grow with them), each split at least
# `MIN_SPLIT_ITERS` iterations long (4 from 16 rows). On the 7B layers (bench_kernels
# --only int4, 2026-12-03) the fastest splits were: at 1-8 rows 3 iterations for q/k/v and
# down, 5 for gate/up, 2-4 for o, within 8 % of each other from half to twice those (8
# programs per multiprocessor cost q/k/v 10 %); at 16 rows 7 (q/k/v), 4 (o), 8 (gate/up),
# 12 (down); at 32 and 64 rows as long as the activation slice allows (8 and 4).
TARGET_PROGRAMS = 132 * 16
MIN_SPLIT_ITERS = 2


@dataclass(frozen=True)
class QuantWgmmaConfig:
    """A launch: `rows` (wgmma N, the activation rows padded up), `k_split` input features
    per program, where the scale is applied (`scale_on_acc`), and the activation ring's
    chunks (`x_ring`; 0: the whole slice at once)."""

    rows: int
    k_split: int
    scale_on_acc: bool
    x_ring: int = 0
    # Each chunk's wgmma issued asynchronously, the next operand formed while it runs (with
    # the scale on the weights only).
    async_mma: bool = False

    def __str__(self) -> str:
        where = "acc" if self.scale_on_acc else "weights"
        ring = f", x_ring={self.x_ring}" if self.x_ring else ""
        overlap = ", async" if self.async_mma else ""
        return (f"quant_wgmma(rows={self.rows}, k_split={self.k_split}, scale_on={where}"
                f"{ring}{overlap})")  # fmt: skip


def max_rows(bits: int) -> int:
    """The most activation rows `quant_wgmma_matmul` serves for `bits`-bit codes (the same
    for both widths since int8 streams through the ring from 65 rows)."""
    _check_bits(bits)
    return MAX_ROWS


def launch_max_rows(bits: int) -> int:
    """The most activation rows one launch takes for `bits`-bit codes."""
    return min(LAUNCH_MAX_ROWS, max_rows(bits))


def available() -> bool:
    """Whether this Triton build has Gluon's Hopper module."""
    return _GLUON


def serves_weight(device: torch.device, dtype: torch.dtype, n: int, k: int, bits: int,
                  group_size: int) -> bool:  # fmt: skip
    """Whether `quant_wgmma_matmul` serves an [N, K] weight on `device` for activations of
    `dtype`: an sm_90 GPU, bf16 or fp16, 4- or 8-bit codes, N a multiple of 64, K of 128,
    and groups of 32 or 64 input features, of whole iterations (128) or one per row."""
    return (
        available()
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) == (9, 0)
        and dtype in DTYPES
        and bits in BITS
        and n % BLOCK_N == 0
        and _groups_fit(k, group_size)
    )


def supported(x: torch.Tensor, n: int, k: int, bits: int, group_size: int) -> bool:
    """Whether `quant_wgmma_matmul` serves x [M, K] against an [N, K] weight: the weight
    (`serves_weight`) and at most `max_rows(bits)` rows."""
    return (serves_weight(x.device, x.dtype, n, k, bits, group_size)
            and 0 < x.shape[0] <= max_rows(bits))  # fmt: skip


def _groups_fit(k: int, group_size: int) -> bool:
    """K in whole iterations, and groups that tile it: of half a chunk or one (32 or 64 input
    features), of whole iterations, or one group."""
    return (k % ITER_K == 0 and k % group_size == 0
            and (group_size in (HALF_CHUNK_K, CHUNK_K) or group_size % ITER_K == 0))  # fmt: skip


def quant_wgmma_config(m: int, n: int, k: int, group_size: int,
                       scale_on_acc: bool | None = None, *, bits: int = 4
                       ) -> QuantWgmmaConfig:  # fmt: skip
    """The launch for M = m rows of `bits`-bit codes: rows padded to a power of two from 8.
    From `RING_MIN_ROWS` (17) the activations stream through a ring (`ring_config`);
    below, K is split so that the grid reaches about `TARGET_PROGRAMS` programs (fewer past
    8 rows), each split whole groups (or whole iterations when a group spans several splits)
    and its activation slice within `X_SLICE_BYTES`. The scale on the accumulator up to 16
    rows (int4: 32 in the ring) unless told, and never for groups of 32. Above 64 rows the
    wgmma runs asynchronously where the scale is on the weights, unless an int4 grid needs
    more than two programs a multiprocessor."""
    rows = max(8, 1 << (m - 1).bit_length())
    if rows > LAUNCH_MAX_ROWS:
        raise ValueError(f"one quant_wgmma launch takes up to {LAUNCH_MAX_ROWS} rows, got {m}")
    _check_bits(bits)
    ring = rows >= RING_MIN_ROWS
    if scale_on_acc is None:
        # Groups of 32 split a chunk's wgmma steps between two scales: on the weights only.
        scale_on_acc = (rows <= (RING_ACC_MAX_ROWS[bits] if ring else 16)
                        and group_size >= CHUNK_K)  # fmt: skip
    elif scale_on_acc and group_size < CHUNK_K:
        raise ValueError(f"groups of {group_size} take the scale on the weights, not on the "
                         "accumulator")  # fmt: skip
    if ring:
        config = ring_config(rows, n, k, group_size, scale_on_acc)
        programs = n // BLOCK_N * math.ceil(k / config.k_split)
        # int4's synchronous launch fits three programs a multiprocessor, its asynchronous
        # one two: a grid of more than two a multiprocessor stays synchronous, in one wave.
        fits = bits == 8 or programs <= RING_PROGRAMS_PER_MP * RING_PROGRAMS
        overlap = rows >= ASYNC_MIN_ROWS and not scale_on_acc and fits
        return dataclasses.replace(config, async_mma=overlap)
    iters, unit = _split_iters(k, group_size)
    most = max(unit, (X_SLICE_BYTES // (rows * 2 * ITER_K)) // unit * unit)
    programs = TARGET_PROGRAMS if rows <= 8 else TARGET_PROGRAMS * 8 // rows
    want = max(1, programs // (n // BLOCK_N))
    least = MIN_SPLIT_ITERS if rows <= 8 else 2 * MIN_SPLIT_ITERS
    per_split = max(least, math.ceil(iters / want))
    per_split = max(unit, min(most, math.ceil(per_split / unit) * unit))
    return QuantWgmmaConfig(rows=rows, k_split=per_split * ITER_K, scale_on_acc=scale_on_acc)


def ring_config(rows: int, n: int, k: int, group_size: int,
                scale_on_acc: bool) -> QuantWgmmaConfig:  # fmt: skip
    """The ring form's launch for `rows` padded rows: the activations stream through
    `X_RING` chunks, each split whole groups (or whole iterations when a group spans
    several splits). K is split so that the grid reaches at most `RING_PROGRAMS_PER_MP`
    programs a multiprocessor above 64 rows, and about `RING_FEW_ROWS_PROGRAMS` programs up
    to 64 (the nearest whole number of splits)."""
    iters, unit = _split_iters(k, group_size)
    tiles = n // BLOCK_N
    if rows > SLICE_MAX_ROWS:
        want = max(1, RING_PROGRAMS_PER_MP * RING_PROGRAMS // tiles)
    else:
        want = max(1, round(RING_FEW_ROWS_PROGRAMS / tiles))
    per_split = max(unit, math.ceil(math.ceil(iters / want) / unit) * unit)
    return QuantWgmmaConfig(rows=rows, k_split=per_split * ITER_K, scale_on_acc=scale_on_acc,
                            x_ring=X_RING)  # fmt: skip


def _split_iters(k: int, group_size: int) -> tuple[int, int]:
    """K's loop iterations, and the iterations a split is made of: whole groups, or one
    iteration where a group spans all of K or is shorter than an iteration."""
    return k // ITER_K, max(1, group_size // ITER_K) if group_size < k else 1


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"quant_wgmma serves {BITS}-bit codes, got {bits}")


def pack_quant_wgmma(qweight: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """`asyncengine_kernels.quant_linear`'s int32 [K * bits / 32, N] -> this kernel's words,
    flattened (see the module docstring): int4 [N / 64, K / 64, 4 (w), 8 (g), 4 (q), 4 (j)],
    int8 [N / 64, K / 64, 2 (j // 2), 4 (w), 8 (g), 4 (q), 2 (j % 2), 2 (hr)]."""
    _check_bits(bits)
    codes = unpack_int_weight(qweight, bits).t().to(torch.int64)
    n, k = codes.shape
    if n % BLOCK_N or k % CHUNK_K:
        raise ValueError(f"quant_wgmma needs N and K multiples of 64, got N={n}, K={k}")
    if bits == 4:
        # [tile, w, hr, g, chunk, j, hc, q, e] -> [tile, chunk, w, g, q, j, e, hc, hr]: the
        # last three index the nibble, 4 e + 2 hc + hr.
        v = codes.view(n // BLOCK_N, 4, 2, 8, k // CHUNK_K, 4, 2, 4, 2)
        v = v.permute(0, 4, 1, 3, 7, 5, 8, 6, 2).reshape(-1, 8)
    else:
        # [tile, w, hr, g, chunk, jh, jl, hc, q, e] -> [tile, chunk, jh, w, g, q, jl, hr, e,
        # hc] (j = 2 jh + jl): the last two index the byte, 2 e + hc.
        v = codes.view(n // BLOCK_N, 4, 2, 8, k // CHUNK_K, 2, 2, 2, 4, 2)
        v = v.permute(0, 4, 5, 1, 3, 8, 6, 2, 9, 7).reshape(-1, 4)
    shifts = torch.arange(32 // bits, device=v.device, dtype=torch.int64) * bits
    words = (v << shifts).sum(dim=1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement int32
    return words.to(torch.int32).contiguous()


def unpack_quant_wgmma(words: torch.Tensor, n: int, k: int, bits: int = 4) -> torch.Tensor:
    """`pack_quant_wgmma`'s inverse, back to the codes [N, K] (int64): the tests' check."""
    _check_bits(bits)
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int64) * bits
    codes = (words.to(torch.int64).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    if bits == 4:
        v = codes.view(n // BLOCK_N, k // CHUNK_K, 4, 8, 4, 4, 2, 2, 2)  # ..., e, hc, hr
        return v.permute(0, 2, 8, 3, 1, 5, 7, 4, 6).reshape(n, k)
    v = codes.view(n // BLOCK_N, k // CHUNK_K, 2, 4, 8, 4, 2, 2, 2, 2)  # ..., hr, e, hc
    return v.permute(0, 3, 7, 4, 1, 2, 6, 9, 5, 8).reshape(n, k)


if _GLUON:
    # Renamed after Triton 3.6 (same arguments): the CTA barrier and the asynchronous copy.
    _sync_threads = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
    _copy_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _CHUNK_K = gl.constexpr(CHUNK_K)
    _ITER_K = gl.constexpr(ITER_K)

    # $8 a word; $9 / $10 the 128 + zero of its low / high row, twice as bf16x2. Register r
    # of the fragment is nibbles r and r + 4 (a, b, c, d); registers 0 and 2 are the low
    # row's. With the scale on the fragment, $11 / $12 are the rows' scales as bf16x2.
    _LESS_ZERO = """
    .reg .b32 a, b, c, d, t;
    lop3.b32 a, $8, 0x000f000f, 0x43004300, 0xea;
    shr.u32 t, $8, 4;
    lop3.b32 b, t, 0x000f000f, 0x43004300, 0xea;
    shr.u32 t, $8, 8;
    lop3.b32 c, t, 0x000f000f, 0x43004300, 0xea;
    shr.u32 t, $8, 12;
    lop3.b32 d, t, 0x000f000f, 0x43004300, 0xea;
    sub.bf16x2 a, a, $9;
    sub.bf16x2 b, b, $10;
    sub.bf16x2 c, c, $9;
    sub.bf16x2 d, d, $10;
    """
    _TIMES_SCALE = """
    mul.rn.bf16x2 a, a, $11;
    mul.rn.bf16x2 b, b, $12;
    mul.rn.bf16x2 c, c, $11;
    mul.rn.bf16x2 d, d, $12;
    """
    _OUT = """
    mov.b32 {$0, $1}, a;
    mov.b32 {$2, $3}, b;
    mov.b32 {$4, $5}, c;
    mov.b32 {$6, $7}, d;
    """
    _CODES_LESS_ZERO = gl.constexpr("{" + _LESS_ZERO + _OUT + "}")
    _CODES_SCALED = gl.constexpr("{" + _LESS_ZERO + _TIMES_SCALE + _OUT + "}")

    def _as_f16(asm: str) -> str:
        """The bf16 sequence for fp16 activations: fp16 has ten explicit mantissa bits, so a
        nibble OR'ed into 1024.0's bits (0x6400) reads 1024 + code, as 128.0's do in bf16."""
        return (asm.replace("0x43004300", "0x64006400").replace("sub.bf16x2", "sub.f16x2")
                .replace("mul.rn.bf16x2", "mul.rn.f16x2"))  # fmt: skip

    _CODES_LESS_ZERO_F16 = gl.constexpr("{" + _as_f16(_LESS_ZERO) + _OUT + "}")
    _CODES_SCALED_F16 = gl.constexpr("{" + _as_f16(_LESS_ZERO + _TIMES_SCALE) + _OUT + "}")

    # int8: $4 a word, registers (hr, hc = 0) in bytes 0 and 2 (a) and (hr, hc = 1) in bytes
    # 1 and 3 (c); $5 the word's row's zero point less 128, $6 its scale, as bf16x2.
    # 0xea: (word & mask) | bits; 0x6a: (word & mask) ^ bits.
    _BYTES = """
    .reg .b32 a, b, c, d, t;
    lop3.b32 a, $4, 0x007f007f, 0x43004300, 0xea;
    lop3.b32 b, $4, 0x00800080, 0x43804380, 0x6a;
    sub.bf16x2 a, a, b;
    shr.u32 t, $4, 8;
    lop3.b32 c, t, 0x007f007f, 0x43004300, 0xea;
    lop3.b32 d, t, 0x00800080, 0x43804380, 0x6a;
    sub.bf16x2 c, c, d;
    """
    _BYTES_LESS_ZERO = """
    sub.bf16x2 a, a, $5;
    sub.bf16x2 c, c, $5;
    """
    _BYTES_TIMES_SCALE = """
    mul.rn.bf16x2 a, a, $6;
    mul.rn.bf16x2 c, c, $6;
    """
    _BYTES_OUT = """
    mov.b32 {$0, $1}, a;
    mov.b32 {$2, $3}, c;
    """
    _INT8_CENTRED = gl.constexpr("{" + _BYTES + _BYTES_OUT + "}")
    _INT8_LESS_ZERO = gl.constexpr("{" + _BYTES + _BYTES_LESS_ZERO + _BYTES_OUT + "}")
    _INT8_SCALED = gl.constexpr("{" + _BYTES + _BYTES_TIMES_SCALE + _BYTES_OUT + "}")
    _INT8_LESS_ZERO_SCALED = gl.constexpr(
        "{" + _BYTES + _BYTES_LESS_ZERO + _BYTES_TIMES_SCALE + _BYTES_OUT + "}"
    )

    # fp16 holds 1024 + a whole byte (ten explicit mantissa bits): one `lop3` per register
    # reads 1024 + code. Zero points then come as 1024 + zero, taken away in one `sub`;
    # without them 1152.0 (0x6480) is, which leaves code - 128 as in bf16.
    _BYTES_F16 = """
    .reg .b32 a, c, t, k;
    lop3.b32 a, $4, 0x00ff00ff, 0x64006400, 0xea;
    shr.u32 t, $4, 8;
    lop3.b32 c, t, 0x00ff00ff, 0x64006400, 0xea;
    """
    _BYTES_F16_CENTRE = """
    mov.b32 k, 0x64806480;
    sub.f16x2 a, a, k;
    sub.f16x2 c, c, k;
    """
    _INT8_CENTRED_F16 = gl.constexpr("{" + _BYTES_F16 + _BYTES_F16_CENTRE + _BYTES_OUT + "}")
    _INT8_LESS_ZERO_F16 = gl.constexpr(
        "{" + _BYTES_F16 + _as_f16(_BYTES_LESS_ZERO) + _BYTES_OUT + "}"
    )
    _INT8_SCALED_F16 = gl.constexpr(
        "{" + _BYTES_F16 + _BYTES_F16_CENTRE + _as_f16(_BYTES_TIMES_SCALE) + _BYTES_OUT + "}"
    )
    _INT8_LESS_ZERO_SCALED_F16 = gl.constexpr(
        "{" + _BYTES_F16 + _as_f16(_BYTES_LESS_ZERO + _BYTES_TIMES_SCALE) + _BYTES_OUT + "}"
    )
    # The asm of each form: int4's at 2 fp16 + scaled (its zero point is always taken away,
    # the built-in one if none is read), int8's at 4 fp16 + 2 zero points + scaled.
    _INT4_ASM = gl.constexpr((
        _CODES_LESS_ZERO.value, _CODES_SCALED.value, _CODES_LESS_ZERO_F16.value,
        _CODES_SCALED_F16.value,
    ))  # fmt: skip
    _INT8_ASM = gl.constexpr((
        _INT8_CENTRED.value, _INT8_SCALED.value, _INT8_LESS_ZERO.value,
        _INT8_LESS_ZERO_SCALED.value, _INT8_CENTRED_F16.value, _INT8_SCALED_F16.value,
        _INT8_LESS_ZERO_F16.value, _INT8_LESS_ZERO_SCALED_F16.value,
    ))  # fmt: skip

    @gluon.jit
    def _twice(bits16):
        """A 16-bit value's bits in both halves of an int32 (a bf16x2 operand)."""
        b = bits16.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return (b << 16) | b

    @gluon.jit
    def _row_pairs(ptr, group, N, row_lo, spread, OFFSET: gl.constexpr, BITS: gl.constexpr,
                   half: gl.constexpr):  # fmt: skip
        """The 16-bit pairs (value twice, in the activations' type `half`) of a group's
        per-feature value plus OFFSET for the words' low and high rows (hr = 0, 1), spread
        over the words' shape."""
        lo = gl.load(ptr + group * N + row_lo)
        hi = gl.load(ptr + group * N + row_lo + 8)
        if OFFSET != 0:
            lo = (lo.to(gl.float32) + OFFSET).to(half)
            hi = (hi.to(gl.float32) + OFFSET).to(half)
        if BITS == 4:
            lo_pairs = _twice(lo)[:, None, None] + spread
            hi_pairs = _twice(hi)[:, None, None] + spread
        else:
            lo_pairs = _twice(lo)[None, :, None, None] + spread
            hi_pairs = _twice(hi)[None, :, None, None] + spread
        return lo_pairs, hi_pairs

    @gluon.jit
    def _chunk_pairs(ptr, group, N, row_lo, spread, upper, OFFSET: gl.constexpr,
                     BITS: gl.constexpr, half: gl.constexpr, HALVES: gl.constexpr):  # fmt: skip
        """`_row_pairs` for a chunk whose first group is `group`; HALVES (groups of 32): the
        words of the chunk's upper 32 input features (`upper`) take group + 1's instead."""
        lo, hi = _row_pairs(ptr, group, N, row_lo, spread, OFFSET, BITS, half)
        if HALVES:
            lo1, hi1 = _row_pairs(ptr, group + 1, N, row_lo, spread, OFFSET, BITS, half)
            lo = gl.where(upper, lo1, lo)
            hi = gl.where(upper, hi1, hi)
        return lo, hi

    @gluon.jit
    def _step_pairs(ptr, step, N, row_lo, spread, upper, OFFSET: gl.constexpr,
                    BITS: gl.constexpr, half: gl.constexpr, GROUP_ITERS: gl.constexpr,
                    GROUP_64: gl.constexpr, GROUP_32: gl.constexpr):  # fmt: skip
        """`_chunk_pairs` for loop iteration `step`'s two chunks: (lo, hi) of the first and of
        the second. GROUP_64: chunk 2 step + h is group 2 step + h; GROUP_32: its halves are
        groups 4 step + 2 h and + 1; else one group a whole iteration."""
        if GROUP_32:
            group = 4 * step
            second = group + 2
        elif GROUP_64:
            group = 2 * step
            second = group + 1
        else:
            group = step // GROUP_ITERS
            second = group
        lo, hi = _chunk_pairs(ptr, group, N, row_lo, spread, upper, OFFSET, BITS, half,
                              GROUP_32)  # fmt: skip
        if GROUP_64 or GROUP_32:
            lo1, hi1 = _chunk_pairs(ptr, second, N, row_lo, spread, upper, OFFSET, BITS, half,
                                    GROUP_32)  # fmt: skip
        else:
            lo1 = lo
            hi1 = hi
        return lo, hi, lo1, hi1

    @gluon.jit
    def _lanes4():
        """int4: each thread's word offsets within a chunk [32 row pairs (w, g), 4 (q), 4 (j)]
        (lanes over (g, q), warps over w, one 16-byte load) and its row pairs."""
        p_l: gl.constexpr = gl.BlockedLayout([1, 1, 4], [8, 4, 1], [4, 1, 1], [2, 1, 0])
        n_p = gl.arange(0, 32, layout=gl.SliceLayout(1, gl.SliceLayout(2, p_l)))
        q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, p_l)))
        j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, p_l)))
        return (n_p[:, None, None] * 4 + q[None, :, None]) * 4 + j[None, None, :], n_p

    @gluon.jit
    def _lanes8():
        """int8: each thread's word offsets within a chunk [2 (j // 2), 32 row pairs (w, g),
        4 (q), 4 (j % 2, hr)] (two 16-byte loads, 2 KB apart) and its row pairs."""
        p_l: gl.constexpr = gl.BlockedLayout([2, 1, 1, 4], [1, 8, 4, 1], [1, 4, 1, 1],
                                             [3, 2, 1, 0])  # fmt: skip
        jh = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, p_l))))
        n_p = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, p_l))))
        q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, p_l))))
        u = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, p_l))))
        lanes = (jh[:, None, None, None] * 512 + (n_p[None, :, None, None] * 4
                 + q[None, None, :, None]) * 4 + u[None, None, None, :])  # fmt: skip
        return lanes, n_p

    @gluon.jit
    def _operand(words, z_lo, z_hi, s_lo, s_hi, a_l: gl.constexpr, SCALED: gl.constexpr,
                 half: gl.constexpr):  # fmt: skip
        """One chunk's words [32 row pairs, 4 (q), 4 (j)] -> wgmma's register operand, the
        [64 rows, 64 columns] tile in `half`, bf16 or fp16 (code - zero, times the scale if
        SCALED)."""
        asm: gl.constexpr = _INT4_ASM[2 * (half == gl.float16) + SCALED]
        if SCALED:
            v = gl.inline_asm_elementwise(
                asm, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r",
                [words, z_lo, z_hi, s_lo, s_hi], dtype=[half.value] * 8, is_pure=True, pack=1,
            )  # fmt: skip
        else:
            v = gl.inline_asm_elementwise(
                asm, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
                [words, z_lo, z_hi], dtype=[half.value] * 8, is_pure=True, pack=1,
            )  # fmt: skip
        # v[e + 2 hr + 4 hc] -> [row pairs, q, j, hr, hc, e] -> [64 rows, 64 columns]. A
        # join appends its axis last, and that axis is the registers' fastest: joining over
        # e last pairs each register's two values as wgmma reads them (no byte permutes).
        e0 = gl.join(gl.join(v[0], v[2]), gl.join(v[4], v[6]))
        e1 = gl.join(gl.join(v[1], v[3]), gl.join(v[5], v[7]))
        t = gl.reshape(gl.join(e0, e1), [4, 8, 4, 4, 2, 2, 2])  # [w, g, q, j, hr, hc, e]
        t = gl.permute(t, [0, 4, 1, 3, 5, 2, 6])  # [w, hr, g, j, hc, q, e]
        return gl.convert_layout(gl.reshape(t, [64, 64]), a_l, assert_trivial=True)

    @gluon.jit
    def _operand8(words, z_lo, z_hi, s_lo, s_hi, a_l: gl.constexpr, HAS_ZERO: gl.constexpr,
                  SCALED: gl.constexpr, half: gl.constexpr):  # fmt: skip
        """int8: one chunk's words [2 (j // 2), 32 row pairs, 4 (q), 4 (j % 2, hr)] ->
        wgmma's register operand, as `_operand`."""
        # A word's two registers share its row (hr, the last axis's low bit): its pairs.
        hr = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(
            2, words.type.layout))))[None, None, None, :] % 2  # fmt: skip
        z = gl.where(hr == 1, z_hi, z_lo)
        s = gl.where(hr == 1, s_hi, s_lo)
        asm: gl.constexpr = _INT8_ASM[4 * (half == gl.float16) + 2 * HAS_ZERO + SCALED]
        v = gl.inline_asm_elementwise(asm, "=h,=h,=h,=h,r,r,r", [words, z, s],
                                      dtype=[half.value] * 4, is_pure=True, pack=1)  # fmt: skip
        # v[e + 2 hc] -> [jh, row pairs, q, jl, hr, hc, e] -> [64 rows, 64 columns]: the
        # registers' order (e, hc, hr, jl, jh fastest first) is int4's (e, hc, hr, j).
        t = gl.join(gl.join(v[0], v[2]), gl.join(v[1], v[3]))
        t = gl.reshape(t, [2, 4, 8, 4, 2, 2, 2, 2])  # [jh, w, g, q, jl, hr, hc, e]
        t = gl.permute(t, [1, 5, 2, 0, 4, 6, 3, 7])  # [w, hr, g, jh, jl, hc, q, e]
        return gl.convert_layout(gl.reshape(t, [64, 64]), a_l, assert_trivial=True)

    @gluon.jit
    def _chunk_operand(words, z_lo, z_hi, s_lo, s_hi, a_l: gl.constexpr, BITS: gl.constexpr,
                       HAS_ZERO: gl.constexpr, SCALED: gl.constexpr,
                       half: gl.constexpr):  # fmt: skip
        """One chunk's words -> wgmma's register operand, int4 or int8 (`_operand`,
        `_operand8`)."""
        if BITS == 4:
            a = _operand(words, z_lo, z_hi, s_lo, s_hi, a_l, SCALED, half)
        else:
            a = _operand8(words, z_lo, z_hi, s_lo, s_hi, a_l, HAS_ZERO, SCALED, half)
        return a

    @gluon.jit
    def _quant_wgmma_kernel(
        w_ptr, s_ptr, z_ptr, x_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K,
        stride_xm, stride_ym, BITS: gl.constexpr, ROWS: gl.constexpr, K_SPLIT: gl.constexpr,
        GROUP_ITERS: gl.constexpr, HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr,
        SCALE_ON_ACC: gl.constexpr, SPLIT_K: gl.constexpr, USE_PDL: gl.constexpr = False,
        X_RING: gl.constexpr = 0, F16: gl.constexpr = False, GROUP_64: gl.constexpr = False,
        GROUP_32: gl.constexpr = False, ASYNC_MMA: gl.constexpr = False,
    ):  # fmt: skip
        """y [M, N] for output features 64 pid_n.. over K split pid_k (see the module). F16:
        fp16 activations (else bf16); GROUP_64: groups of 64 input features, one a chunk (two
        an iteration; GROUP_ITERS is then 1); GROUP_32: groups of 32, two a chunk (the scale
        on the weights only), else GROUP_ITERS iterations a group."""
        DT: gl.constexpr = gl.float16 if F16 else gl.bfloat16
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16]
        )
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        # x's chunks [ROWS, 64] in 16-byte pieces along K (contiguous in memory and in the
        # K-major shared tile alike, so each is one asynchronous copy).
        x_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        b_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, _CHUNK_K], DT)
        ITERS: gl.constexpr = K_SPLIT // _ITER_K
        CHUNK_WORDS: gl.constexpr = 128 * BITS  # 64 x 64 codes

        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        first = pid_k * ITERS
        n_iters = gl.minimum(ITERS, K // _ITER_K - first)

        # z_lo: int4's built-in zero point (128 + 8 in bf16, 1024 + 8 in fp16, twice); int8
        # applies none unless read.
        if BITS == 4:
            lane_words, n_p = _lanes4()
            sym: gl.constexpr = 0x64086408 if F16 else 0x43084308
            z_lo = gl.full(lane_words.shape, sym, gl.int32, lane_words.type.layout)
        else:
            lane_words, n_p = _lanes8()
            z_lo = gl.full(lane_words.shape, 0, gl.int32, lane_words.type.layout)
        spread = gl.zeros_like(lane_words)
        # GROUP_32: the words of each chunk's upper 32 input features (int4: steps j = 2, 3;
        # int8: the second 16-byte load).
        upper = (lane_words % 4 >= 2) if BITS == 4 else (lane_words >= 512)
        w_tile = w_ptr + (pid_n * (K // _CHUNK_K)) * CHUNK_WORDS + lane_words
        row_lo = pid_n * 64 + (n_p // 8) * 16 + n_p % 8  # the words' rows: row_lo, row_lo + 8
        z_hi = z_lo
        s_lo = z_lo
        s_hi = z_lo
        # The second chunk's (groups of 64 or 32: its own groups'; else the same).
        z_lo1 = z_lo
        z_hi1 = z_lo
        s_lo1 = z_lo
        s_hi1 = z_lo
        offs_n = pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))

        acc = gl.zeros([64, ROWS], gl.float32, acc_l)
        acc_g = gl.zeros([64, ROWS], gl.float32, acc_l)
        # Weight words two iterations ahead (8 KB a program in flight for int4, 16 KB for
        # int8); past the split's end the last iteration's words are reloaded, harmlessly.
        # No kernel writes the weights, so the first ones are requested before waiting for
        # the previous kernel (PDL).
        last = 2 * (first + n_iters - 1)
        words0 = gl.load(w_tile + (2 * first) * CHUNK_WORDS)
        words1 = gl.load(w_tile + (2 * first + 1) * CHUNK_WORDS)
        next_at = gl.minimum(2 * first + 2, last)
        next0 = gl.load(w_tile + next_at * CHUNK_WORDS)
        next1 = gl.load(w_tile + (next_at + 1) * CHUNK_WORDS)
        if USE_PDL:
            # x, the partial sums and the counters may still be the previous kernel's.
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)  # fmt: skip
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                      dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
        offs_xr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, x_l))
        offs_xk = gl.arange(0, _CHUNK_K, layout=gl.SliceLayout(0, x_l))
        x_at = x_ptr + offs_xr[:, None] * stride_xm + (first * _ITER_K + offs_xk)[None, :]
        x_mask = (offs_xr < M)[:, None]
        n_chunks = 2 * n_iters
        if X_RING == 0:
            # The activation slice as 64-deep wgmma operands, copied once, asynchronously:
            # every chunk's copy is in flight at once (the weights' first loads already are).
            xs = gl.allocate_shared_memory(DT, [2 * ITERS, ROWS, _CHUNK_K], b_l)
            for i in range(n_chunks):
                _copy_async(xs.index(i), x_at + i * _CHUNK_K, x_mask)
            async_copy.commit_group()
            async_copy.wait_group(0)
            fence_async_shared()
            _sync_threads()
        else:
            # A ring of X_RING chunks: the first X_RING - 1 requested now, one group each.
            xs = gl.allocate_shared_memory(DT, [X_RING, ROWS, _CHUNK_K], b_l)
            for c in gl.static_range(X_RING - 1):
                if c < n_chunks:
                    _copy_async(xs.index(c), x_at + c * _CHUNK_K, x_mask)
                async_copy.commit_group()
        # What the codes read as before the zero point goes (see the module): bf16 int4
        # 128 + code, int8 code - 128; fp16 1024 + code for both.
        z_off: gl.constexpr = 1024.0 if F16 else (128.0 if BITS == 4 else -128.0)
        if ASYNC_MMA:
            # Each chunk's wgmma is issued asynchronously, and the next iteration's operand
            # for the same chunk is formed while it runs, then the wgmma is waited for: the
            # conversion leaves the tensor cores' critical path. Both operands are carried
            # from one iteration to the next, so that the compiler gives the new ones their own
            # registers (an operand used within the iteration shared the in-flight wgmma's, and
            # the wait moved ahead of the conversion). The ring's slot refill in `_x_chunk`
            # still follows a completed wgmma.
            gl.static_assert(not SCALE_ON_ACC, "the asynchronous loop scales the weights")
            if HAS_ZERO:
                z_lo, z_hi, z_lo1, z_hi1 = _step_pairs(
                    z_ptr, first, N, row_lo, spread, upper, z_off, BITS, DT, GROUP_ITERS,
                    GROUP_64, GROUP_32)  # fmt: skip
            s_lo, s_hi, s_lo1, s_hi1 = _step_pairs(
                s_ptr, first, N, row_lo, spread, upper, 0.0, BITS, DT, GROUP_ITERS, GROUP_64,
                GROUP_32)  # fmt: skip
            a0 = _chunk_operand(words0, z_lo, z_hi, s_lo, s_hi, a_l, BITS, HAS_ZERO, True, DT)
            a1 = _chunk_operand(words1, z_lo1, z_hi1, s_lo1, s_hi1, a_l, BITS, HAS_ZERO, True,
                                DT)  # fmt: skip
            last_step = first + n_iters - 1
            for it in range(n_iters):
                step = first + it
                ahead = gl.minimum(2 * (step + 2), last)
                ahead0 = gl.load(w_tile + ahead * CHUNK_WORDS)
                ahead1 = gl.load(w_tile + (ahead + 1) * CHUNK_WORDS)
                # The next iteration's groups (past the split's end, the last one's again).
                nxt = gl.minimum(step + 1, last_step)
                if HAS_ZERO:
                    z_lo, z_hi, z_lo1, z_hi1 = _step_pairs(
                        z_ptr, nxt, N, row_lo, spread, upper, z_off, BITS, DT, GROUP_ITERS,
                        GROUP_64, GROUP_32)  # fmt: skip
                s_lo, s_hi, s_lo1, s_hi1 = _step_pairs(
                    s_ptr, nxt, N, row_lo, spread, upper, 0.0, BITS, DT, GROUP_ITERS,
                    GROUP_64, GROUP_32)  # fmt: skip
                x0 = _x_chunk(xs, x_at, x_mask, 2 * it, n_chunks, X_RING)
                acc = warpgroup_mma(a0, x0, acc, is_async=True)
                a0n = _chunk_operand(next0, z_lo, z_hi, s_lo, s_hi, a_l, BITS, HAS_ZERO, True,
                                     DT)  # fmt: skip
                acc, a0 = warpgroup_mma_wait(0, deps=[acc, a0])
                x1 = _x_chunk(xs, x_at, x_mask, 2 * it + 1, n_chunks, X_RING)
                acc = warpgroup_mma(a1, x1, acc, is_async=True)
                a1n = _chunk_operand(next1, z_lo1, z_hi1, s_lo1, s_hi1, a_l, BITS, HAS_ZERO,
                                     True, DT)  # fmt: skip
                acc, a1 = warpgroup_mma_wait(0, deps=[acc, a1])
                a0 = a0n
                a1 = a1n
                next0 = ahead0
                next1 = ahead1
        else:
            for it in range(n_iters):
                step = first + it
                ahead = gl.minimum(2 * (step + 2), last)
                ahead0 = gl.load(w_tile + ahead * CHUNK_WORDS)
                ahead1 = gl.load(w_tile + (ahead + 1) * CHUNK_WORDS)
                # The first chunk's group, for the scale on the accumulator (`_step_pairs`).
                group = 2 * step if GROUP_64 else step // GROUP_ITERS
                if HAS_ZERO:
                    z_lo, z_hi, z_lo1, z_hi1 = _step_pairs(
                        z_ptr, step, N, row_lo, spread, upper, z_off, BITS, DT, GROUP_ITERS,
                        GROUP_64, GROUP_32)  # fmt: skip
                if not SCALE_ON_ACC:
                    s_lo, s_hi, s_lo1, s_hi1 = _step_pairs(
                        s_ptr, step, N, row_lo, spread, upper, 0.0, BITS, DT, GROUP_ITERS,
                        GROUP_64, GROUP_32)  # fmt: skip
                a0 = _chunk_operand(words0, z_lo, z_hi, s_lo, s_hi, a_l, BITS, HAS_ZERO,
                                    not SCALE_ON_ACC, DT)  # fmt: skip
                a1 = _chunk_operand(words1, z_lo1, z_hi1, s_lo1, s_hi1, a_l, BITS, HAS_ZERO,
                                    not SCALE_ON_ACC, DT)  # fmt: skip
                x0 = _x_chunk(xs, x_at, x_mask, 2 * it, n_chunks, X_RING)
                if SCALE_ON_ACC and GROUP_32:
                    gl.static_assert(False, "groups of 32 take the scale on the weights")
                elif SCALE_ON_ACC and GROUP_64:
                    # Each chunk is a group: its products are scaled as soon as they are formed.
                    acc_g = warpgroup_mma(a0, x0, acc_g, use_acc=False)
                    s = gl.load(s_ptr + group * N + offs_n).to(gl.float32)
                    acc += acc_g * s[:, None]
                    x1 = _x_chunk(xs, x_at, x_mask, 2 * it + 1, n_chunks, X_RING)
                    acc_g = warpgroup_mma(a1, x1, acc_g, use_acc=False)
                    s = gl.load(s_ptr + (group + 1) * N + offs_n).to(gl.float32)
                    acc += acc_g * s[:, None]
                elif SCALE_ON_ACC:
                    # A group's products start from zero at its first iteration (or the split's).
                    keep = (it != 0) & (step % GROUP_ITERS != 0)
                    acc_g = warpgroup_mma(a0, x0, acc_g, use_acc=keep)
                    x1 = _x_chunk(xs, x_at, x_mask, 2 * it + 1, n_chunks, X_RING)
                    acc_g = warpgroup_mma(a1, x1, acc_g)
                    if (it == n_iters - 1) | ((step + 1) % GROUP_ITERS == 0):
                        s = gl.load(s_ptr + group * N + offs_n).to(gl.float32)
                        acc += acc_g * s[:, None]
                else:
                    acc = warpgroup_mma(a0, x0, acc)
                    x1 = _x_chunk(xs, x_at, x_mask, 2 * it + 1, n_chunks, X_RING)
                    acc = warpgroup_mma(a1, x1, acc)
                words0 = next0
                words1 = next1
                next0 = ahead0
                next1 = ahead1

        offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, acc_l))
        r_mask = (offs_r < M)[None, :]
        if SPLIT_K:
            n_splits = gl.num_programs(1)
            gl.store(part_ptr + (pid_k * M + offs_r[None, :]) * N + offs_n[:, None], acc,
                     mask=r_mask)  # fmt: skip
            _sync_threads()
            counter = count_ptr + pid_n
            if gl.atomic_add(counter, 1, sem="acq_rel") == n_splits - 1:
                _sync_threads()
                acc = gl.zeros([64, ROWS], gl.float32, acc_l)
                for sp in range(n_splits):
                    acc += gl.load(part_ptr + (sp * M + offs_r[None, :]) * N + offs_n[:, None],
                                   mask=r_mask, other=0.0, cache_modifier=".cg")  # fmt: skip
                gl.atomic_xchg(counter, 0)
                _store_tile(acc, b_ptr, y_ptr, offs_n, offs_r, r_mask, stride_ym, HAS_BIAS)
        else:
            _store_tile(acc, b_ptr, y_ptr, offs_n, offs_r, r_mask, stride_ym, HAS_BIAS)

    @gluon.jit
    def _x_chunk(xs, x_at, x_mask, c, n_chunks, X_RING: gl.constexpr):
        """Chunk c of the activation slice as wgmma's B operand [64, ROWS]. From a ring
        (X_RING > 0): first request chunk c + X_RING - 1 into the slot chunk c - 1 left
        (its wgmma has completed: they are synchronous), then wait for chunk c, whose group
        is X_RING - 1 groups back (empty groups keep the count past the last chunk)."""
        if X_RING == 0:
            chunk = xs.index(c)
        else:
            ahead = c + X_RING - 1
            if ahead < n_chunks:
                _copy_async(xs.index(ahead % X_RING), x_at + ahead * _CHUNK_K, x_mask)
            async_copy.commit_group()
            async_copy.wait_group(X_RING - 1)
            fence_async_shared()
            _sync_threads()  # every thread's copies of chunk c have landed
            chunk = xs.index(c % X_RING)
        return chunk.permute((1, 0))

    @gluon.jit
    def _store_tile(acc, b_ptr, y_ptr, offs_n, offs_r, r_mask, stride_ym,
                    HAS_BIAS: gl.constexpr):  # fmt: skip
        """y^T's tile acc [64, ROWS] (+ bias) into y [M, N] in its dtype."""
        if HAS_BIAS:
            acc += gl.load(b_ptr + offs_n).to(gl.float32)[:, None]
        y_at = y_ptr + offs_r[None, :] * stride_ym + offs_n[:, None]
        gl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=r_mask)


def reads_zeros(zeros: torch.Tensor, bits: int = 4) -> bool:
    """Whether the kernel must read the zero points: some differ from the symmetric one it
    applies by itself, 2^(bits - 1) (a device sync: decide it once, at load)."""
    return not bool((zeros == 1 << (bits - 1)).all())


def quant_wgmma_matmul(
    x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int, bias: torch.Tensor | None = None, config: QuantWgmmaConfig | None = None,
    counters: torch.Tensor | None = None, *, bits: int = 4, has_zero: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] (bf16 or fp16) -> x W^T (+ b) [M, N], W's `bits`-bit codes as
    `pack_quant_wgmma` packed them and `scales`/`zeros` [G, N] as
    `asyncengine_kernels.quant_linear` keeps them (the scales in x's type).
    `counters`: int32, one per 64 output features, zeroed (the kernel leaves them so; default:
    fresh ones); has_zero: whether the zero points must be read (default: `reads_zeros`).
    More rows than one launch takes (`launch_max_rows`) run as launches of that many rows,
    one after another, each with `config` (default: `quant_wgmma_config` for its rows)."""
    _check_bits(bits)
    m, k = x.shape
    n = scales.shape[1]
    codes = words.numel() * (32 // bits)
    if codes != n * k:
        raise ValueError(f"{words.numel()} words hold {codes} {bits}-bit codes, not {n} x {k}")
    if x.dtype not in DTYPES or x.stride(1) != 1:
        raise ValueError(f"quant_wgmma takes bf16 or fp16 activations with unit stride, got "
                         f"{x.dtype}")  # fmt: skip
    if scales.dtype != x.dtype:
        # The scales enter 16-bit arithmetic on the weights as they are stored.
        raise ValueError(f"quant_wgmma needs the scales in the activations' type {x.dtype}, "
                         f"got {scales.dtype}")  # fmt: skip
    if not _groups_fit(k, group_size):
        raise ValueError(f"quant_wgmma needs K={k} in whole {ITER_K}-feature iterations and "
                         f"its groups of {group_size} in {CHUNK_K}-feature chunks or whole "
                         "iterations")  # fmt: skip
    if m > max_rows(bits):
        raise ValueError(f"quant_wgmma serves up to {max_rows(bits)} rows in int{bits}, got {m}")
    step = launch_max_rows(bits)
    if config is not None and not min(m, step) <= config.rows <= step:
        raise ValueError(f"{config} cannot launch {min(m, step)} rows (at most {step} a launch)")
    if config is not None and config.scale_on_acc and group_size < CHUNK_K:
        raise ValueError(f"{config}: groups of {group_size} take the scale on the weights")
    if config is not None and config.scale_on_acc and config.async_mma:
        raise ValueError(f"{config}: the asynchronous wgmma takes the scale on the weights")
    if has_zero is None:
        has_zero = reads_zeros(zeros, bits)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    for lo in range(0, m, step):  # one launch up to `LAUNCH_MAX_ROWS` rows, in order
        hi = min(m, lo + step)
        cfg = config or quant_wgmma_config(hi - lo, n, k, group_size, bits=bits)
        _launch(x[lo:hi], words, scales, zeros, group_size, bias, cfg, counters, y[lo:hi],
                bits, has_zero)  # fmt: skip
    return y


def _launch(
    x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int, bias: torch.Tensor | None, config: QuantWgmmaConfig,
    counters: torch.Tensor | None, y: torch.Tensor, bits: int, has_zero: bool,
) -> None:  # fmt: skip
    """One launch over x's rows (at most `config.rows`) into y (a row range of the output)."""
    m, k = x.shape
    n = scales.shape[1]
    tiles = n // BLOCK_N
    splits = math.ceil(k / config.k_split)
    if splits > 1:
        parts = torch.empty(splits * m * n, device=x.device, dtype=torch.float32)
        if counters is None:
            counters = torch.zeros(tiles, device=x.device, dtype=torch.int32)
        check_gemv_counters(counters, 1, tiles)
    else:
        parts = counters = y
    group_iters = max(1, group_size // ITER_K)
    pdl = use_pdl(x)
    _quant_wgmma_kernel[(tiles, splits)](
        words, scales, zeros, x, bias if bias is not None else y, y, parts, counters, m, n, k,
        x.stride(0), y.stride(0), BITS=bits, ROWS=config.rows, K_SPLIT=config.k_split,
        GROUP_ITERS=group_iters, HAS_ZERO=has_zero, HAS_BIAS=bias is not None,
        SCALE_ON_ACC=config.scale_on_acc, SPLIT_K=splits > 1, USE_PDL=pdl,
        X_RING=config.x_ring, F16=x.dtype == torch.float16, GROUP_64=group_size == CHUNK_K,
        GROUP_32=group_size == HALF_CHUNK_K, ASYNC_MMA=config.async_mma, num_warps=4,
        **pdl_kwargs(pdl),
    )  # fmt: skip
