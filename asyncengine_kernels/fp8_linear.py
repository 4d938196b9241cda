"""FP8 (e4m3) linear layers: y = x W^T (+ b) with W stored in e4m3, one scale per output row.

Weights: `qweight` float8_e4m3fn [N, K] (rows contiguous, as the checkpoints store them and as
cuBLASLt's fp8 GEMM reads its second operand) and `w_scale` float32 [N]: W[n, k] =
qweight[n, k] * w_scale[n]. A per-tensor checkpoint scale is expanded to every row at load.

Activations, for the W8A8 GEMMs, are quantized per token on the fly (scale = amax / 448 of
the row) or with one static per-tensor scale from the checkpoint (`input_scale`);
`quantize_rows` does it in one pass per row and can form its input first, as the separate
kernels would round it: SiLU-and-mul of a [gate, up] pair, or the residual add and RMSNorm.

Each kernel sits beside its torch reference, which is the CPU path and the test oracle
(dequantize e4m3 -> float32 x scale, quantize-dequantize the activation for W8A8, float32
matmul, cast):
- `fp8_scaled_mm`: torch's `_scaled_mm` (cuBLASLt) with row-wise scales in its epilogue;
- `fp8_gemm`: a Triton `tl.dot` GEMM on the two fp8 operands with the same epilogue;
- `asyncengine_kernels.gemv`'s one-row GEMV in its persistent whole-row form reads the e4m3 rows
  too, with the row scales in its epilogue (`FP8_WHOLE_ROW_CONFIGS`);
- `fp8_gemv`: weight-only (W8A16) for 1-16 rows: e4m3 weights converted to the activation
  dtype in registers, fp32 sums, the row scale in the epilogue; no activation rounding,
  which is both cheaper at these sizes and more accurate. It can take a [gate, up] input
  (SiLU-and-mul in its prologue, with `asyncengine_kernels.gemv`'s own input helper for one row). A
  one-row decode step that needs RMSNorm forms it in the whole-row GEMV above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncengine_kernels._triton_utils import (
    next_power_of_2,
    pdl_kwargs,
    pdl_wait,
    tl,
    triton,
    use_pdl,
)
from asyncengine_kernels.activation import silu_times
from asyncengine_kernels.fp8_format import FP8_DTYPE, FP8_E4M3_MAX, round_to_e4m3_grid
from asyncengine_kernels.gemv import WholeRowGemvConfig, load_gemv_input
from asyncengine_kernels.gemv_split_k import check_gemv_counters, finish_gemv_row

__all__ = [
    "FP8_DTYPE",
    "FP8_WHOLE_ROW_CONFIGS",
    "Fp8GemmConfig",
    "Fp8GemvConfig",
    "dequantize_fp8",
    "fp8_dense_weight",
    "fp8_gemm",
    "fp8_gemm_candidates",
    "fp8_gemv",
    "fp8_gemv_candidates",
    "fp8_linear_ref",
    "fp8_scaled_mm",
    "quantize_rows",
    "quantize_rows_ref",
    "quantize_weight_per_channel",
    "scaled_mm_fits",
]

# The smallest per-token scale: a row of zeros still divides by something positive.
MIN_SCALE = 1.0 / (FP8_E4M3_MAX * 512.0)
# The GEMV serves at most this many rows (one weight tile per program serves them all).
FP8_GEMV_MAX_ROWS = 16
# The narrowest output block a one-row GEMV config takes (sizes its split-K counters).
FP8_GEMV_MIN_BLOCK_N = 4
# One row on `asyncengine_kernels.gemv`'s persistent whole-row GEMV, which reads e4m3 rows with
# their scales (`gemv_triton(..., scale=)`): each program forms the input once, its RMSNorm
# included, and streams whole rows against it. A byte per weight: more rows per block than
# its 16-bit configs for the same bytes in flight. The pairs forms take about 3.0 sm_90
# instructions per weight byte in their loop against 4.2 for the float32 products.
FP8_WHOLE_ROW_CONFIGS: list[WholeRowGemvConfig] = [
    WholeRowGemvConfig(2, 4, 3, programs_per_sm=4),
    WholeRowGemvConfig(2, 4, 4, programs_per_sm=8),
    WholeRowGemvConfig(4, 4, 3, programs_per_sm=4),
    WholeRowGemvConfig(4, 8, 2, programs_per_sm=2),
    WholeRowGemvConfig(8, 8, 2, programs_per_sm=2),
    WholeRowGemvConfig(2, 4, 3, programs_per_sm=8, pairs=True),
    WholeRowGemvConfig(4, 4, 3, programs_per_sm=4, pairs=True),
    WholeRowGemvConfig(4, 4, 2, programs_per_sm=4, pairs=True),
    WholeRowGemvConfig(8, 8, 3, programs_per_sm=2, pairs=True),
]


# ----------------------------------------------------------------------------- references
def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (e4m3 [N, K], float32 scales [N, 1]): amax / 448 per row."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).clamp(min=MIN_SCALE)
    q = (wf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [N, K] times a scale broadcast against it ([N, 1] or a scalar), in float32."""
    return q.float() * scale.float()


def quantize_rows_ref(
    x: torch.Tensor, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]): per token (amax / 448 of each row),
    or with the static per-tensor `input_scale` (a scalar) for every row."""
    xf = x.float()
    if input_scale is None:
        scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).clamp(min=MIN_SCALE)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    q = (xf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q, scale.contiguous()


def fp8_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, *, quantize_input: bool = True,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] -> x W^T (+ b) [M, N] in x's dtype, in float32 from the dequantized weight;
    quantize_input: W8A8, x first rounded to e4m3 per token (or with `input_scale`)."""
    w = dequantize_fp8(qweight, w_scale.reshape(-1, 1))
    if quantize_input:
        xq, xs = quantize_rows_ref(x, input_scale)
        xf = dequantize_fp8(xq, xs)
    else:
        xf = x.float()
    y = xf @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ------------------------------------------------------------------ activation quantization
@triton.jit
def _quantize_rows_kernel(
    x_ptr, res_ptr, norm_w_ptr, res_out_ptr, xq_ptr, xs_ptr, in_scale_ptr, K, stride_xm,
    stride_rm, eps, GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    STATIC: tl.constexpr, K_PAD: tl.constexpr,
):  # fmt: skip
    """One program per row: form the row (SiLU-and-mul or residual add + RMSNorm, rounded
    to x's dtype as those kernels round), then its scale and e4m3 values."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, K_PAD)
    mask = offs < K
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0)
    if GATED:
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + row * stride_xm + K + offs, mask=mask, other=0.0).to(tl.float32)
        x = silu_times(gate, up).to(dt)
    if NORM:
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_rm + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
            tl.store(res_out_ptr + row * K + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
        normed = (xf * rstd).to(dt).to(tl.float32)
        x = (normed * tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
    xf = x.to(tl.float32)
    if STATIC:
        scale = tl.load(in_scale_ptr).to(tl.float32)
    else:
        scale = tl.maximum(tl.max(tl.abs(xf), axis=0) / 448.0, 1.0 / (448.0 * 512.0))
    q = round_to_e4m3_grid(tl.clamp(xf / scale, -448.0, 448.0))
    tl.store(xq_ptr + row * K + offs, q.to(xq_ptr.dtype.element_ty), mask=mask)
    tl.store(xs_ptr + row, scale)


def quantize_rows(
    x: torch.Tensor, input_scale: torch.Tensor | None = None, *, gated: bool = False,
    norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """`quantize_rows_ref` in one Triton kernel: returns (e4m3 [M, K], float32 scales [M, 1],
    the new residual or None).

    gated: x is [M, 2K] holding [gate, up]; the row quantized is silu(gate) * up.
    norm (weight, eps): the row quantized is rms_norm(x + residual) (rms_norm(x) without a
    residual); the new residual x + residual is returned."""
    m = x.shape[0]
    k = x.shape[1] // 2 if gated else x.shape[1]
    if x.stride(1) != 1:
        raise ValueError("quantize_rows needs x with contiguous rows")
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else None
    norm_w, eps = norm if norm is not None else (scale, 0.0)
    if residual is not None and residual.stride(1) != 1:
        raise ValueError("quantize_rows needs a residual with contiguous rows")
    k_pad = next_power_of_2(k)
    if m:
        _quantize_rows_kernel[(m,)](
            x, residual if residual is not None else x, norm_w,
            res_out if res_out is not None else q, q, scale,
            input_scale if input_scale is not None else scale, k, x.stride(0),
            residual.stride(0) if residual is not None else 0, float(eps), GATED=gated,
            NORM=norm is not None, HAS_RESIDUAL=residual is not None,
            STATIC=input_scale is not None, K_PAD=k_pad,
            num_warps=4 if k_pad <= 2048 else (8 if k_pad <= 8192 else 16),
        )  # fmt: skip
    return q, scale, res_out


# ------------------------------------------------------------------------- W8A8: cuBLASLt
def scaled_mm_fits(n: int, k: int) -> bool:
    """cuBLASLt's fp8 GEMM needs K and N multiples of 16."""
    return n % 16 == 0 and k % 16 == 0


def fp8_scaled_mm(
    xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """xq e4m3 [M, K] with x_scale [M, 1] against qweight [N, K] with w_scale [N]: torch's
    `_scaled_mm` with row-wise scales applied in its epilogue. Its row-wise form writes
    bfloat16; another output dtype is cast from that."""
    n, k = qweight.shape
    if not scaled_mm_fits(n, k):
        raise ValueError(f"_scaled_mm needs K and N multiples of 16, got N={n}, K={k}")
    y = torch._scaled_mm(
        xq, qweight.t(), scale_a=x_scale, scale_b=w_scale.view(1, n),
        out_dtype=torch.bfloat16,
    )  # fmt: skip
    if bias is not None:
        y = y + bias
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


# -------------------------------------------------------------------------- W8A8: Triton
@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tile shape of `fp8_gemm`; `group_m` row tiles share a column sweep (L2 reuse)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8

    def __str__(self) -> str:
        return (f"gemm {self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} "
                f"s{self.num_stages}")  # fmt: skip


def fp8_gemm_candidates() -> list[Fp8GemmConfig]:
    """Tile shapes the start-up tuner times (fp8 tensor cores take K tiles of 32 or more)."""
    return [
        Fp8GemmConfig(16, 64, 128, 4, 4), Fp8GemmConfig(32, 64, 128, 4, 4),
        Fp8GemmConfig(64, 64, 128, 4, 4), Fp8GemmConfig(64, 128, 128, 4, 3),
        Fp8GemmConfig(128, 128, 128, 8, 3), Fp8GemmConfig(128, 256, 64, 8, 3),
        Fp8GemmConfig(64, 256, 128, 8, 3),
    ]  # fmt: skip


@triton.jit
def _fp8_gemm_kernel(
    xq_ptr, xs_ptr, w8_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_am, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles walk the column tiles together, so a weight tile is
    # read from HBM once per group rather than once per row tile.
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    a_ptrs = xq_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w8_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        # Hopper's fp8 MMAs accumulate in reduced precision; Triton's default lets that run
        # over all of K (an error of about 1 % of the output's range at K = 14,336). The
        # partial sum of each K tile is added into the float32 accumulator instead, as
        # cuBLASLt does without fast accumulation.
        acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    a_s = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
    w_s = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_gemm(
    xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, config: Fp8GemmConfig = Fp8GemmConfig(),
) -> torch.Tensor:  # fmt: skip
    """`fp8_scaled_mm` as a Triton GEMM (any M, N, K)."""
    m, k = xq.shape
    n = qweight.shape[0]
    if qweight.shape[1] != k or xq.stride(1) != 1 or qweight.stride(1) != 1:
        raise ValueError(f"fp8_gemm needs x [M, {qweight.shape[1]}] and a weight with "
                         f"contiguous rows, got x {tuple(xq.shape)}")  # fmt: skip
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    c = config
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    _fp8_gemm_kernel[grid](
        xq, x_scale, qweight, w_scale, bias if bias is not None else y, y, m, n, k,
        xq.stride(0), qweight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return y


# -------------------------------------------------------------------------- W8A16: GEMV
@dataclass(frozen=True)
class Fp8GemvConfig:
    """Blocking of `fp8_gemv`: output rows per program, K per step, K splits. One row uses
    FMA on [block_n, block_k] tiles in float32 (as `asyncengine_kernels.gemv`); 2-16 rows use
    `tl.dot` with the rows padded to 16 and at least 16 output rows per program."""

    block_n: int = 8
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __str__(self) -> str:
        return (f"gemv n{self.block_n} k{self.block_k} split{self.split_k} w{self.num_warps} "
                f"s{self.num_stages}")  # fmt: skip


def fp8_gemv_candidates(rows: int) -> list[Fp8GemvConfig]:
    """Every GEMV blocking the start-up tuner can time for `rows` rows
    (`ASYNCENGINE_TUNE_ALL_KINDS`; by default it times the few its rule table names,
    `models.quantization.fp8`)."""
    if rows == 1:
        return [
            Fp8GemvConfig(4, 512), Fp8GemvConfig(4, 1024, num_stages=3), Fp8GemvConfig(8, 512),
            Fp8GemvConfig(8, 1024, num_stages=3), Fp8GemvConfig(16, 512, num_warps=8),
            Fp8GemvConfig(16, 256), Fp8GemvConfig(32, 256), Fp8GemvConfig(8, 512, split_k=2),
            # A byte per weight: twice the K of a 16-bit tile for the same bytes in flight.
            Fp8GemvConfig(4, 2048, num_warps=8, num_stages=3),
            Fp8GemvConfig(8, 1024, num_warps=8, num_stages=3),
        ]  # fmt: skip
    return [
        Fp8GemvConfig(16, 256), Fp8GemvConfig(32, 256), Fp8GemvConfig(32, 128),
        Fp8GemvConfig(64, 128), Fp8GemvConfig(16, 512, num_stages=3),
        Fp8GemvConfig(32, 256, split_k=2), Fp8GemvConfig(64, 256, num_warps=8, num_stages=3),
    ]  # fmt: skip


@triton.jit
def _gemv_x(x_ptr, rows, kk, mask, K, GATED: tl.constexpr):
    """The GEMV's input at row offsets `rows` (int64) and columns kk; GATED: x holds
    [gate, up] and this is silu(gate) * up, rounded to x's dtype as `silu_and_mul` rounds."""
    x = tl.load(x_ptr + rows + kk, mask=mask, other=0.0)
    if GATED:
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + rows + K + kk, mask=mask, other=0.0).to(tl.float32)
        x = silu_times(gate, up).to(x_ptr.dtype.element_ty)
    return x


@triton.jit
def _row_gemv(x_ptr, w_rows, n_mask, offs_k, k_start, k_end, K, EVEN_K: tl.constexpr,
              GATED: tl.constexpr):  # fmt: skip
    """One row's products [1, BLOCK_N] with each e4m3 weight widened to float32."""
    BLOCK_K: tl.constexpr = offs_k.shape[0]
    acc2 = tl.zeros([w_rows.shape[0], BLOCK_K], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + offs_k
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k_mask = kk < k_end
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0)  # fmt: skip
        # Columns past this split's end meet zero weights; past K, x is zero.
        x = load_gemv_input(x_ptr, x_ptr, x_ptr, 0.0, kk, K, False, GATED, False, False)
        acc2 += w.to(tl.float32) * x[None, :]
    return tl.sum(acc2, axis=1)[None, :]


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w8_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, K_PER_SPLIT, part_ptr,
    count_ptr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False, SPLIT_K: tl.constexpr = 0,
):  # fmt: skip
    """y[M, N] (or split pid_k's partial sums, scaled) = x W^T: each weight tile is read
    once and serves every row of x. One row (BLOCK_M == 1) may be formed from a [gate, up]
    input in the prologue as `asyncengine_kernels.gemv` forms it. SPLIT_K > 0 (one row only): the K
    splits add up in the kernel (`finish_gemv_row`, into y_ptr through part_ptr and
    count_ptr; SPLIT_K a power of two at least the splits)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_rows = w8_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    pdl_wait(USE_PDL)
    if BLOCK_M == 1:
        acc = _row_gemv(x_ptr, w_rows, n_mask, offs_k, k_start, k_end, K, EVEN_K, GATED)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_rows = offs_m.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < k_end
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = _gemv_x(x_ptr, x_rows, kk[None, :], m_mask[:, None] & k_mask[None, :], K, GATED)
            # e4m3 values are exact in 16-bit floats: the tensor cores see the weight as is.
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    offs_m = tl.arange(0, BLOCK_M)
    acc = acc * tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if SPLIT_K > 0:
        finish_gemv_row(tl.sum(acc, axis=0), b_ptr, y_ptr, part_ptr, count_ptr, 0, pid_n,
                        pid_k, 1, N, N, offs_n, n_mask, HAS_BIAS, SPLIT_K)  # fmt: skip
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + ((pid_k * M + offs_m.to(tl.int64)) * N)[:, None] + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty),
                 mask=(offs_m < M)[:, None] & n_mask[None, :])  # fmt: skip


def fp8_gemv(
    x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, config: Fp8GemvConfig = Fp8GemvConfig(),
    *, gated: bool = False, counters: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M <= 16, K] (16-bit) -> x W^T (+ b) [M, N] in x's dtype, the weight-only
    `fp8_linear_ref(..., quantize_input=False)`. gated: x is [M, 2K] holding [gate, up], and
    the product is taken with silu(gate) * up (the MLP's down projection, without a separate
    activation kernel). counters (`asyncengine_kernels.gemv_split_k.gemv_counters`): one row's K
    splits add up in the kernel rather than in a torch sum after it."""
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    n = qweight.shape[0]
    if m > FP8_GEMV_MAX_ROWS:
        raise ValueError(f"fp8_gemv takes at most {FP8_GEMV_MAX_ROWS} rows, got {m}")
    if qweight.shape[1] != k or x.stride(1) != 1 or qweight.stride(1) != 1:
        raise ValueError(f"fp8_gemv needs x [M, {qweight.shape[1]}] and a weight with "
                         f"contiguous rows, got x {tuple(x.shape)}")  # fmt: skip
    block_m = 1 if m == 1 else max(16, next_power_of_2(m))
    block_n = config.block_n if m == 1 else max(16, config.block_n)
    split = max(1, config.split_k)
    per_split = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    split = triton.cdiv(k, per_split)
    blocks = triton.cdiv(n, block_n)
    # One row's splits may add up in the kernel (the counters given); otherwise each split
    # writes its own float32 rows and torch sums them.
    in_kernel = split > 1 and m == 1 and counters is not None
    if in_kernel and counters is not None:
        check_gemv_counters(counters, 1, blocks)
    out = torch.empty((1 if in_kernel else split, m, n),
                      dtype=torch.float32 if split > 1 and not in_kernel else x.dtype,
                      device=x.device)  # fmt: skip
    part = (torch.empty((split, 1, n), dtype=torch.float32, device=x.device) if in_kernel
            else out)  # fmt: skip
    if m == 0:
        return out[0]
    grid = (blocks, split)
    fused_bias = bias is not None and (split == 1 or in_kernel)
    pdl = use_pdl(x)
    _fp8_gemv_kernel[grid](
        x, qweight, w_scale, bias if fused_bias else out, out, m, n, k, x.stride(0),
        qweight.stride(0), per_split, part, counters if in_kernel else out,
        HAS_BIAS=fused_bias, EVEN_K=k % per_split == 0 and per_split % config.block_k == 0,
        GATED=gated, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=config.block_k, USE_PDL=pdl,
        SPLIT_K=next_power_of_2(split) if in_kernel else 0, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl_kwargs(pdl),
    )  # fmt: skip
    if split == 1 or in_kernel:
        return out[0]
    y = out.sum(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_dense_weight(qweight: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype
                     ) -> torch.Tensor:  # fmt: skip
    """The dequantized weight [N, K] in `dtype` (for checks and the HF oracle)."""
    return dequantize_fp8(qweight, w_scale.reshape(-1, 1)).to(dtype)
