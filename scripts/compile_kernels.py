"""Compile the Triton kernels of a decode and a prefill step for a GPU target, without a GPU.

The CPU interpreter checks what the kernels compute but not whether they compile: this
script lowers the main variants (paged attention with and without rotary, split-KV and
prefill tiles, CUDA-core MHA decode tiles, the sm_90 prefill kernel (Triton, and the
warp-specialized Gluon kernel when this Triton has Gluon), each also over an FP8 (e4m3) KV
cache, the tiled and whole-row GEMV forms, the few-row matmul, the int4/int8 weight-only
GEMM and GEMV, the FP8 GEMM, GEMV and activation quantization, the norm, rotary, KV-write
and merge kernels) to a cubin for sm_90 with Triton's bundled ptxas, so a kernel change that
would not build on an H200 fails here.

  python scripts/compile_kernels.py              # sm_90, every variant
  python scripts/compile_kernels.py --arch 100   # another compute capability
  python scripts/compile_kernels.py --only quant # the int4/int8 matmuls only
  python scripts/compile_kernels.py --only wgmma # the int4/int8 wgmma matmul only
  python scripts/compile_kernels.py --only fp8   # the FP8 kernels only
  python scripts/compile_kernels.py --fp8-kv     # the FP8 KV-cache variants only
  python scripts/compile_kernels.py --only prefill --asm-stats  # registers, spills, wgmma
  python scripts/compile_kernels.py --sass-digest  # a digest of each variant's machine code:
                                                   # a refactor that should not change the
                                                   # kernels shows the same digests

It must run without TRITON_INTERPRET (the interpreter replaces the compiler).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Pointer element types by argument name (anything else ending in _ptr is bf16); scalars
# named here are fp32, the other runtime scalars int32.
POINTER_TYPES = {
    "block_tables_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "seg_acc_ptr": "*fp32",
    "seg_max_ptr": "*fp32",
    "seg_sum_ptr": "*fp32",
    "positions_ptr": "*i64",
    "slot_mapping_ptr": "*i64",
    "cos_sin_ptr": "*fp32",
    "qw_ptr": "*i32",
    "w_ptr": "*bf16",
    "part_ptr": "*fp32",
    "count_ptr": "*i32",
    "k_scale_ptr": "*fp32",
    "v_scale_ptr": "*fp32",
    "xq_ptr": "*fp8e4nv",
    "w8_ptr": "*fp8e4nv",
    "w32_ptr": "*i32",
    "xs_ptr": "*fp32",
    "ws_ptr": "*fp32",
    "in_scale_ptr": "*fp32",
    "s_ptr": "*fp32",
    "norm_w_ptr": "*bf16",
}
# Variants with KV_FP8 on read and write an e4m3 cache; GEMVs with HAS_SCALE read e4m3 rows.
FP8_KV_POINTERS = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
FP8_WEIGHT_POINTERS = {"w_ptr": "*fp8e4nv"}
FLOAT_SCALARS = {"eps", "scale_log2"}
# Per kernel: pointers typed otherwise than above (the integer GEMM's scales are bf16, as a
# bf16 model loads them).
KERNEL_POINTERS = {"_quant_gemm_kernel": {"s_ptr": "*bf16"}}
# Per kernel: integer arguments that a launch at Llama sizes passes as multiples of 16, so
# Triton specializes them as it does the pointers (the integer GEMM's N and K: its weight,
# scale and zero loads are vectorized only then).
KERNEL_ALIGNED = {"_quant_gemm_kernel": {"N", "K", "K_PER_SPLIT"}}

ATTENTION = dict(NUM_HEADS=32, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, DOT_FP32=False,
                 IEEE=False, USE_PDL=True, HALF=64)  # fmt: skip
PREFILL = dict(HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, DOT_FP32=False, IEEE=False, USE_PDL=True,
               BLOCK_M=128, TILE=64)  # fmt: skip
SKINNY = dict(EVEN_K=True, IEEE=False, DOT_FP32=False, USE_PDL=True)
# K splits of the split variants (the reduction is unrolled to the config's split count).
SKINNY_SPLITS = 4
# (module, kernel, constexprs, num_warps, num_stages)
VARIANTS: list[tuple[str, str, dict[str, Any], int, int]] = [
    ("asyncengine_kernels.paged_attention", "_paged_attention_kernel",
     dict(ATTENTION, GROUP=1, BLOCK_M=16, BLOCK_Q=16, TILE=32, NUM_SEGMENTS=16, DECODE=True,
          ROTARY=False), 4, 2),
    ("asyncengine_kernels.paged_attention", "_paged_attention_kernel",
     dict(ATTENTION, GROUP=1, BLOCK_M=16, BLOCK_Q=16, TILE=32, NUM_SEGMENTS=16, DECODE=True,
          ROTARY=True), 4, 2),
    ("asyncengine_kernels.paged_attention", "_paged_attention_kernel",
     dict(ATTENTION, GROUP=4, BLOCK_M=16, BLOCK_Q=4, TILE=64, NUM_SEGMENTS=1, DECODE=True,
          ROTARY=True), 4, 2),
    ("asyncengine_kernels.paged_attention", "_paged_attention_kernel",
     dict(ATTENTION, GROUP=4, BLOCK_M=16, BLOCK_Q=4, TILE=64, NUM_SEGMENTS=1, DECODE=False,
          ROTARY=False), 4, 2),
    ("asyncengine_kernels.paged_attention", "_paged_attention_kernel",
     dict(ATTENTION, GROUP=1, BLOCK_M=64, BLOCK_Q=64, TILE=64, NUM_SEGMENTS=1, DECODE=False,
          ROTARY=False), 4, 2),
    ("asyncengine_kernels.prefill_attention", "_prefill_attention_kernel",
     dict(PREFILL, GROUP=4, BLOCK_Q=32), 8, 3),
    ("asyncengine_kernels.prefill_attention", "_prefill_attention_kernel",
     dict(PREFILL, GROUP=1, BLOCK_Q=128), 8, 3),
    ("asyncengine_kernels.paged_attention", "_reduce_segments_kernel",
     dict(NUM_HEADS=32, HEAD_DIM=128, D_PAD=128, NUM_SEGMENTS=16, USE_PDL=True), 4, 1),
    ("asyncengine_kernels.gemv", "_gemv_kernel",
     dict(HAS_BIAS=False, EVEN_K=True, GATED=False, NORM=False, HAS_RESIDUAL=False, GLU=False,
          K_PAD=1, USE_PDL=True, BLOCK_N=4, BLOCK_K=1024), 4, 3),
    ("asyncengine_kernels.gemv", "_gemv_kernel",
     dict(HAS_BIAS=False, EVEN_K=True, GATED=True, NORM=False, HAS_RESIDUAL=False, GLU=False,
          K_PAD=1, USE_PDL=True, BLOCK_N=16, BLOCK_K=512), 8, 3),
    ("asyncengine_kernels.gemv", "_gemv_kernel",
     dict(HAS_BIAS=True, EVEN_K=True, GATED=False, NORM=True, HAS_RESIDUAL=True, GLU=False,
          K_PAD=4096, USE_PDL=True, BLOCK_N=8, BLOCK_K=512), 4, 4),
    ("asyncengine_kernels.gemv", "_gemv_kernel",
     dict(HAS_BIAS=False, EVEN_K=True, GATED=False, NORM=True, HAS_RESIDUAL=True, GLU=True,
          K_PAD=4096, USE_PDL=True, BLOCK_N=4, BLOCK_K=1024), 4, 3),
    ("asyncengine_kernels.gemv", "_gemv_rows_kernel",
     dict(HAS_BIAS=False, GATED=False, NORM=False, HAS_RESIDUAL=False, GLU=False, K_PAD=4096,
          USE_PDL=True, BLOCK_N=2), 4, 3),
    ("asyncengine_kernels.gemv", "_gemv_rows_kernel",
     dict(HAS_BIAS=False, GATED=False, NORM=True, HAS_RESIDUAL=True, GLU=True, K_PAD=4096,
          USE_PDL=True, BLOCK_N=2), 8, 3),
    ("asyncengine_kernels.gemv", "_gemv_rows_kernel",
     dict(HAS_BIAS=False, GATED=True, NORM=False, HAS_RESIDUAL=False, GLU=False, K_PAD=8192,
          USE_PDL=True, BLOCK_N=1), 4, 4),
    # FP8 layers' one-row whole-row GEMV: e4m3 rows, the norm fused (q/k/v, gate/up).
    ("asyncengine_kernels.gemv", "_gemv_rows_kernel",
     dict(HAS_BIAS=False, HAS_SCALE=True, GATED=False, NORM=True, HAS_RESIDUAL=True,
          GLU=False, K_PAD=4096, USE_PDL=True, BLOCK_N=4), 4, 3),
    ("asyncengine_kernels.gemv", "_gemv_rows_kernel",
     dict(HAS_BIAS=False, HAS_SCALE=True, GATED=False, NORM=True, HAS_RESIDUAL=True,
          GLU=False, K_PAD=4096, USE_PDL=True, BLOCK_N=8), 8, 2),
    ("asyncengine_kernels.gemv", "_gemv_rows_kernel",
     dict(HAS_BIAS=False, HAS_SCALE=True, GATED=False, NORM=True, HAS_RESIDUAL=True,
          GLU=False, K_PAD=4096, USE_PDL=True, BLOCK_N=4, PAIRS=True), 4, 3),
    # The few-row matmul (wgmma) with and without K splits, the gated input and the GLU
    # epilogue.
    ("asyncengine_kernels.skinny_gemm", "_skinny_gemm_kernel",
     dict(SKINNY, HAS_BIAS=False, GATED=False, GLU=False, SPLIT=True, BLOCK_N=64,
          BLOCK_K=128, MAX_SPLITS=SKINNY_SPLITS), 4, 4),
    ("asyncengine_kernels.skinny_gemm", "_skinny_gemm_kernel",
     dict(SKINNY, HAS_BIAS=True, GATED=False, GLU=False, SPLIT=False, BLOCK_N=64,
          BLOCK_K=128), 4, 4),
    ("asyncengine_kernels.skinny_gemm", "_skinny_gemm_kernel",
     dict(SKINNY, HAS_BIAS=False, GATED=True, GLU=False, SPLIT=True, BLOCK_N=64,
          BLOCK_K=128, MAX_SPLITS=SKINNY_SPLITS), 4, 4),
    ("asyncengine_kernels.skinny_gemm", "_skinny_gemm_kernel",
     dict(SKINNY, HAS_BIAS=False, GATED=False, GLU=True, SPLIT=True, BLOCK_N=64,
          BLOCK_K=128, MAX_SPLITS=SKINNY_SPLITS), 4, 4),
    # The int4/int8 GEMM at the tiles of `QUANT_GEMM_SHAPES`: the decode tile split along K,
    # tiles spanning four groups (g32) and inside one (per channel), the 128-row tile.
    ("asyncengine_kernels.quant_linear", "_quant_gemm_kernel",
     dict(GROUP_SIZE=128, BITS=4, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
          SPLIT=True), 4, 4),
    ("asyncengine_kernels.quant_linear", "_quant_gemm_kernel",
     dict(GROUP_SIZE=32, BITS=4, HAS_BIAS=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128), 4, 3),
    ("asyncengine_kernels.quant_linear", "_quant_gemm_kernel",
     dict(GROUP_SIZE=4096, BITS=8, HAS_BIAS=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128,
          SPLIT=True), 4, 3),
    ("asyncengine_kernels.quant_linear", "_quant_gemm_kernel",
     dict(GROUP_SIZE=128, BITS=8, HAS_BIAS=False, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64), 4, 3),
    ("asyncengine_kernels.quant_linear", "_dequantize_kernel",
     dict(GROUP_SIZE=128, BITS=4, BLOCK_K=64, BLOCK_N=128), 4, 1),
    ("asyncengine_kernels.quant_linear", "_dequantize_kernel",
     dict(GROUP_SIZE=4096, BITS=8, BLOCK_K=64, BLOCK_N=128), 4, 1),
    # The GEMV: all of a program's tiles loaded at once, no K loop, products in
    # half-precision pairs (inline PTX).
    ("asyncengine_kernels.quant_linear", "_quant_gemv_at_once_kernel",
     dict(GROUP_SIZE=128, BITS=4, HAS_BIAS=False, SPLIT_K=16, BLOCK_N=32, BLOCK_K=128,
          TILES=8, USE_PDL=True), 4, 1),
    ("asyncengine_kernels.quant_linear", "_quant_gemv_at_once_kernel",
     dict(GROUP_SIZE=32, BITS=8, HAS_BIAS=True, SPLIT_K=1, BLOCK_N=64, BLOCK_K=32,
          TILES=8, USE_PDL=False), 4, 1),
    ("asyncengine_kernels.quant_linear", "_quant_gemv_at_once_kernel",
     dict(GROUP_SIZE=128, BITS=4, HAS_BIAS=False, SPLIT_K=16, BLOCK_N=32, BLOCK_K=128,
          TILES=4, USE_PDL=True, GATED=True), 2, 1),
    ("asyncengine_kernels.fp8_linear", "_fp8_gemm_kernel",
     dict(HAS_BIAS=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8), 8, 3),
    ("asyncengine_kernels.fp8_linear", "_fp8_gemm_kernel",
     dict(HAS_BIAS=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8), 4, 4),
    ("asyncengine_kernels.fp8_linear", "_fp8_gemv_kernel",
     dict(HAS_BIAS=False, EVEN_K=True, GATED=False, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512), 4, 4),
    ("asyncengine_kernels.fp8_linear", "_fp8_gemv_kernel",
     dict(HAS_BIAS=False, EVEN_K=True, GATED=True, BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024), 4, 3),
    ("asyncengine_kernels.fp8_linear", "_fp8_gemv_kernel",
     dict(HAS_BIAS=True, EVEN_K=False, GATED=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256), 4, 4),
    ("asyncengine_kernels.fp8_linear", "_fp8_gemv_kernel",
     dict(HAS_BIAS=False, EVEN_K=True, GATED=True, BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024), 4, 3),
    ("asyncengine_kernels.fp8_linear", "_fp8_gemv_kernel",
     dict(HAS_BIAS=True, EVEN_K=True, GATED=True, BLOCK_M=1, BLOCK_N=16, BLOCK_K=512,
          USE_PDL=True, SPLIT_K=8), 4, 4),
    ("asyncengine_kernels.fp8_linear", "_quantize_rows_kernel",
     dict(GATED=False, NORM=True, HAS_RESIDUAL=True, STATIC=False, K_PAD=4096), 8, 1),
    ("asyncengine_kernels.fp8_linear", "_quantize_rows_kernel",
     dict(GATED=True, NORM=False, HAS_RESIDUAL=False, STATIC=True, K_PAD=16384), 16, 1),
    ("asyncengine_kernels.rms_norm", "_rms_norm_kernel",
     dict(N=4096, BLOCK=4096, HAS_RESIDUAL=True, USE_PDL=True), 8, 1),
    ("asyncengine_kernels.rotary_kv_cache", "_rotary_and_write_kv_kernel",
     dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64, HQ_PAD=32, HKV_PAD=8,
          HALF_PAD=64, REST_PAD=0, D_PAD=128, BLOCK_SIZE=16, USE_PDL=True), 4, 1),
    # FP8 KV cache: split-KV decode (MHA, and GQA with rotary fused), short-query and
    # prefill tiles, and the two cache writers; MHA decode's CUDA-core tiles (VECTOR: one
    # query row): unsplit as many-program launches take them (one warp), with V requested
    # after the scores and with the loop pipelined (sweep options), and split with rotary
    # fused.
    ("asyncengine_kernels.paged_attention", "_paged_attention_kernel",
     dict(ATTENTION, GROUP=1, BLOCK_M=1, BLOCK_Q=1, TILE=32, NUM_SEGMENTS=1, DECODE=True,
          ROTARY=False, KV_FP8=True, KV_DOT_F16=True, HEAD_MAJOR=True, VECTOR=True), 1, 2),
    ("asyncengine_kernels.paged_attention", "_paged_attention_kernel",
     dict(ATTENTION, GROUP=1, BLOCK_M=1, BLOCK_Q=1, TILE=64, NUM_SEGMENTS=1, DECODE=True,
          ROTARY=False, KV_FP8=True, KV_DOT_F16=True, HEAD_MAJOR=True, VECTOR=True,
          LATE_V=True), 1, 2),
    ("asyncengine_kernels.paged_attention", "_paged_attention_kernel",
     dict(ATTENTION, GROUP=1, BLOCK_M=1, BLOCK_Q=1, TILE=32, NUM_SEGMENTS=1, DECODE=True,
          ROTARY=False, KV_FP8=True, KV_DOT_F16=True, HEAD_MAJOR=True, VECTOR=True,
          KV_STAGES=3), 4, 2),
    ("asyncengine_kernels.paged_attention", "_paged_attention_kernel",
     dict(ATTENTION, GROUP=1, BLOCK_M=1, BLOCK_Q=1, TILE=32, NUM_SEGMENTS=16, DECODE=True,
          ROTARY=True, KV_FP8=True, KV_DOT_F16=True, VECTOR=True), 4, 2),
    ("asyncengine_kernels.paged_attention", "_paged_attention_kernel",
     dict(ATTENTION, GROUP=1, BLOCK_M=16, BLOCK_Q=16, TILE=32, NUM_SEGMENTS=16, DECODE=True,
          ROTARY=False, KV_FP8=True, KV_DOT_F16=True), 4, 2),
    ("asyncengine_kernels.paged_attention", "_paged_attention_kernel",
     dict(ATTENTION, GROUP=4, BLOCK_M=16, BLOCK_Q=4, TILE=64, NUM_SEGMENTS=16, DECODE=True,
          ROTARY=True, KV_FP8=True, KV_DOT_F16=True), 4, 2),
    ("asyncengine_kernels.paged_attention", "_paged_attention_kernel",
     dict(ATTENTION, GROUP=4, BLOCK_M=16, BLOCK_Q=4, TILE=64, NUM_SEGMENTS=1, DECODE=False,
          ROTARY=False, KV_FP8=True, KV_DOT_F16=True), 4, 2),
    ("asyncengine_kernels.paged_attention", "_paged_attention_kernel",
     dict(ATTENTION, GROUP=4, BLOCK_M=64, BLOCK_Q=16, TILE=64, NUM_SEGMENTS=1, DECODE=False,
          ROTARY=False, KV_FP8=True, KV_DOT_F16=True), 4, 2),
    ("asyncengine_kernels.prefill_attention", "_prefill_attention_kernel",
     dict(PREFILL, GROUP=4, BLOCK_Q=32, KV_FP8=True, KV_DOT_F16=True), 8, 3),
    ("asyncengine_kernels.rotary_kv_cache", "_rotary_and_write_kv_kernel",
     dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64, HQ_PAD=32, HKV_PAD=8,
          HALF_PAD=64, REST_PAD=0, D_PAD=128, BLOCK_SIZE=16, USE_PDL=True, KV_FP8=True), 4, 1),
    ("asyncengine_kernels.kv_cache_write", "_write_kv_cache_kernel",
     dict(NUM_KV_HEADS=8, HEAD_DIM=128, H_PAD=8, D_PAD=128, BLOCK_SIZE=16, KV_FP8=True), 4, 1),
]  # fmt: skip


def lower_variant(
    module: str, kernel: str, constexprs: dict[str, Any], num_warps: int, num_stages: int, arch: int
) -> Any:
    """Compile one variant; returns Triton's compiled kernel (`.asm["ptx"]`, `["cubin"]`).

    Pointers and `stride_*` arguments (and the integers of `KERNEL_ALIGNED`) get the
    16-divisibility a launch at Llama sizes gives them (torch allocations are 16-byte
    aligned, head and row strides multiples of 16), except those the kernel keeps
    unspecialized: without it the compiler cannot prove 16-byte vector loads and lowers a
    different (scalar, unpipelined) kernel than the GPU runs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), kernel)
    sig = inspect.signature(fn.fn).parameters
    params = list(sig)
    # Constexprs a variant leaves out take their defaults, as in a launch that omits them.
    defaults = {p: v.default for p, v in sig.items() if v.default is not inspect.Parameter.empty}
    constexprs = {**defaults, **constexprs}
    signature = {}
    pointers = {**POINTER_TYPES, **(FP8_KV_POINTERS if constexprs.get("KV_FP8") else {}),
                **(FP8_WEIGHT_POINTERS if constexprs.get("HAS_SCALE") else {}),
                **KERNEL_POINTERS.get(kernel, {})}  # fmt: skip
    if constexprs.get("PAIRS") and kernel == "_gemv_rows_kernel":
        pointers["w_ptr"] = "*i32"  # e4m3 rows read as 4-byte words
    for p in params:
        if p in constexprs:
            signature[p] = "constexpr"
        elif p.endswith("_ptr"):
            signature[p] = pointers.get(p, "*bf16")
        else:
            signature[p] = "fp32" if p in FLOAT_SCALARS else "i32"
    unspecialized = {p.name for p in fn.params if p.do_not_specialize}
    aligned = [
        i for i, p in enumerate(params)
        if signature[p] != "constexpr" and p not in unspecialized
        and (p.endswith("_ptr") or p.startswith("stride_") or p in KERNEL_ALIGNED.get(kernel, ()))
    ]  # fmt: skip
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(params.index(k),): v for k, v in constexprs.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(
        src, target=target, options={"num_warps": num_warps, "num_stages": num_stages}
    )


# The Gluon Hopper prefill kernel (`asyncengine_kernels.prefill_attention_hopper`): W2's GQA group
# of 4 and W1's 1 at the default tiles (with and without ping-pong), and 128-key tiles without
# the overlap.
GLUON_VARIANTS = [
    dict(GROUP=4, TILE=64, NUM_STAGES=4, PIPELINE=True, PINGPONG=False),
    dict(GROUP=1, TILE=64, NUM_STAGES=4, PIPELINE=True, PINGPONG=True),
    dict(GROUP=8, TILE=128, NUM_STAGES=2, PIPELINE=False, PINGPONG=False),
]


def lower_hopper_prefill(constexprs: dict[str, Any], arch: int) -> Any:
    """Compile one variant of the Gluon prefill kernel: its K/V arrive as TMA descriptors of
    [16, 64] bf16 boxes, which the signature names with their shared-memory layout."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from asyncengine_kernels import prefill_attention_hopper as hopper

    fn = hopper._hopper_prefill_kernel
    layout = gl.NVMMASharedLayout.get_default_for([16, 64], gl.bfloat16)
    desc = f"tensordesc<bf16[16, 64],{layout!r}>"
    consts = {**constexprs, "BLOCK_Q": 128 // constexprs["GROUP"], "BLOCK_SIZE": 16}
    signature = {p: "i32" for p in fn.arg_names}
    signature.update(q_ptr="*bf16", out_ptr="*bf16", k_desc=desc, v_desc=desc,
                     block_tables_ptr="*i32", query_start_loc_ptr="*i32", seq_lens_ptr="*i32",
                     scale_log2="fp32")  # fmt: skip
    signature.update({k: "constexpr" for k in consts})
    src = GluonASTSource(
        fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
        attrs={},
    )  # fmt: skip
    return triton.compile(
        src, target=GPUTarget("cuda", arch, 32),
        options={"num_warps": 4, "maxnreg": hopper._MAXNREG},
    )  # fmt: skip


# The Gluon int4/int8 wgmma matmul (`asyncengine_kernels.quant_wgmma`): one and 16 rows with the
# scale on the accumulator, 32-128 rows with it on either side, symmetric and with zero points.
QUANT_WGMMA_VARIANTS = [
    dict(BITS=4, ROWS=8, K_SPLIT=512, GROUP_ITERS=1, HAS_ZERO=False, HAS_BIAS=False,
         SCALE_ON_ACC=True, SPLIT_K=True, USE_PDL=True),
    dict(BITS=4, ROWS=16, K_SPLIT=1024, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=True, SPLIT_K=True),
    dict(BITS=4, ROWS=64, K_SPLIT=256, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=False,
         SCALE_ON_ACC=False, SPLIT_K=False),
    dict(BITS=8, ROWS=8, K_SPLIT=512, GROUP_ITERS=1, HAS_ZERO=False, HAS_BIAS=False,
         SCALE_ON_ACC=True, SPLIT_K=True, USE_PDL=True),
    dict(BITS=8, ROWS=16, K_SPLIT=1024, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=True, SPLIT_K=True),
    dict(BITS=8, ROWS=64, K_SPLIT=256, GROUP_ITERS=1, HAS_ZERO=False, HAS_BIAS=False,
         SCALE_ON_ACC=False, SPLIT_K=False),
    dict(BITS=8, ROWS=32, K_SPLIT=256, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=False,
         SCALE_ON_ACC=False, SPLIT_K=True),
    # 17-128 rows a launch: the activations stream through a ring of chunks.
    dict(BITS=4, ROWS=32, K_SPLIT=2048, GROUP_ITERS=1, HAS_ZERO=False, HAS_BIAS=False,
         SCALE_ON_ACC=True, SPLIT_K=True, USE_PDL=True, X_RING=4),
    dict(BITS=4, ROWS=64, K_SPLIT=1920, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=False, SPLIT_K=True, X_RING=4),
    dict(BITS=8, ROWS=32, K_SPLIT=2048, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=False, SPLIT_K=True, X_RING=4),
    dict(BITS=8, ROWS=64, K_SPLIT=1920, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=False, SPLIT_K=True, X_RING=4),
    dict(BITS=4, ROWS=128, K_SPLIT=4096, GROUP_ITERS=1, HAS_ZERO=False, HAS_BIAS=False,
         SCALE_ON_ACC=False, SPLIT_K=False, X_RING=4),
    dict(BITS=4, ROWS=128, K_SPLIT=2048, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=False, SPLIT_K=True, X_RING=4),
    # int8 at 65-256 rows: the ring, 128 rows a launch.
    dict(BITS=8, ROWS=128, K_SPLIT=4096, GROUP_ITERS=1, HAS_ZERO=False, HAS_BIAS=False,
         SCALE_ON_ACC=False, SPLIT_K=False, X_RING=4),
    dict(BITS=8, ROWS=128, K_SPLIT=2048, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=False, SPLIT_K=True, X_RING=4),
    # fp16 activations (most GPTQ checkpoints' dtype), and groups of 64 input features.
    dict(BITS=4, ROWS=8, K_SPLIT=512, GROUP_ITERS=1, HAS_ZERO=False, HAS_BIAS=False,
         SCALE_ON_ACC=True, SPLIT_K=True, USE_PDL=True, F16=True),
    dict(BITS=4, ROWS=64, K_SPLIT=1920, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=False, SPLIT_K=True, X_RING=4, F16=True),
    dict(BITS=8, ROWS=16, K_SPLIT=1024, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=True, SPLIT_K=True, F16=True),
    dict(BITS=8, ROWS=128, K_SPLIT=2048, GROUP_ITERS=1, HAS_ZERO=False, HAS_BIAS=False,
         SCALE_ON_ACC=False, SPLIT_K=True, X_RING=4, F16=True),
    dict(BITS=4, ROWS=8, K_SPLIT=512, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=False,
         SCALE_ON_ACC=True, SPLIT_K=True, USE_PDL=True, GROUP_64=True),
    dict(BITS=4, ROWS=32, K_SPLIT=2048, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=False,
         SCALE_ON_ACC=True, SPLIT_K=True, X_RING=4, GROUP_64=True, F16=True),
    dict(BITS=4, ROWS=128, K_SPLIT=2048, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=False, SPLIT_K=True, X_RING=4, GROUP_64=True),
    dict(BITS=8, ROWS=16, K_SPLIT=1024, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=True, SPLIT_K=True, GROUP_64=True),
    dict(BITS=8, ROWS=64, K_SPLIT=256, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=False,
         SCALE_ON_ACC=False, SPLIT_K=False, GROUP_64=True, F16=True),
    # The asynchronous wgmma (the next operand formed while a chunk's wgmma runs; planned
    # above 64 rows): the ring at 128 and 64 rows, int4 and int8, and the whole slice at 64.
    dict(BITS=4, ROWS=128, K_SPLIT=4096, GROUP_ITERS=1, HAS_ZERO=False, HAS_BIAS=False,
         SCALE_ON_ACC=False, SPLIT_K=False, X_RING=4, ASYNC_MMA=True),
    dict(BITS=4, ROWS=128, K_SPLIT=2816, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=False,
         SCALE_ON_ACC=False, SPLIT_K=True, X_RING=4, ASYNC_MMA=True),
    dict(BITS=4, ROWS=64, K_SPLIT=1920, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=False, SPLIT_K=True, X_RING=4, ASYNC_MMA=True, F16=True),
    dict(BITS=8, ROWS=128, K_SPLIT=2048, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=False, SPLIT_K=True, X_RING=4, ASYNC_MMA=True, GROUP_64=True),
    dict(BITS=8, ROWS=64, K_SPLIT=256, GROUP_ITERS=1, HAS_ZERO=False, HAS_BIAS=False,
         SCALE_ON_ACC=False, SPLIT_K=False, ASYNC_MMA=True),
    dict(BITS=4, ROWS=128, K_SPLIT=2048, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=False,
         SCALE_ON_ACC=False, SPLIT_K=True, X_RING=4, GROUP_32=True, ASYNC_MMA=True),
    # Groups of 32: two a chunk, the scale on the weights.
    dict(BITS=4, ROWS=8, K_SPLIT=512, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=False,
         SCALE_ON_ACC=False, SPLIT_K=True, USE_PDL=True, GROUP_32=True, F16=True),
    dict(BITS=4, ROWS=128, K_SPLIT=2048, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=False, SPLIT_K=True, X_RING=4, GROUP_32=True),
    dict(BITS=8, ROWS=16, K_SPLIT=1024, GROUP_ITERS=1, HAS_ZERO=True, HAS_BIAS=True,
         SCALE_ON_ACC=False, SPLIT_K=True, GROUP_32=True),
    dict(BITS=8, ROWS=128, K_SPLIT=2048, GROUP_ITERS=1, HAS_ZERO=False, HAS_BIAS=False,
         SCALE_ON_ACC=False, SPLIT_K=True, X_RING=4, GROUP_32=True, F16=True),
]  # fmt: skip


def lower_quant_wgmma(constexprs: dict[str, Any], arch: int) -> Any:
    """Compile one variant of the Gluon int4/int8 wgmma matmul."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from asyncengine_kernels import quant_wgmma

    fn = quant_wgmma._quant_wgmma_kernel
    signature = {p: "i32" for p in fn.arg_names}
    half = "*fp16" if constexprs.get("F16") else "*bf16"
    signature.update(w_ptr="*i32", s_ptr=half, z_ptr=half, x_ptr=half, b_ptr=half, y_ptr=half,
                     part_ptr="*fp32", count_ptr="*i32")  # fmt: skip
    constexprs = {"USE_PDL": False, "X_RING": 0, "F16": False, "GROUP_64": False,
                  "GROUP_32": False, "ASYNC_MMA": False, **constexprs}  # the kernel's defaults
    signature.update({k: "constexpr" for k in constexprs})
    aligned = [fn.arg_names.index(p) for p in signature if p.endswith("_ptr")]
    aligned += [fn.arg_names.index(p) for p in ("N", "K", "stride_xm", "stride_ym")]
    src = GluonASTSource(
        fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )  # fmt: skip
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def _cubin_tool(compiled: Any, tool: str, *args: str) -> str:
    """What one of the CUDA tools Triton bundles (`cuobjdump`, `nvdisasm`) prints for a
    compiled variant's cubin."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run(
            [str(tools / tool), *args, f.name], capture_output=True, text=True
        ).stdout


# One instruction of `nvdisasm -c`: its address in a comment, a predicate, the opcode.
_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sass_ops(compiled: Any) -> tuple[list[str], str]:
    """The opcodes of a compiled variant's machine code, in order, and its resource usage
    (`cuobjdump -res-usage`)."""
    sass = _cubin_tool(compiled, "nvdisasm", "-c")
    ops = [m.group(1) for line in sass.splitlines() if (m := _SASS_LINE.match(line))]
    return ops, _cubin_tool(compiled, "cuobjdump", "-res-usage")


def sass_digest(compiled: Any) -> str:
    """A short digest of a compiled variant's machine code, its instructions without their
    addresses: equal digests, equal code (the cubin's bytes also hold line information, which
    moves with any edit of the source file)."""
    sass = _cubin_tool(compiled, "nvdisasm", "-c")
    lines = [re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in sass.splitlines()
             if _SASS_LINE.match(line)]  # fmt: skip
    return hashlib.md5("\n".join(lines).encode()).hexdigest()[:12]


def asm_stats(compiled: Any) -> dict[str, int]:
    """What the machine code of a compiled variant uses: registers and local-memory (spill)
    bytes per thread, spill instructions (LDL/STL), tensor-core instructions (HGMMA = wgmma;
    HMMA = the older mma.sync) and asynchronous global-to-shared copies (LDGSTS = cp.async)."""
    ops, usage = sass_ops(compiled)
    stats = {}
    for key, name in (("REG", "regs"), ("LOCAL", "local_bytes")):
        found = re.search(rf"\b{key}:(\d+)", usage)
        stats[name] = int(found.group(1)) if found else -1
    for op in ("HGMMA", "HMMA", "LDGSTS", "LDL", "STL"):
        stats[op] = ops.count(op)
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200)")
    ap.add_argument("--only", help="compile only the variants of kernels whose module contains "
                    "this, e.g. quant")  # fmt: skip
    ap.add_argument("--fp8-kv", action="store_true", help="only the FP8 KV-cache variants")
    ap.add_argument("--asm-stats", action="store_true", help="also report registers, spills, "
                    "tensor-core and async-copy instructions of each variant")  # fmt: skip
    ap.add_argument("--sass-digest", action="store_true", help="also report a digest of each "
                    "variant's machine code (`sass_digest`)")  # fmt: skip
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    failed = 0
    variants = [v for v in VARIANTS if args.only is None or args.only in v[0]]
    if args.fp8_kv:
        variants = [v for v in variants if v[2].get("KV_FP8")]
    jobs = [
        (kernel, constexprs, lambda v=(module, kernel, constexprs, warps, stages):
            lower_variant(*v, args.arch))
        for module, kernel, constexprs, warps, stages in variants
    ]  # fmt: skip
    from asyncengine_kernels import prefill_attention_hopper as hopper

    if hopper.available() and not args.fp8_kv and args.only in (None, "prefill", "hopper"):
        jobs += [
            ("_hopper_prefill_kernel", c, lambda c=c: lower_hopper_prefill(c, args.arch))
            for c in GLUON_VARIANTS
        ]
    from asyncengine_kernels import quant_wgmma

    if quant_wgmma.available() and not args.fp8_kv and args.only in (None, "quant", "wgmma"):
        jobs += [
            ("_quant_wgmma_kernel", c, lambda c=c: lower_quant_wgmma(c, args.arch))
            for c in QUANT_WGMMA_VARIANTS
        ]
    for kernel, constexprs, lower in jobs:
        flags = {k: v for k, v in constexprs.items() if isinstance(v, bool) and v}
        t0 = time.perf_counter()
        try:
            compiled = lower()
            row = {"kernel": kernel, "on": sorted(flags), "cubin_bytes": len(compiled.asm["cubin"])}
            if kernel in ("_hopper_prefill_kernel", "_quant_wgmma_kernel"):
                row["config"] = {k: v for k, v in constexprs.items() if not isinstance(v, bool)}
            if args.asm_stats:
                row.update(asm_stats(compiled))
            if args.sass_digest:
                row["sass"] = sass_digest(compiled)
        except Exception as exc:  # report every variant, then fail
            failed += 1
            row = {"kernel": kernel, "on": sorted(flags), "error": repr(exc)[:400]}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)
    print(json.dumps({"compiled": len(jobs) - failed, "failed": failed, "arch": args.arch}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
