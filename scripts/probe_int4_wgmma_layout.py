"""Compile, for sm_90 and without a GPU, a prototype int4 matmul whose packed codes land in
wgmma's register operand with a layout conversion Gluon proves trivial.

The packing (docs/quantization.md, "int4 straight into wgmma's register operand"): one
32-bit word holds the eight values one lane needs for one 16-deep k step of a 16-row slab,
nibble e + 2 hi_r + 4 hi_c being the value at row slab * 16 + 8 hi_r + g and column
j * 16 + 8 hi_c + 2 q + e, for lane 4 g + q. If the packing did not match the fragment, the
`assert_trivial` conversion would fail to compile. The codes become bf16 two at a time, by
bit tricks in inline PTX: each pair of a row (nibbles i and i + 4) is OR'ed into the mantissas
of 128.0 (`lop3`), then ((128 + code) - (128 + zero)) * scale runs on the pair (`sub.bf16x2`,
`mul.rn.bf16x2`), both exact but the final rounding, as `dequantize_weight` rounds. The
scales are per row and 128-wide group; the zero point is the symmetric 8. There is no
pipelining: it is a probe for the layout and the instruction count, not a kernel the engine
runs.

It reports the machine code's registers and spills, and the instructions each thread adds
per weight value. That figure is measured as the difference between J = 4 and J = 2 k steps
a loop iteration, which is 16 values a thread.

  python scripts/probe_int4_wgmma_layout.py              # ROWS 16
  python scripts/probe_int4_wgmma_layout.py --rows 64
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
)

# Codes of a word -> (128 + code) as bf16 in pairs sharing a row (nibbles i, i + 4), then
# ((128 + code) - (128 + zero)) * scale on the pair: $8 the word, $9/$11 the scales of the
# word's two rows and $10/$12 their 128 + zero, each as a bf16x2 of the value twice.
_DEQUANT_PAIRS = gl.constexpr("""{
.reg .b32 a, b, c, d, t;
lop3.b32 a, $8, 0x000f000f, 0x43004300, 0xea;
shr.u32 t, $8, 4;
lop3.b32 b, t, 0x000f000f, 0x43004300, 0xea;
shr.u32 t, $8, 8;
lop3.b32 c, t, 0x000f000f, 0x43004300, 0xea;
shr.u32 t, $8, 12;
lop3.b32 d, t, 0x000f000f, 0x43004300, 0xea;
sub.bf16x2 a, a, $10;
sub.bf16x2 b, b, $10;
sub.bf16x2 c, c, $12;
sub.bf16x2 d, d, $12;
mul.rn.bf16x2 a, a, $9;
mul.rn.bf16x2 b, b, $9;
mul.rn.bf16x2 c, c, $11;
mul.rn.bf16x2 d, d, $11;
mov.b32 {$0, $4}, a;
mov.b32 {$1, $5}, b;
mov.b32 {$2, $6}, c;
mov.b32 {$3, $7}, d;
}""")


@gluon.jit
def _twice(bits16):
    """A 16-bit value's bits in both halves of an int32 (a bf16x2 operand)."""
    b = bits16.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return (b << 16) | b


@gluon.jit
def _probe_kernel(w_ptr, s_ptr, x_ptr, y_ptr, K, ROWS: gl.constexpr, J: gl.constexpr):
    """y^T [64, ROWS] = ((codes - 8) * scales) [64, K] @ x^T [K, ROWS], one warpgroup."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16]
    )
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    # Words [32 row pairs (slab, g), 4 (q), J k steps]: lanes over (g, q), warps over slabs.
    p_l: gl.constexpr = gl.BlockedLayout([1, 1, J], [8, 4, 1], [4, 1, 1], [2, 1, 0])
    pid = gl.program_id(0)
    n_p = gl.arange(0, 32, layout=gl.SliceLayout(1, gl.SliceLayout(2, p_l)))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, p_l)))
    j = gl.arange(0, J, layout=gl.SliceLayout(0, gl.SliceLayout(1, p_l)))
    steps = K // 16
    words_at = ((pid * 32 + n_p)[:, None, None] * 4 + q[None, :, None]) * steps + j[None, None, :]
    row_lo = pid * 64 + (n_p // 8) * 16 + n_p % 8  # the word's rows: row_lo and row_lo + 8
    spread = gl.zeros([32, 4, J], gl.int32, p_l)
    zero_pair = gl.full([32, 4, J], 0x43084308, gl.int32, p_l)  # (128 + 8) twice
    x_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
    b_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([16 * J, ROWS], gl.bfloat16)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [16 * J, ROWS], b_l)
    acc = gl.zeros([64, ROWS], gl.float32, acc_l)
    for k0 in range(0, steps, J):
        words = gl.load(w_ptr + words_at + k0)
        group = (k0 * 16) // 128
        s_lo = _twice(gl.load(s_ptr + row_lo * (K // 128) + group))[:, None, None] + spread
        s_hi = _twice(gl.load(s_ptr + (row_lo + 8) * (K // 128) + group))[:, None, None] + spread
        v = gl.inline_asm_elementwise(
            _DEQUANT_PAIRS, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r",
            [words, s_lo, zero_pair, s_hi, zero_pair], dtype=[gl.bfloat16] * 8, is_pure=True,
            pack=1,
        )  # fmt: skip
        lo_c = gl.join(gl.join(v[0], v[1]), gl.join(v[2], v[3]))
        hi_c = gl.join(gl.join(v[4], v[5]), gl.join(v[6], v[7]))
        t = gl.join(lo_c, hi_c)  # [row pairs, q, j, hi_c, hi_r, e]
        t = gl.reshape(t, [4, 8, 4, J, 2, 2, 2])  # [slab, g, q, j, hi_c, hi_r, e]
        t = gl.permute(t, [0, 5, 1, 3, 4, 2, 6])  # [slab, hi_r, g, j, hi_c, q, e]
        a = gl.convert_layout(gl.reshape(t, [64, 16 * J]), a_l, assert_trivial=True)
        offs_k = k0 * 16 + gl.arange(0, 16 * J, layout=gl.SliceLayout(1, x_l))
        offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, x_l))
        b_smem.store(gl.load(x_ptr + offs_r[None, :] * K + offs_k[:, None]))
        fence_async_shared()
        acc = warpgroup_mma(a, b_smem, acc)
    n = pid * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, acc_l))
    gl.store(y_ptr + r[None, :] * (gl.num_programs(0) * 64) + n[:, None], acc.to(gl.bfloat16))


def _compile(rows: int, j: int, arch: int) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _probe_kernel
    consts = {"ROWS": rows, "J": j}
    sig = {"w_ptr": "*i32", "s_ptr": "*bf16", "x_ptr": "*bf16", "y_ptr": "*bf16", "K": "i32",
           "ROWS": "constexpr", "J": "constexpr"}  # fmt: skip
    src = GluonASTSource(
        fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in range(5)},
    )  # fmt: skip
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def main() -> None:
    from scripts.compile_kernels import asm_stats, sass_ops

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16, help="activation rows (wgmma N)")
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    two, four = _compile(args.rows, 2, args.arch), _compile(args.rows, 4, args.arch)
    ptx = four.asm["ptx"]
    counts = {op: len(re.findall(re.escape(op), ptx))
              for op in ("ldmatrix", "st.shared", "shfl", "wgmma.mma_async")}  # fmt: skip
    extra = len(sass_ops(four)[0]) - len(sass_ops(two)[0])
    print(json.dumps({"rows": args.rows, "j": 4, "trivial_conversion": True,
                      **asm_stats(four), "ptx": counts,
                      "instructions_per_value": round(extra / 16, 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
