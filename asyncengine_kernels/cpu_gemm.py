"""A float32 GEMM for small CPU batches that reads each weight once: y = x W^T (+ b).

At decode sizes (1 to a few tens of rows) the product is bound by reading the weight from
memory. The BLAS call reads a wide weight several times for such shapes, and oneDNN's packed
path is no better there. Here the weight is repacked once into panels of NR (`panel_width`)
output columns stored k-major ([panel][K][NR]): a thread streams a panel once (prefetching
ahead of its first row tile) and keeps it in cache for the row tiles after the first, with
each tile's accumulators in vector registers. Panels are split between the OpenMP threads of
the runtime torch itself loaded. A layer whose input is RMSNorm(x + residual) or a [gate, up]
pair for SiLU-and-mul has it formed in the same call and parallel region (one pass over the
rows, then the product), instead of several torch ops before it.

The kernel is C, compiled on first use by `asyncengine_kernels.cpu_native` (the vector width follows
the CPU). Without a compiler, or if the build fails, `load_cpu_gemm` returns None after one log
line and the layers keep the BLAS call. Results equal `F.linear` up to summation order
(float32 rounding).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from asyncengine_kernels.cpu_native import VECTOR_EXP_C, native_library

__all__ = ["CpuGemmLib", "gemm_available", "gemm_linear", "gemm_linear_gated",
           "gemm_linear_normed", "load_cpu_gemm", "pack_gemm_weight"]

_SOURCE = r"""
#include <math.h>
#include <stddef.h>
#include <string.h>
""" + VECTOR_EXP_C + r"""
/* Row tile MR by NV vectors of VW floats: MR * NV accumulators stay in registers. */
#if defined(__AVX512F__)
#define NV 4
#define MR 6
#else
#define NV 2
#define MR 4
#endif
#define NR (VW * NV)
/* Weight rows (of NR floats) prefetched ahead into L2 by a panel's first row tile: the
 * hardware prefetcher alone leaves the FMAs waiting on memory at small batches. */
#define PREFETCH_ROWS 32

int gemm_panel_width(void) { return NR; }

size_t gemm_packed_floats(int n, int k) { return (size_t)((n + NR - 1) / NR) * NR * k; }

/* w [N, K] row-major -> out [ceil(N / NR)][K][NR], zero past N. */
void gemm_pack(const float *w, int n, int k, float *out) {
    int panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        float *dst = out + (size_t)p * k * NR;
        for (int kk = 0; kk < k; kk++)
            for (int j = 0; j < NR; j++) {
                int col = p * NR + j;
                dst[(size_t)kk * NR + j] = col < n ? w[(size_t)col * k + kk] : 0.0f;
            }
    }
}

/* ROWS rows of x against one panel; writes `cols` (<= NR) columns of y (+ bias). The first
 * tile of a panel (`first`) prefetches the panel for itself and the tiles after it. */
#define DEFINE_TILE(ROWS)                                                                   \
    static void tile_##ROWS(const float *x, int ldx, const float *wp, int k, float *y,      \
                            int ldy, int cols, const float *bias, int first) {              \
        vf acc[ROWS][NV];                                                                   \
        for (int m = 0; m < ROWS; m++)                                                      \
            for (int v = 0; v < NV; v++) acc[m][v] = (vf){0};                               \
        for (int kk = 0; kk < k; kk++) {                                                    \
            const vf *wk = (const vf *)(wp + (size_t)kk * NR);                              \
            if (first)                                                                      \
                for (int l = 0; l < NR; l += 16) /* one 64-byte line per 16 floats */       \
                    __builtin_prefetch(wp + (size_t)(kk + PREFETCH_ROWS) * NR + l, 0, 2);   \
            vf w[NV];                                                                       \
            for (int v = 0; v < NV; v++) w[v] = wk[v];                                      \
            for (int m = 0; m < ROWS; m++) {                                                \
                vf xb = (vf){0} + x[(size_t)m * ldx + kk];                                  \
                for (int v = 0; v < NV; v++) acc[m][v] += xb * w[v];                        \
            }                                                                               \
        }                                                                                   \
        for (int m = 0; m < ROWS; m++) {                                                    \
            float out[NR];                                                                  \
            memcpy(out, acc[m], sizeof(out));                                               \
            float *dst = y + (size_t)m * ldy;                                               \
            if (bias)                                                                       \
                for (int j = 0; j < cols; j++) dst[j] = out[j] + bias[j];                   \
            else                                                                            \
                memcpy(dst, out, (size_t)cols * sizeof(float));                             \
        }                                                                                   \
    }

DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
#if MR > 4
DEFINE_TILE(5)
DEFINE_TILE(6)
#endif

typedef void (*tile_fn)(const float *, int, const float *, int, float *, int, int,
                        const float *, int);

static const tile_fn TILES[MR + 1] = {
    0, tile_1, tile_2, tile_3, tile_4,
#if MR > 4
    tile_5, tile_6,
#endif
};

static void panel(int p, const float *x, int m, int ldx, const float *packed, int n, int k,
                  const float *bias, float *y, int ldy) {
    int col = p * NR;
    int cols = n - col < NR ? n - col : NR;
    const float *wp = packed + (size_t)p * k * NR;
    const float *b = bias ? bias + col : 0;
    /* Rows split evenly over the fewest tiles (32 rows: 6,6,5,5,5,5, not five 6s and a 2). */
    int tiles = (m + MR - 1) / MR;
    for (int t = 0, r = 0; t < tiles; t++) {
        int rows = m / tiles + (t < m % tiles);
        TILES[rows](x + (size_t)r * ldx, ldx, wp, k, y + (size_t)r * ldy + col, ldy, cols, b,
                    t == 0);
        r += rows;
    }
}

/* x [M, K] (row stride ldx) @ packed^T -> y [M, N] (row stride ldy), + bias [N] if given. */
void gemm_packed(const float *x, int m, int ldx, const float *packed, int n, int k,
                 const float *bias, float *y, int ldy) {
    int panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) panel(p, x, m, ldx, packed, n, k, bias, y, ldy);
}

/* silu(g) * u over one row of K: g / (1 + exp(-g)) * u, as torch's silu and mul. */
static void silu_mul_row(const float *g, const float *u, float *a, int k) {
    int j = 0;
    for (; j + VW <= k; j += VW) {
        vf gv, uv;
        memcpy(&gv, g + j, sizeof gv);
        memcpy(&uv, u + j, sizeof uv);
        vf av = gv / (1.0f + vexp(-gv)) * uv;
        memcpy(a + j, &av, sizeof av);
    }
    for (; j < k; j++) a[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

/* v = x (+ residual), written to res_out if given; a = w * (v * rsqrt(mean(v^2) + eps)). */
static void rms_norm_row(const float *x, const float *res, float *res_out, const float *w,
                         float eps, float *a, int k) {
    const float *v = x;
    if (res) {
        for (int j = 0; j < k; j++) res_out[j] = x[j] + res[j];
        v = res_out;
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int j = 0; j < k; j++) ss += v[j] * v[j];
    const float inv = 1.0f / sqrtf(ss / (float)k + eps);
    for (int j = 0; j < k; j++) a[j] = w[j] * (v[j] * inv);
}

/* The product on an input formed first, in the same parallel region: mode 1 (SiLU-and-mul):
 * x [M, 2K] holds [gate, up]; mode 2 (RMSNorm): x [M, K], plus residual [M, K] if given
 * (x + residual goes to res_out), norm weight w [K]. The formed input goes to scratch
 * [M, K]; then y = scratch @ packed^T (+ bias). */
void gemm_packed_fused(int mode, const float *x, int m, int ldx, const float *res, int ldr,
                       float *res_out, const float *w, float eps, float *scratch,
                       const float *packed, int n, int k, const float *bias, float *y,
                       int ldy) {
    int panels = (n + NR - 1) / NR;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int r = 0; r < m; r++) {
            const float *xr = x + (size_t)r * ldx;
            float *ar = scratch + (size_t)r * k;
            if (mode == 1)
                silu_mul_row(xr, xr + k, ar, k);
            else
                rms_norm_row(xr, res ? res + (size_t)r * ldr : 0,
                             res ? res_out + (size_t)r * k : 0, w, eps, ar, k);
        }
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) panel(p, scratch, m, k, packed, n, k, bias, y, ldy);
    }
}
"""

class CpuGemmLib:
    """The compiled kernel, called through ctypes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.gemm_packed_floats.restype = ctypes.c_size_t
        lib.gemm_packed_floats.argtypes = [i, i]
        lib.gemm_pack.argtypes = [p, i, i, p]
        lib.gemm_pack.restype = None
        lib.gemm_packed.argtypes = [p, i, i, p, i, i, p, p, i]
        lib.gemm_packed.restype = None
        f = ctypes.c_float
        lib.gemm_packed_fused.argtypes = [i, p, i, i, p, i, p, p, f, p, p, i, i, p, p, i]
        lib.gemm_packed_fused.restype = None
        self._lib = lib
        self._gemm = lib.gemm_packed
        self._fused = lib.gemm_packed_fused
        self.panel_width: int = lib.gemm_panel_width()

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        w = weight.detach().contiguous()
        n, k = w.shape
        out = torch.empty(self._lib.gemm_packed_floats(n, k), dtype=torch.float32)
        self._lib.gemm_pack(w.data_ptr(), n, k, out.data_ptr())
        return out.view(-1, k, self.panel_width)

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int,
               bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        x, bias = _rows(x), _contiguous(bias)
        m, k = x.shape
        y = torch.empty(m, n, dtype=torch.float32)
        self._gemm(x.data_ptr(), m, x.stride(0), packed.data_ptr(), n, k, _ptr(bias),
                   y.data_ptr(), n)  # fmt: skip
        return y


    def linear_gated(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                     bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """(silu(gate) * up) @ W^T for x [M, 2K] holding [gate, up]."""
        x, bias = _rows(x), _contiguous(bias)
        m, k = x.shape[0], x.shape[1] // 2
        scratch = torch.empty(m, k, dtype=torch.float32)
        y = torch.empty(m, n, dtype=torch.float32)
        self._fused(1, x.data_ptr(), m, x.stride(0), None, 0, None, None, 0.0,
                    scratch.data_ptr(), packed.data_ptr(), n, k, _ptr(bias), y.data_ptr(),
                    n)  # fmt: skip
        return y

    def linear_normed(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
        eps: float, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """rms_norm(x + residual) @ W^T and x + residual (rms_norm(x) and x without one)."""
        x, bias, norm_weight = _rows(x), _contiguous(bias), norm_weight.contiguous()
        m, k = x.shape
        scratch = torch.empty(m, k, dtype=torch.float32)
        y = torch.empty(m, n, dtype=torch.float32)
        if residual is None:
            res, new_res = None, x
        else:
            res = _rows(residual)
            new_res = torch.empty(m, k, dtype=torch.float32)
        self._fused(2, x.data_ptr(), m, x.stride(0), _ptr(res), 0 if res is None else
                    res.stride(0), None if res is None else new_res.data_ptr(),
                    norm_weight.data_ptr(), eps, scratch.data_ptr(),
                    packed.data_ptr(), n, k, _ptr(bias), y.data_ptr(), n)  # fmt: skip
        return y, new_res


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as float32 rows with unit stride within a row (the kernels' input form)."""
    if x.dtype != torch.float32:
        raise TypeError(f"the CPU GEMM takes float32 input, got {x.dtype}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    # Bound to a name by the caller: a copy made inside an argument list would be freed
    # before the C call reads it.
    return None if t is None else t.contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    """The address of a tensor the caller holds (contiguous already)."""
    return None if t is None else t.data_ptr()


@functools.cache
def load_cpu_gemm() -> CpuGemmLib | None:
    """The kernel, compiled on first use (`asyncengine_kernels.cpu_native`); None where it cannot be
    built or loaded (one log line says why: the layers keep the BLAS call)."""
    lib = native_library("cpu_gemm", _SOURCE)
    return None if lib is None else CpuGemmLib(lib)


def gemm_available() -> bool:
    return load_cpu_gemm() is not None


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's panel layout of a float32 [N, K] weight (the dense one stays for larger
    batches)."""
    lib = load_cpu_gemm()
    if lib is None:
        raise RuntimeError("the CPU GEMM kernel is not available")
    return lib.pack(weight.float())


def _loaded() -> CpuGemmLib:
    lib = load_cpu_gemm()
    assert lib is not None, "pack_gemm_weight made the packed weight, so the kernel is loaded"
    return lib


def gemm_linear(x: torch.Tensor, packed: torch.Tensor, n: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] float32 @ W^T (+ bias) -> [M, N], W given as `pack_gemm_weight(W)`."""
    return _loaded().linear(x, packed, n, bias)


def gemm_linear_gated(x: torch.Tensor, packed: torch.Tensor, n: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """(silu(gate) * up) @ W^T (+ bias) for x [M, 2K] float32 holding [gate, up]."""
    return _loaded().linear_gated(x, packed, n, bias)


def gemm_linear_normed(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """rms_norm(x + residual) @ W^T (+ bias) and the new residual x + residual, as
    `asyncengine_kernels.rms_norm.fused_add_rms_norm` then the product (without a residual:
    rms_norm(x) and x)."""
    return _loaded().linear_normed(x, residual, norm_weight, eps, packed, n, bias)
