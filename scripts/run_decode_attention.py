"""Run one decode-attention launch at a throughput shape a few times, for a profiler to read.

`bench_kernels.py` times the kernel; this script only launches it, so that Nsight Compute
can be pointed at a single launch of a known configuration:

    ncu --clock-control none --kernel-name regex:_paged_attention_kernel --launch-skip 2 \
        --launch-count 1 --set full python3 scripts/run_decode_attention.py --workload W2 --kv fp8
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_kernels import DECODE_SHAPES, WORKLOADS, _attention_inputs

from asyncengine_kernels.paged_attention import paged_attention_triton


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(DECODE_SHAPES), default="W1")
    parser.add_argument("--kv", choices=("bf16", "fp8"), default="fp8")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument(
        "--tiles", default="{}", help="JSON overrides of the decode tile config (small_tiles)"
    )
    args = parser.parse_args()
    batch, ctx = DECODE_SHAPES[args.workload]
    inputs, nbytes, scales = _attention_inputs(
        [1] * batch, [ctx] * batch, *WORKLOADS[args.workload], kv_fp8=args.kv == "fp8"
    )
    out = torch.empty_like(inputs[0])
    tiles = json.loads(args.tiles)
    for _ in range(args.iters):
        paged_attention_triton(*inputs, out=out, decode_only=True, small_tiles=tiles, **scales)
    torch.cuda.synchronize()
    print(json.dumps({"workload": args.workload, "kv": args.kv, "bytes": nbytes, **tiles}))


if __name__ == "__main__":
    main()
