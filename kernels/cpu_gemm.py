"""A float32 GEMM for small CPU batches that reads each weight once: y = x W^T (+ b).

At decode sizes (1 to a few tens of rows) the product is bound by reading the weight from
memory. The BLAS call reads a wide weight several times for such shapes, and oneDNN's packed
path is no better there. Here the weight is repacked once into panels of `panel_width()`
output columns stored k-major ([panel][K][NR]): a thread streams a panel once and keeps it in
cache for the row tiles after the first, with each tile's accumulators in vector registers.
Panels are split between the OpenMP threads of the runtime torch itself loaded.

The kernel is C, compiled on first use with the system C compiler (`-O3 -march=native`; the
vector width follows the CPU) into the engine's cache directory, keyed by the source, the
compiler and the CPU, so later start-ups load it without compiling. Without a compiler, or
if the build fails, `load_cpu_gemm` returns None after one log line and the layers keep the
BLAS call. Results equal `F.linear` up to summation order (float32 rounding).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from asyncengine.envs import cache_dir

__all__ = ["CpuGemmLib", "gemm_available", "gemm_linear", "load_cpu_gemm",
           "pack_gemm_weight", "time_gemm_against_blas"]

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <stddef.h>
#include <string.h>

/* Row tile MR by NV vectors of VW floats: MR * NV accumulators stay in registers. */
#if defined(__AVX512F__)
#define VW 16
#define NV 4
#define MR 6
#else
#define VW 8
#define NV 2
#define MR 4
#endif
#define NR (VW * NV)
/* Weight rows (of NR floats) prefetched ahead into L2 by a panel's first row tile: the
 * hardware prefetcher alone leaves the FMAs waiting on memory at small batches. */
#define PREFETCH_ROWS 32

typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));

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

/* x [M, K] (row stride ldx) @ packed^T -> y [M, N] (row stride ldy), + bias [N] if given. */
void gemm_packed(const float *x, int m, int ldx, const float *packed, int n, int k,
                 const float *bias, float *y, int ldy) {
    int panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        int col = p * NR;
        int cols = n - col < NR ? n - col : NR;
        const float *wp = packed + (size_t)p * k * NR;
        const float *b = bias ? bias + col : 0;
        for (int r = 0; r < m; r += MR) {
            int rows = m - r < MR ? m - r : MR;
            TILES[rows](x + (size_t)r * ldx, ldx, wp, k, y + (size_t)r * ldy + col, ldy, cols,
                        b, r == 0);
        }
    }
}
"""

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


class CpuGemmLib:
    """The compiled kernel, called through ctypes."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.gemm_packed_floats.restype = ctypes.c_size_t
        lib.gemm_packed_floats.argtypes = [i, i]
        lib.gemm_pack.argtypes = [p, i, i, p]
        lib.gemm_pack.restype = None
        lib.gemm_packed.argtypes = [p, i, i, p, i, i, p, p, i]
        lib.gemm_packed.restype = None
        self._lib = lib
        self._gemm = lib.gemm_packed
        self.panel_width: int = lib.gemm_panel_width()

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        w = weight.detach().contiguous()
        n, k = w.shape
        out = torch.empty(self._lib.gemm_packed_floats(n, k), dtype=torch.float32)
        self._lib.gemm_pack(w.data_ptr(), n, k, out.data_ptr())
        return out.view(-1, k, self.panel_width)

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int,
               bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        y = torch.empty(m, n, dtype=torch.float32)
        b = None if bias is None else bias.contiguous().data_ptr()
        self._gemm(x.data_ptr(), m, x.stride(0), packed.data_ptr(), n, k, b, y.data_ptr(), n)
        return y


def _cpu_fingerprint() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() + platform.machine()


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    return cc if cc and shutil.which(cc) else (shutil.which("gcc") or shutil.which("cc"))


def _build(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "cpu_gemm.c"
        src.write_text(_SOURCE)
        lib = Path(tmp) / out.name
        subprocess.run([cc, *_FLAGS, str(src), "-o", str(lib)], check=True,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
        os.replace(lib, out)  # atomic: another process may be building the same file


@functools.cache
def load_cpu_gemm() -> CpuGemmLib | None:
    """The kernel, compiled on first use (cached on disk); None where it cannot be built or
    loaded (one log line says why)."""
    cc = _compiler()
    if cc is None:
        logger.info("CPU GEMM: no C compiler found; linear layers keep the BLAS call")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout  # fmt: skip
        key = hashlib.sha256(
            "\0".join((_SOURCE, cc, version, " ".join(_FLAGS), _cpu_fingerprint())).encode()
        ).hexdigest()[:16]
        path = cache_dir() / "cpu_gemm" / f"cpu_gemm_{key}.so"
        if not path.exists():
            logger.info("CPU GEMM: compiling the small-batch kernel with %s", cc)
            start = time.perf_counter()
            _build(cc, path)
            logger.info("CPU GEMM: compiled in %.1f s (%s)", time.perf_counter() - start, path)
        return CpuGemmLib(path)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        logger.warning("CPU GEMM: build or load failed; linear layers keep the BLAS call: %s",
                       str(detail).strip()[:500])  # fmt: skip
        return None


def gemm_available() -> bool:
    return load_cpu_gemm() is not None


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's panel layout of a float32 [N, K] weight (the dense one stays for larger
    batches)."""
    lib = load_cpu_gemm()
    if lib is None:
        raise RuntimeError("the CPU GEMM kernel is not available")
    return lib.pack(weight.float())


def gemm_linear(x: torch.Tensor, packed: torch.Tensor, n: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] float32 @ W^T (+ bias) -> [M, N], W given as `pack_gemm_weight(W)`."""
    lib = load_cpu_gemm()
    assert lib is not None, "pack_gemm_weight made `packed`, so the kernel is loaded"
    return lib.linear(x, packed, n, bias)


def time_gemm_against_blas(
    weight: torch.Tensor, packed: torch.Tensor, rows: int, reps: int = 7
) -> tuple[float, float]:
    """Median microseconds of (BLAS, this kernel) for a [rows, K] input on `weight` and its
    `pack_gemm_weight` copy. The two alternate, so a busy spell slows both alike."""
    x = torch.randn(rows, weight.shape[1], dtype=torch.float32)
    n = weight.shape[0]
    paths = (lambda: F.linear(x, weight), lambda: gemm_linear(x, packed, n))
    times: tuple[list[float], list[float]] = ([], [])
    with torch.inference_mode():
        for fn in paths:
            fn()
        for _ in range(reps):
            for fn, out in zip(paths, times, strict=True):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
    blas_us, gemm_us = (1e6 * sorted(t)[len(t) // 2] for t in times)
    return blas_us, gemm_us
