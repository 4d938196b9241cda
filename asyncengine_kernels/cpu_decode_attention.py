"""Paged decode attention on the CPU, reading the KV cache's blocks where they lie.

The torch path (`asyncengine_kernels.paged_attention.decode_rows_attention`) gathers every decode
row's blocks into a padded copy and runs one masked SDPA over it: the keys and values are read,
written and read again, and the padding is computed. This C kernel walks each sequence's
block table instead: per sequence it reads each token's keys once for all query heads, takes
the softmax, and reads each token's values once. Sequences are split between the OpenMP
threads torch uses. The exponential is a vectorized polynomial (about 1 ulp, as the SDPA's
vectorized one), so results equal the reference up to summation order and rounding.

Float32 caches only; an FP8 cache keeps the torch path. Built by `asyncengine_kernels.cpu_native`;
`decode_attention_available()` is False where it cannot be, and callers keep the torch path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from asyncengine_kernels.cpu_native import VECTOR_EXP_C, native_library

__all__ = ["decode_attention_available", "paged_decode_attention_cpu"]

_SOURCE = VECTOR_EXP_C + r"""
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* q [B, Hq, D] (strides q_tok, q_head; unit stride within a head); caches
 * [blocks, block_size, Hkv, D] contiguous; tables [B, W] int64 (row stride table_stride);
 * lens [B] int64; out [B, Hq, D] contiguous. Rows with lens 0 give zeros. One task per
 * sequence, walking its tokens in order: a token's keys (and values) of all KV heads are
 * adjacent, so each sequence's blocks stream from memory once. */
void paged_decode_attention(const float *q, long q_tok, long q_head, const float *k_cache,
                            const float *v_cache, int block_size, int num_kv_heads,
                            int head_dim, const long *tables, long table_stride,
                            const long *lens, int num_seqs, int num_heads, float scale,
                            float *out) {
    const int group = num_heads / num_kv_heads;
    const long tok_stride = (long)num_kv_heads * head_dim;
    const long block_stride = (long)block_size * tok_stride;
#pragma omp parallel
    {
        float *scores = NULL;
        long cap = 0;
        float *acc = malloc(sizeof(float) * num_heads * head_dim);
#pragma omp for schedule(dynamic, 1)
        for (int b = 0; b < num_seqs; b++) {
            const long len = lens[b];
            float *o = out + (long)b * num_heads * head_dim;
            if (len <= 0) {
                memset(o, 0, sizeof(float) * num_heads * head_dim);
                continue;
            }
            /* one padded row of scores per query head, VW-aligned for the exponential */
            const long row = (len + VW - 1) / VW * VW;
            if (row * num_heads > cap) {
                free(scores);
                cap = row * num_heads;
                scores = malloc(sizeof(float) * cap);
            }
            const float *qb = q + (long)b * q_tok;
            const long *table = tables + (long)b * table_stride;
            for (long t = 0; t < len; t++) {
                const float *kt = k_cache + table[t / block_size] * block_stride
                                  + (t % block_size) * tok_stride;
                for (int hq = 0; hq < num_heads; hq++) {
                    const float *qh = qb + hq * q_head;
                    const float *kh = kt + (long)(hq / group) * head_dim;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int d = 0; d < head_dim; d++) s += qh[d] * kh[d];
                    scores[hq * row + t] = s * scale;
                }
            }
            for (int hq = 0; hq < num_heads; hq++) {
                float *sh = scores + hq * row;
                float mx = -INFINITY;
                for (long t = 0; t < len; t++) mx = sh[t] > mx ? sh[t] : mx;
                for (long t = len; t < row; t++) sh[t] = -INFINITY;
                vf sum = (vf){0};
                for (long t = 0; t < row; t += VW) {
                    vf e = vexp(*(vf *)(sh + t) - mx);
                    *(vf *)(sh + t) = e;
                    sum += e;
                }
                float total = 0.0f;
                for (int i = 0; i < VW; i++) total += sum[i];
                const float inv = 1.0f / total;
                for (long t = 0; t < len; t++) sh[t] *= inv;
            }
            memset(acc, 0, sizeof(float) * num_heads * head_dim);
            for (long t = 0; t < len; t++) {
                const float *vt = v_cache + table[t / block_size] * block_stride
                                  + (t % block_size) * tok_stride;
                for (int hq = 0; hq < num_heads; hq++) {
                    const float p = scores[hq * row + t];
                    const float *vh = vt + (long)(hq / group) * head_dim;
                    float *ah = acc + hq * head_dim;
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) ah[d] += p * vh[d];
                }
            }
            memcpy(o, acc, sizeof(float) * num_heads * head_dim);
        }
        free(scores);
        free(acc);
    }
}
"""


@functools.cache
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = native_library("cpu_decode_attention", _SOURCE)
    if lib is None:
        return None
    fn = lib.paged_decode_attention
    p, i, lg = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    fn.argtypes = [p, lg, lg, p, p, i, i, i, p, lg, p, i, i, ctypes.c_float, p]
    fn.restype = None
    return fn


def decode_attention_available() -> bool:
    return _kernel() is not None


def paged_decode_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    lens: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Single-token rows: q [n, Hq, D] float32 (each head's D contiguous) over float32
    caches [blocks, block_size, Hkv, D]; `block_tables` [n, W] and `lens` [n] int64
    (contiguous) -> [n, Hq, D] float32; rows of length 0 give zeros."""
    fn = _kernel()
    assert fn is not None, "callers check decode_attention_available() first"
    n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    if block_tables.dtype != torch.int64 or lens.dtype != torch.int64:
        raise TypeError("block_tables and lens must be int64")
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    lens = lens.contiguous()
    out = torch.empty(n, num_heads, head_dim, dtype=torch.float32)
    fn(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
       block_size, num_kv_heads, head_dim, tables.data_ptr(), tables.stride(0),
       lens.data_ptr(), n, num_heads, scale, out.data_ptr())  # fmt: skip
    return out
