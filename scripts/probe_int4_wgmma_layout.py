"""Compile, for sm_90 and without a GPU, a prototype int4 matmul whose packed codes land in
wgmma's register operand with a layout conversion Gluon proves trivial.

The packing (docs/quantization.md, "int4 straight into wgmma's register operand"): one
32-bit word holds the eight values one lane needs for one 16-deep k step of a 16-row slab,
nibble e + 2 hi_r + 4 hi_c being the value at row slab * 16 + 8 hi_r + g and column
j * 16 + 8 hi_c + 2 q + e, for lane 4 g + q. If the packing did not match the fragment, the
`assert_trivial` conversion would fail to compile. The prototype has no scales, zero points
or pipelining: it is a probe for the layout, not a kernel the engine runs.

  python scripts/probe_int4_wgmma_layout.py              # ROWS 16, J 4
  python scripts/probe_int4_wgmma_layout.py --rows 64 --j 2
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
)


@gluon.jit
def _nibble(words, i: gl.constexpr):
    """Code i of every word, centred (symmetric int4: zero point 8)."""
    return ((words >> (4 * i)) & 0xF).to(gl.float32) - 8.0


@gluon.jit
def _probe_kernel(w_ptr, x_ptr, y_ptr, K, ROWS: gl.constexpr, J: gl.constexpr):
    """y^T [64, ROWS] = (codes - 8) [64, K] @ x^T [K, ROWS] for one warpgroup."""
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
    x_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
    b_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([16 * J, ROWS], gl.bfloat16)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [16 * J, ROWS], b_l)
    acc = gl.zeros([64, ROWS], gl.float32, acc_l)
    for k0 in range(0, steps, J):
        words = gl.load(w_ptr + words_at + k0)
        lo_c = gl.join(gl.join(_nibble(words, 0), _nibble(words, 1)),
                       gl.join(_nibble(words, 2), _nibble(words, 3)))  # fmt: skip
        hi_c = gl.join(gl.join(_nibble(words, 4), _nibble(words, 5)),
                       gl.join(_nibble(words, 6), _nibble(words, 7)))  # fmt: skip
        t = gl.join(lo_c, hi_c)  # [row pairs, q, j, hi_c, hi_r, e]
        t = gl.reshape(t, [4, 8, 4, J, 2, 2, 2])  # [slab, g, q, j, hi_c, hi_r, e]
        t = gl.permute(t, [0, 5, 1, 3, 4, 2, 6])  # [slab, hi_r, g, j, hi_c, q, e]
        a = gl.reshape(t, [64, 16 * J]).to(gl.bfloat16)
        a = gl.convert_layout(a, a_l, assert_trivial=True)
        offs_k = k0 * 16 + gl.arange(0, 16 * J, layout=gl.SliceLayout(1, x_l))
        offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, x_l))
        b_smem.store(gl.load(x_ptr + offs_r[None, :] * K + offs_k[:, None]))
        fence_async_shared()
        acc = warpgroup_mma(a, b_smem, acc)
    n = pid * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, acc_l))
    gl.store(y_ptr + r[None, :] * (gl.num_programs(0) * 64) + n[:, None], acc.to(gl.bfloat16))


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from scripts.compile_kernels import asm_stats

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16, help="activation rows (wgmma N)")
    ap.add_argument("--j", type=int, default=4, help="16-deep k steps a loop iteration")
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    fn = _probe_kernel
    consts = {"ROWS": args.rows, "J": args.j}
    sig = {"w_ptr": "*i32", "x_ptr": "*bf16", "y_ptr": "*bf16", "K": "i32",
           "ROWS": "constexpr", "J": "constexpr"}  # fmt: skip
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    src = GluonASTSource(
        fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
        attrs=aligned,
    )  # fmt: skip
    compiled = triton.compile(src, target=GPUTarget("cuda", args.arch, 32),
                              options={"num_warps": 4})  # fmt: skip
    ptx = compiled.asm["ptx"]
    counts = {op: len(re.findall(re.escape(op), ptx))
              for op in ("ldmatrix", "st.shared", "shfl", "wgmma.mma_async")}  # fmt: skip
    print(json.dumps({"rows": args.rows, "j": args.j, "trivial_conversion": True,
                      **asm_stats(compiled), "ptx": counts}))  # fmt: skip


if __name__ == "__main__":
    main()
