"""Launch the integer wgmma matmul (synchronous and, where the scale is on the weights,
asynchronous) and bf16 cuBLAS once each on Llama-2-7B layers, inside a profiler range, for
Nsight Compute to read their counters (tensor-pipe and L2 use, warp stalls, occupancy):
where the 128- and 256-row launches lose to cuBLAS.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section WarpStateStats python3 scripts/profile_wgmma.py --rows 128 256

Compilation and warm-up run before the range opens, so only the measured launches are
profiled; the script prints the order they run in (one line per launch) and each one's
CUDA-event time outside the profiler, so the report's kernels can be matched to them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine_kernels import quant_wgmma as wg
from asyncengine_kernels.quant_linear import dequantize_weight, pack_int_weight

# (N, K) of a Llama-2-7B layer's four matmuls, q/k/v and gate/up fused.
LAYERS = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096),
          "down": (4096, 11008)}  # fmt: skip


def event_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Median milliseconds of `fn` by CUDA events (L2 holds what a repeated call rereads)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--layers", nargs="+", default=["gate_up", "down"], choices=LAYERS)
    parser.add_argument("--bits", type=int, default=4, choices=wg.BITS)
    parser.add_argument("--group", type=int, default=128)
    args = parser.parse_args()
    if not (torch.cuda.is_available() and wg.available()):
        sys.exit("needs an sm_90 GPU and Triton's Gluon")

    torch.manual_seed(0)
    launches: list[tuple[dict, Callable[[], object]]] = []
    for name in args.layers:
        n, k = LAYERS[name]
        q = torch.randint(0, 1 << args.bits, (n, k), device="cuda", dtype=torch.uint8)
        scales = torch.rand(k // args.group, n, device="cuda", dtype=torch.bfloat16) * 0.002
        zeros = torch.full_like(scales, float(1 << (args.bits - 1)))
        qweight = pack_int_weight(q, args.bits)
        words = wg.pack_quant_wgmma(qweight, args.bits)
        dense = dequantize_weight(qweight, scales, zeros, args.bits, args.group)
        dense = dense.t().contiguous()  # [N, K], as F.linear takes it
        counters = torch.zeros(n // wg.BLOCK_N, device="cuda", dtype=torch.int32)
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            per_launch = min(rows, wg.launch_max_rows(args.bits))
            cfg = wg.quant_wgmma_config(per_launch, n, k, args.group, bits=args.bits)
            case = {"layer": name, "n": n, "k": k, "rows": rows}

            def cublas(x: torch.Tensor = x, w: torch.Tensor = dense) -> torch.Tensor:
                return torch.nn.functional.linear(x, w)

            def wgmma(x: torch.Tensor = x, w: torch.Tensor = words, s: torch.Tensor = scales,
                      z: torch.Tensor = zeros, c: torch.Tensor = counters,
                      cfg: wg.QuantWgmmaConfig = cfg) -> torch.Tensor:  # fmt: skip
                return wg.quant_wgmma_matmul(x, w, s, z, args.group, None, cfg, c,
                                             bits=args.bits, has_zero=False)  # fmt: skip

            launches.append(({**case, "impl": "bf16 cublas"}, cublas))
            forms = [cfg]
            if not cfg.scale_on_acc:  # the asynchronous form beside the synchronous one
                forms.append(dataclasses.replace(cfg, async_mma=True))
            for form in forms:
                launches.append(({**case, "impl": str(form), "launches": -(-rows // per_launch)},
                                 functools.partial(wgmma, cfg=form)))  # fmt: skip

    for _, fn in launches:  # compile and warm up outside the profiled range
        fn()
    torch.cuda.synchronize()
    for case, fn in launches:
        print(json.dumps({**case, "event_ms": round(event_ms(fn), 4)}), flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    for i, (case, fn) in enumerate(launches):
        fn()
        torch.cuda.synchronize()
        print(json.dumps({"profiled": i, **case}), flush=True)
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
