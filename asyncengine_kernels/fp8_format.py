"""The e4m3 format both FP8 users share: the weights and activations of
`asyncengine_kernels.fp8_linear` and the KV cache of `asyncengine_kernels.kv_cache_write`.

`round_to_e4m3_grid` rounds float32 to the e4m3 values (nearest, ties to even) while still
in float32, so the conversion after it has nothing left to round. Triton's interpreter
truncates that conversion and drops the carry into the exponent (124.3 became 64, not 128),
so every kernel whose interpreter output must equal torch's cast rounds with it first.
"""

from __future__ import annotations

import torch

from asyncengine_kernels._triton_utils import tl, triton

__all__ = ["FP8_DTYPE", "FP8_E4M3_MAX", "round_to_e4m3_grid"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # largest finite e4m3 value; e4m3fn has no infinity


@triton.jit
def round_to_e4m3_grid(y):
    """y (float32, |y| <= 448) rounded to nearest even on the e4m3 grid, still float32: the
    step is 2^(e - 3) for |y| in [2^e, 2^(e+1)), e >= -6, and 2^-9 below (subnormals).
    Adding and subtracting 1.5 * 2^(23 + step exponent) rounds |y| at that step."""
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    step = tl.maximum(e, -6) - 3
    magic = (((127 + 23 + step) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (tl.abs(y) + magic) - magic
    return tl.where(bits < 0, -r, r)  # the sign bit, so -0.0 and tiny negatives stay -0.0
