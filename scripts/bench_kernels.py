"""Time the Triton kernels at Llama-2-7B (W1: 32 heads MHA) and Llama-3-8B (W2: 32/8 GQA) sizes.

Prints one JSON line per case: time (median of CUDA-event timings after warm-up), achieved
GB/s and its fraction of the H200's measured copy rate (4.25 TB/s), or TFLOP/s against
787.5 for compute-bound prefill attention. Attention bytes count K/V read plus q and out.

    python scripts/bench_kernels.py            # all kernels
    python scripts/bench_kernels.py --only sweep   # decode tile/split sweep only
    python scripts/bench_kernels.py --only prefill # causal prefill 2k-8k: unified, Triton
                                                   # and Gluon prefill kernels, config sweeps
    python scripts/bench_kernels.py --only quant   # int4/int8 weight-only GEMV and GEMM
    python scripts/bench_kernels.py --only quant --quant-rows 16 64 128 256 --quant-shapes w1
    python scripts/bench_kernels.py --only int4    # int4 at 1-64 rows: wgmma kernel vs the rest
    python scripts/bench_kernels.py --only int8    # the same in int8
    python scripts/bench_kernels.py --only fp8     # FP8 GEMV, GEMMs, activation quantization
    python scripts/bench_kernels.py --only fp8row  # FP8 one-row GEMVs with their input forms
    python scripts/bench_kernels.py --only kvfp8   # decode attention, e4m3 cache beside bf16
    python scripts/bench_kernels.py --only skinny  # 1-16 row matmuls: few-row Triton vs cuBLAS

Quantized matmuls count the packed codes, the bf16 scales and zeros, x and y as bytes. FP8
rows count the e4m3 weights, float32 scales, x and y; the W8A8 GEMMs' TFLOP/s are also given
against the H200's dense FP8 peak (1979), and each GEMM row names the rows' activation
quantization time separately (`quant_ms`) from the GEMM's.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HBM_GBPS = 4250.0  # measured device-to-device copy rate of an H200
BF16_TFLOPS = 787.5  # measured dense bf16 matmul rate of an H200
FP8_TFLOPS = 1979.0  # the H200's published dense FP8 tensor-core rate
WORKLOADS = {"W1": (32, 32), "W2": (32, 8)}  # (q heads, kv heads), head_dim 128
# (batch, keys) of each workload's decode steps: W1's mean context is 640 keys.
DECODE_SHAPES = {"W1": (256, 640), "W2": (256, 1500)}
HEAD_DIM, HIDDEN, BLOCK_SIZE = 128, 4096, 16
INTERMEDIATE = {"W1": 11008, "W2": 14336}
VOCAB = {"W1": 32000, "W2": 128256}


def bench(fn: Callable[[], Any], warmup: int = 3, iters: int = 20, inner: int = 10) -> float:
    """Median milliseconds of one `fn` call: CUDA-graph replays of `inner` calls, timed with
    CUDA events, so Python launch overhead is left out (eager timing if capture fails)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        graph.replay()
    except Exception:
        graph = None
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(inner):
                fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    times.sort()
    return times[len(times) // 2]


def emit(kernel: str, shape: dict[str, Any], ms: float, nbytes: float = 0.0, flops: float = 0.0):
    row: dict[str, Any] = {"kernel": kernel, **shape, "ms": round(ms, 4)}
    if nbytes:
        gbps = nbytes / ms / 1e6
        row.update(gbps=round(gbps, 1), frac_hbm=round(gbps / HBM_GBPS, 3))
    if flops:
        tflops = flops / ms / 1e9
        row.update(tflops=round(tflops, 1), frac_bf16=round(tflops / BF16_TFLOPS, 3))
    print(json.dumps(row), flush=True)


def run_case(kernel: str, shape: dict[str, Any], fn: Callable[..., None], **kwargs: Any) -> None:
    """Run `fn(shape=shape, **kwargs)`; a failure prints an error line and the script goes on."""
    try:
        fn(shape=shape, **kwargs)
    except Exception as exc:  # a shape that does not fit must not stop the other cases
        print(json.dumps({"kernel": kernel, **shape, "error": repr(exc)[:300]}), flush=True)
        traceback.print_exc(file=sys.stderr)
    finally:
        torch.cuda.empty_cache()


def _attention_inputs(
    q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
    kv_fp8: bool = False,
) -> tuple[tuple, int, dict[str, torch.Tensor]]:
    """Random bf16 batch with shuffled blocks (an e4m3 cache with `kv_fp8`); returns (args,
    bytes of K/V read + q + out, the cache's scales as keyword arguments: none for bf16)."""
    dev, dt = "cuda", torch.bfloat16
    blocks = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    max_blocks = max([*blocks, 1])
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=dev).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = perm[used : used + n]
        used += n
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    q = torch.randn(int(qsl[-1]), num_heads, HEAD_DIM, device=dev, dtype=dt)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    if kv_fp8:
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    args = (q, k_cache, v_cache, tables, qsl.to(dev), lens, HEAD_DIM**-0.5)
    scales: dict[str, torch.Tensor] = {}
    if kv_fp8:
        scales = {name: torch.ones(num_kv_heads, device=dev) for name in ("k_scale", "v_scale")}
    kv_bytes = 2 * sum(seq_lens) * num_kv_heads * HEAD_DIM * k_cache.element_size()
    return args, kv_bytes + 2 * q.numel() * 2, scales


def _attention_case(
    shape: dict[str, Any],
    q_lens: list[int],
    seq_lens: list[int],
    heads: tuple[int, int],
    causal_flops: bool = False,
    **kwargs: Any,
) -> None:
    from asyncengine_kernels.paged_attention import paged_attention_triton

    args, nbytes, _ = _attention_inputs(q_lens, seq_lens, *heads)
    out = torch.empty_like(args[0])
    ms = bench(lambda: paged_attention_triton(*args, out=out, **kwargs))
    flops = 0.0
    if causal_flops:  # QK^T and PV over the causal triangle (+ prefix) of every query
        flops = sum(
            4.0 * heads[0] * HEAD_DIM * (s - q + j + 1)
            for q, s in zip(q_lens, seq_lens, strict=True)
            for j in range(q)
        )
    emit("paged_attention", shape, ms, nbytes=nbytes, flops=flops)


def bench_attention() -> None:
    from asyncengine_kernels.paged_attention import decode_plan

    for wl, heads in WORKLOADS.items():
        for ctx in (640, 2000):
            for bsz in (1, 32, 256):
                # The split count the engine's runner would plan for this step.
                segments = decode_plan(bsz, heads[1], torch.device("cuda"), ctx).segments
                shape = {"workload": wl, "mode": "decode", "batch": bsz, "ctx": ctx}
                run_case(
                    "paged_attention", shape, _attention_case,
                    q_lens=[1] * bsz, seq_lens=[ctx] * bsz, heads=heads, decode_only=True,
                    num_segments=segments,
                )  # fmt: skip
        for num, qlen in ((8, 512), (1, 4096)):
            shape = {"workload": wl, "mode": "prefill", "batch": num, "q_len": qlen}
            run_case(
                "paged_attention", shape, _attention_case, q_lens=[qlen] * num,
                seq_lens=[qlen] * num, heads=heads, causal_flops=True, max_query_len=qlen,
            )  # fmt: skip
        # A mixed step: a 512-token chunk over a 1536-token prefix plus 63 decodes at 1000.
        shape = {"workload": wl, "mode": "mixed", "batch": 64, "chunk": 512}
        run_case(
            "paged_attention", shape, _attention_case, q_lens=[512] + [1] * 63,
            seq_lens=[2048] + [1000] * 63, heads=heads, causal_flops=True, max_query_len=512,
        )  # fmt: skip


def _sweep_case(
    shape: dict[str, Any], args: tuple, out: torch.Tensor, nbytes: int, cfg: dict[str, int],
    scales: dict[str, torch.Tensor] | None = None,
) -> None:
    from asyncengine_kernels.paged_attention import paged_attention_triton

    ms = bench(
        lambda: paged_attention_triton(
            *args, out=out, decode_only=True, num_segments=shape["segments"],
            small_tiles=cfg, **(scales or {}),
        ),
        warmup=2,
        iters=5,
    )
    emit("sweep_decode", shape, ms, nbytes=nbytes)


def sweep_decode(batches: list[int], contexts: list[int]) -> None:
    """Decode configs (tile, stages) x split counts, to tune the host heuristics."""
    for wl, heads in WORKLOADS.items():
        for ctx in contexts:
            for bsz in batches:
                args, nbytes, _ = _attention_inputs([1] * bsz, [ctx] * bsz, *heads)
                out = torch.empty_like(args[0])
                configs = itertools.product((32, 64, 128), (2,), (1, 4, 8, 16, 32))
                for tile, stages, segs in configs:
                    shape = {"workload": wl, "batch": bsz, "ctx": ctx, "tile": tile,
                             "stages": stages, "segments": segs}  # fmt: skip
                    cfg = {"TILE": tile, "num_stages": stages}
                    run_case("sweep_decode", shape, _sweep_case, args=args, out=out,
                             nbytes=nbytes, cfg=cfg)  # fmt: skip


def sweep_fp8_kv_decode() -> None:
    """Decode attention over an e4m3 cache beside the bf16 cache.

    At the throughput shapes (W1: 256 x 640 keys, the run's mean context; W2: 256 x 1500,
    unsplit): the default tiles of each. For MHA, the MMA tiles the CUDA-core ones replaced
    (one warp, 32 keys, 3 stages, 168 registers) and the CUDA-core tiles (`VECTOR`) by tile
    and warps, with V requested early or after the scores (`LATE_V`). For GQA, one-warp
    MMA tiles by tile and stages. Then small batches (1 and 7 sequences over 4,000 keys,
    segments as `decode_plan` gives them), where MHA decode keeps the 16-row MMA tiles: the
    default against one-warp VECTOR tiles by tile, V early or late.

    Figures held within a call on three cache layouts (H200, 2026-12-05), but the 64- and
    128-key VECTOR tiles' moved between calls: compare configs within one run."""
    from asyncengine_kernels.paged_attention import decode_plan

    vector = [
        {"VECTOR": 1, "TILE": tile, "num_warps": warps, "num_stages": 2}
        for tile, warps in itertools.product((32, 64, 128), (1, 2))
    ]
    late_v = [{**cfg, "LATE_V": 1} for cfg in vector if cfg["num_warps"] == 1]
    for wl, heads in WORKLOADS.items():
        bsz, ctx = DECODE_SHAPES[wl]
        for kv_fp8 in (False, True):
            args, nbytes, scales = _attention_inputs(
                [1] * bsz, [ctx] * bsz, *heads, kv_fp8=kv_fp8
            )
            out = torch.empty_like(args[0])
            configs: list[dict[str, Any]] = [{}]
            if kv_fp8 and heads[0] == heads[1]:
                configs += [
                    {"VECTOR": 0, "TILE": 32, "num_warps": 1, "num_stages": 3, "maxnreg": 168},
                    *vector,
                    # Its loop pipelined: 0.911 against 0.888 in the one call that timed it.
                    {"VECTOR": 1, "TILE": 32, "num_warps": 1, "num_stages": 2, "KV_STAGES": 3},
                    # V requested after the scores: fewer registers, one more round trip.
                    *late_v,
                ]
            elif kv_fp8:
                configs += [
                    {"TILE": tile, "num_warps": 1, "num_stages": stages}
                    for tile, stages in itertools.product((32, 64), (2, 3))
                ]
            for cfg in configs:
                shape = {"workload": wl, "batch": bsz, "ctx": ctx, "segments": 1,
                         "kv": "fp8" if kv_fp8 else "bf16", **cfg}  # fmt: skip
                run_case("sweep_decode", shape, _sweep_case, args=args, out=out,
                         nbytes=nbytes, cfg=cfg, scales=scales)  # fmt: skip
    heads = WORKLOADS["W1"]
    for bsz in (1, 7):
        ctx = 4000
        segments = decode_plan(bsz, heads[1], torch.device("cuda"), ctx).segments
        args, nbytes, scales = _attention_inputs([1] * bsz, [ctx] * bsz, *heads, kv_fp8=True)
        out = torch.empty_like(args[0])
        for cfg in [{}, *[cfg for cfg in vector if cfg["num_warps"] == 1], *late_v]:
            shape = {"workload": "small", "batch": bsz, "ctx": ctx, "segments": segments,
                     "kv": "fp8", **cfg}  # fmt: skip
            run_case("sweep_decode", shape, _sweep_case, args=args, out=out,
                     nbytes=nbytes, cfg=cfg, scales=scales)  # fmt: skip


def _prefill_sweep_case(shape: dict[str, Any], heads: tuple[int, int], cfg: dict[str, int]) -> None:
    q_lens = [shape["q_len"]] * shape["batch"]
    _attention_case(
        shape, q_lens, q_lens, heads, causal_flops=True, max_query_len=q_lens[0], large_tiles=cfg
    )


def sweep_prefill() -> None:
    """Prefill-launch configs (`asyncengine_kernels.prefill_attention`) for causal prefill (8 x 512
    and 1 x 4096 tokens); `--only prefill` runs the narrower sweep at 2k-8k tokens."""
    for wl, heads in WORKLOADS.items():
        for (num, qlen), bm, tile, warps, stages in itertools.product(
            ((8, 512), (1, 4096)), (64, 128), (32, 64, 128), (4, 8), (1, 2, 3)
        ):
            cfg = {"BLOCK_M": bm, "TILE": tile, "num_warps": warps, "num_stages": stages}
            shape = {"workload": wl, "mode": "prefill_sweep", "batch": num, "q_len": qlen, **cfg}
            run_case("paged_attention", shape, _prefill_sweep_case, heads=heads, cfg=cfg)


# Causal prefill cases of `--only prefill`: (query lengths, context lengths) per sequence.
PREFILL_CASES = {
    "1x2048": ([2048], [2048]),
    "1x4096": ([4096], [4096]),
    "1x8192": ([8192], [8192]),
    "4x2048": ([2048] * 4, [2048] * 4),
    "chunk2048+prefix2048": ([2048], [4096]),
}
PREFILL_SWEEP_CASES = ("1x4096", "chunk2048+prefix2048")


def _prefill_impl_case(
    shape: dict[str, Any], q_lens: list[int], seq_lens: list[int], heads: tuple[int, int],
    hopper: bool, hopper_cfg: dict[str, int] | None = None, **kwargs: Any,
) -> None:
    """One causal prefill case with the Gluon Hopper kernel on or off (and its config)."""
    import asyncengine_kernels.prefill_attention as pf
    import asyncengine_kernels.prefill_attention_hopper as hp

    saved = (pf.HOPPER_PREFILL, dict(hp.HOPPER_PREFILL_CONFIG))
    pf.HOPPER_PREFILL = hopper
    hp.HOPPER_PREFILL_CONFIG.update(hopper_cfg or {})
    try:
        _attention_case(
            shape, q_lens, seq_lens, heads, causal_flops=True, max_query_len=max(q_lens),
            **kwargs,
        )  # fmt: skip
    finally:
        pf.HOPPER_PREFILL = saved[0]
        hp.HOPPER_PREFILL_CONFIG.clear()
        hp.HOPPER_PREFILL_CONFIG.update(saved[1])


# The Gluon kernel's configurations swept by `--only prefill` (PIPELINE: each consumer's
# softmax under its own previous P @ V; PINGPONG: the consumers' matrix products take turns).
HOPPER_SWEEP = (
    {"TILE": 64, "NUM_STAGES": 4, "PIPELINE": 1, "PINGPONG": 1},
    {"TILE": 64, "NUM_STAGES": 4, "PIPELINE": 0, "PINGPONG": 0},
    {"TILE": 128, "NUM_STAGES": 2, "PIPELINE": 0, "PINGPONG": 0},
    {"TILE": 128, "NUM_STAGES": 2, "PIPELINE": 1, "PINGPONG": 0},
)


def bench_prefill(sweep: bool) -> None:
    """Causal prefill at 2k-8k tokens: the unified kernel's large tiles (the oldest path), the
    Triton sm_90 prefill kernel and the warp-specialized Gluon kernel
    (`asyncengine_kernels.prefill_attention_hopper`), each at its default configuration; the Gluon
    kernel's tile and stage counts on every case; then (with `sweep`) the Triton prefill
    kernel over BLOCK_M x TILE x warps x stages on two of them. TFLOP/s count 4 * Hq * D per
    visible (query, key) pair."""
    impls = (
        ("unified_large", False, {"prefill_kernel": False}),
        ("prefill", False, {}),
        ("hopper", True, {}),
    )
    for wl, heads in WORKLOADS.items():
        for name, (q_lens, seq_lens) in PREFILL_CASES.items():
            for impl, hopper, kwargs in impls:
                shape = {"workload": wl, "mode": "prefill", "case": name, "impl": impl}
                run_case(
                    "paged_attention", shape, _prefill_impl_case, q_lens=q_lens,
                    seq_lens=seq_lens, heads=heads, hopper=hopper, **kwargs,
                )  # fmt: skip
        for cfg in HOPPER_SWEEP:
            for name, (q_lens, seq_lens) in PREFILL_CASES.items():
                shape = {"workload": wl, "mode": "hopper_sweep", "case": name, **cfg}
                run_case(
                    "paged_attention", shape, _prefill_impl_case, q_lens=q_lens,
                    seq_lens=seq_lens, heads=heads, hopper=True, hopper_cfg=cfg,
                )  # fmt: skip
        if not sweep:
            continue
        for bm, tile, warps, stages in itertools.product((64, 128), (64, 128), (4, 8), (2, 3)):
            if warps == 4 and bm * tile > 64 * 64:
                continue  # spills at head_dim 128 (compile_kernels --asm-stats)
            cfg = {"BLOCK_M": bm, "TILE": tile, "num_warps": warps, "num_stages": stages}
            for name in PREFILL_SWEEP_CASES:
                q_lens, seq_lens = PREFILL_CASES[name]
                shape = {"workload": wl, "mode": "prefill_sweep", "case": name, **cfg}
                run_case(
                    "paged_attention", shape, _attention_case, q_lens=q_lens,
                    seq_lens=seq_lens, heads=heads, causal_flops=True,
                    max_query_len=max(q_lens), large_tiles=cfg,
                )  # fmt: skip


def _norm_case(shape: dict[str, Any], tokens: int) -> None:
    from asyncengine_kernels.rms_norm import fused_add_rms_norm_triton, rms_norm_triton

    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res, w = torch.randn_like(x), torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: rms_norm_triton(x, w, 1e-6))
    emit("rms_norm", shape, ms, nbytes=2 * x.numel() * 2)
    ms = bench(lambda: fused_add_rms_norm_triton(x, res, w, 1e-6))
    emit("fused_add_rms_norm", shape, ms, nbytes=4 * x.numel() * 2)


def _rotary_case(shape: dict[str, Any], tokens: int, heads: tuple[int, int]) -> None:
    from asyncengine_kernels.rotary import apply_rotary_emb_triton

    q = torch.randn(tokens, heads[0], HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, heads[1], HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(8192, HEAD_DIM, device="cuda")
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    ms = bench(lambda: apply_rotary_emb_triton(pos, q, k, cache))
    emit("rotary", shape, ms, nbytes=2 * (q.numel() + k.numel()) * 2)


def _silu_case(shape: dict[str, Any], tokens: int, inter: int) -> None:
    from asyncengine_kernels.activation import silu_and_mul_triton

    x = torch.randn(tokens, 2 * inter, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: silu_and_mul_triton(x))
    emit("silu_and_mul", shape, ms, nbytes=1.5 * x.numel() * 2)


def _kv_write_case(shape: dict[str, Any], tokens: int, num_kv_heads: int) -> None:
    from asyncengine_kernels.kv_cache_write import write_kv_cache_triton

    key = torch.randn(tokens, num_kv_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    num_blocks = 4 * math.ceil(tokens / BLOCK_SIZE)
    k_cache = torch.empty(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, device="cuda",
                          dtype=torch.bfloat16)  # fmt: skip
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:tokens]
    ms = bench(lambda: write_kv_cache_triton(key, value, k_cache, v_cache, slots))
    emit("write_kv_cache", shape, ms, nbytes=4 * key.numel() * 2)


def bench_elementwise() -> None:
    for wl, heads in WORKLOADS.items():
        for tokens in (256, 4096):
            shape = {"workload": wl, "tokens": tokens}
            run_case("rms_norm", shape, _norm_case, tokens=tokens)
            run_case("rotary", shape, _rotary_case, tokens=tokens, heads=heads)
            run_case("silu_and_mul", shape, _silu_case, tokens=tokens, inter=INTERMEDIATE[wl])
            run_case("write_kv_cache", shape, _kv_write_case, tokens=tokens, num_kv_heads=heads[1])


def _sampling_case(shape: dict[str, Any], bsz: int, vocab: int, filters: bool) -> None:
    from asyncengine_kernels.sampling import sample_from_logits_triton

    logits = torch.randn(bsz, vocab, device="cuda") * 4
    noise = torch.empty_like(logits).exponential_()
    top_k = torch.full((bsz,), 50 if filters else 0, dtype=torch.int32, device="cuda")
    top_p = torch.full((bsz,), 0.9 if filters else 1.0, device="cuda")
    min_p = torch.full((bsz,), 0.05 if filters else 0.0, device="cuda")
    ms = bench(lambda: sample_from_logits_triton(logits, top_k, top_p, min_p, noise))
    emit("sample_from_logits", shape, ms, nbytes=2 * logits.numel() * 4)


def bench_sampling() -> None:
    for wl, vocab in VOCAB.items():
        for bsz in (1, 32, 256):
            for filters in (False, True):
                shape = {"workload": wl, "batch": bsz, "vocab": vocab,
                         "filters": "top_k+top_p+min_p" if filters else "none"}  # fmt: skip
                run_case("sample_from_logits", shape, _sampling_case, bsz=bsz, vocab=vocab,
                         filters=filters)  # fmt: skip


# Per-layer weights [N, K] of the decode GEMVs (qkv, o, gate/up, down).
GEMV_SHAPES = {
    "W1": [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)],
    "W2": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
}


def _gemv_case(shape: dict[str, Any], n: int, k: int) -> None:
    import torch.nn.functional as F

    from asyncengine_kernels.gemv import gemv_candidates, gemv_triton

    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    # Enough distinct weights (as the layers are) that L2 serves none of the reads.
    copies = max(4, math.ceil(512 * 2**20 / (2 * n * k)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    nbytes = 2 * (n * k + n + k)

    def cycling(call: Callable[[torch.Tensor], Any]) -> Callable[[], Any]:
        turn = itertools.count()
        return lambda: call(weights[next(turn) % copies])

    emit("gemv", {**shape, "impl": "blas"}, bench(cycling(lambda w: F.linear(x, w))),
         nbytes=nbytes)
    for cfg in gemv_candidates(k):
        ms = bench(cycling(lambda w, cfg=cfg: gemv_triton(x, w, None, cfg)))
        emit("gemv", {**shape, "impl": f"triton {cfg}"}, ms, nbytes=nbytes)


def bench_gemv() -> None:
    for wl, shapes in GEMV_SHAPES.items():
        for n, k in shapes:
            shape = {"workload": wl, "n": n, "k": k}
            run_case("gemv", shape, _gemv_case, n=n, k=k)


SKINNY_ROWS = (1, 2, 4, 5, 8, 16)
# Llama-2-7B's decode matmuls for `--only skinny` (N, K, form): qkv, o, gate/up (plain and
# with the GLU epilogue), down (plain and with the gated input), and the LM heads of 32000
# and 128256 tokens.
SKINNY_SHAPES = [
    (12288, 4096, "plain"), (4096, 4096, "plain"), (22016, 4096, "plain"),
    (22016, 4096, "glu"), (4096, 11008, "plain"), (4096, 11008, "gated"),
    (32000, 4096, "plain"), (128256, 4096, "plain"),
]  # fmt: skip


def _skinny_case(shape: dict[str, Any], n: int, k: int, form: str) -> None:
    """cuBLAS (F.linear, with SiLU-and-mul as its own kernel for the gated and GLU forms)
    and every few-row config at each row count; at one row, the Triton GEMV too. The
    fraction is of the weight's bytes over 4.25 TB/s."""
    import torch.nn.functional as F

    from asyncengine_kernels.activation import silu_and_mul
    from asyncengine_kernels.gemv import gemv_candidates, gemv_triton
    from asyncengine_kernels.skinny_gemm import SKINNY_CONFIGS, skinny_counters, skinny_gemm

    gated, glu = form == "gated", form == "glu"
    copies = max(2, math.ceil(512 * 2**20 / (2 * n * k)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]  # fmt: skip
    counters = skinny_counters(n, "cuda")
    wbytes = 2 * n * k

    def cycling(call: Callable[[torch.Tensor], Any]) -> Callable[[], Any]:
        turn = itertools.count()
        return lambda: call(weights[next(turn) % copies])

    for rows in SKINNY_ROWS:
        x = torch.randn(rows, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
        case = {**shape, "rows": rows}

        def library(w: torch.Tensor, x: torch.Tensor = x) -> torch.Tensor:
            y = F.linear(silu_and_mul(x) if gated else x, w)
            return silu_and_mul(y) if glu else y

        emit("skinny", {**case, "impl": "cublas"}, bench(cycling(library)), nbytes=wbytes)
        if rows == 1:
            for gcfg in gemv_candidates(k):
                ms = bench(cycling(lambda w, c=gcfg, x=x: gemv_triton(x, w, None, c, gated=gated,
                                                                      glu=glu)))  # fmt: skip
                emit("skinny", {**case, "impl": f"gemv {gcfg}"}, ms, nbytes=wbytes)
        for cfg in SKINNY_CONFIGS:
            call = functools.partial(skinny_gemm, x, bias=None, config=cfg, counters=counters,
                                     gated=gated, glu=glu)  # fmt: skip
            ms = bench(cycling(lambda w, call=call: call(w)))
            emit("skinny", {**case, "impl": str(cfg)}, ms, nbytes=wbytes)


def bench_skinny() -> None:
    for n, k, form in SKINNY_SHAPES:
        shape = {"workload": "W1" if n != 128256 else "W2", "n": n, "k": k, "form": form}
        run_case("skinny", shape, _skinny_case, n=n, k=k, form=form)


QUANT_ROWS = (1, 4, 16, 64, 512)
# W1's layers by name (`--quant-shapes`; "w1" is all four).
QUANT_SHAPES = dict(zip(("qkv", "o", "gate_up", "down"), GEMV_SHAPES["W1"], strict=True))
# (bits, group): int4 and int8 in group 128, as GPTQ checkpoints mostly come.
QUANT_FORMATS = ((4, 128), (8, 128))
# The GEMVs are timed where the tuner's rules time them.
QUANT_GEMV_ROWS = 4


def _tinygemm_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """torch's own int4 GEMM (tinygemm) operands for the same codes: w = (q - 8) * s + m with
    the offset m = (8 - zero) * s, which is (q - zero) * s."""
    packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # two codes a byte, [N, K / 2]
    w = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
    offset = (8 - zeros.float()) * scales.float()
    return w, torch.stack([scales.float(), offset], dim=-1).to(torch.bfloat16).contiguous()


def _cycle_over(call: Callable[..., Any], pool: list[Any]) -> Callable[[], Any]:
    """A no-argument call of `call` on the next of `pool`'s argument tuples each time."""
    turn = itertools.count()
    return lambda: call(*pool[next(turn) % len(pool)])


def _dequantize_cublas_ms(x: torch.Tensor, weights: list[Any], bits: int, group: int) -> float:
    """Milliseconds of the plans' large-batch path on `weights` (cycled): one Triton pass
    dequantizes the weight to x's dtype, then cuBLAS multiplies."""
    from asyncengine_kernels.quant_linear import dequantize_weight_triton

    return bench(_cycle_over(lambda w, s, z: x @ dequantize_weight_triton(
        w, s, z, bits, group, x.dtype), weights))


def _int_weight_copies(n: int, k: int, bits: int, group: int,
                       dtype: torch.dtype = torch.bfloat16,
                       ) -> tuple[int, list[tuple[torch.Tensor, ...]], list[Any], str | None,
                                  list[torch.Tensor]]:  # fmt: skip
    """Random symmetric integer weights [N, K] in the kernels' layout, as many copies as keep
    L2 from serving any read: (bytes of one, the copies as (qweight, scales, zeros) with the
    scales in `dtype`, torch's int4 operands of each (tinygemm, bf16 only; none with the
    reason where it cannot run), and enough dequantized copies [N, K] in `dtype` for
    cuBLAS)."""
    from asyncengine_kernels.quant_linear import dequantize_weight, pack_int_weight

    g = k // group
    wbytes = n * k * bits // 8 + 2 * 2 * g * n
    copies = max(4, math.ceil(512 * 2**20 / wbytes))
    weights, tiny = [], []
    tiny_error = "int4 only" if bits != 4 else (
        None if dtype == torch.bfloat16 else "bf16 only")  # fmt: skip
    for _ in range(copies):
        q = torch.randint(0, 1 << bits, (n, k), device="cuda", dtype=torch.uint8)
        scales = torch.rand(g, n, device="cuda", dtype=dtype) * 0.002
        zeros = torch.full((g, n), float(1 << (bits - 1)), device="cuda", dtype=dtype)
        weights.append((pack_int_weight(q, bits), scales, zeros))
        if tiny_error is None:
            try:
                tiny.append(_tinygemm_weight(q, scales, zeros))
            except Exception as exc:  # an op or layout this torch build lacks
                tiny_error = repr(exc)[:300]
    dense_copies = max(2, math.ceil(512 * 2**20 / (2 * n * k)))
    dense = [dequantize_weight(*weights[i], bits, group).t().contiguous()
             for i in range(min(dense_copies, copies))]  # fmt: skip
    return wbytes, weights, tiny, tiny_error, dense


def _quant_case(shape: dict[str, Any], n: int, k: int, bits: int, group: int,
                rows_list: tuple[int, ...] = QUANT_ROWS) -> None:  # fmt: skip
    """At each row count: bf16 cuBLAS on the dequantized weight, dequantize + cuBLAS (the
    Triton pass, then the matmul: `TritonDequantMatmul`), torch's int4 kernel where it runs,
    every GEMM candidate, and at a few rows the GEMV candidates. Weights cycle over enough
    copies that L2 serves none of the reads (the bf16 ones too)."""
    import torch.nn.functional as F

    from asyncengine_kernels.gemv_split_k import gemv_counters
    from asyncengine_kernels.quant_linear import (
        quant_gemm,
        quant_gemm_candidates,
        quant_gemv,
        quant_gemv_candidates,
    )

    wbytes, weights, tiny, tiny_error, dense = _int_weight_copies(n, k, bits, group)
    counters = gemv_counters(16, n, "cuda")

    def cycling(call: Callable[..., Any], pool: list[Any] = weights) -> Callable[[], Any]:
        return _cycle_over(call, pool)

    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        nbytes, flops = wbytes + 2 * rows * (n + k), 2 * rows * n * k
        case = {**shape, "rows": rows}
        ms = bench(cycling(lambda w, x=x: F.linear(x, w), [(d,) for d in dense]))
        emit("quant", {**case, "impl": "bf16 cublas"}, ms, nbytes=2 * n * k + 2 * rows * (n + k),
             flops=flops)  # fmt: skip
        ms = _dequantize_cublas_ms(x, weights, bits, group)
        emit("quant", {**case, "impl": "dequantize + cublas"}, ms, nbytes=nbytes, flops=flops)
        if tiny_error is None:
            try:
                ms = bench(cycling(lambda w, sz, x=x: torch.ops.aten._weight_int4pack_mm(
                    x, w, group, sz), tiny))
                emit("quant", {**case, "impl": "torch int4 (tinygemm)"}, ms, nbytes=nbytes,
                     flops=flops)  # fmt: skip
            except Exception as exc:  # e.g. a row count or K it does not take
                tiny_error = repr(exc)[:300]
        if tiny_error is not None:
            print(json.dumps({"kernel": "quant", **case, "impl": "torch int4 (tinygemm)",
                              "error": tiny_error}), flush=True)  # fmt: skip
        for cfg in quant_gemm_candidates(group, k) if rows > 1 else []:
            ms = bench(cycling(lambda w, s, z, x=x, c=cfg: quant_gemm(x, w, s, z, bits, group,
                                                                      None, c, counters)))
            emit("quant", {**case, "impl": str(cfg)}, ms, nbytes=nbytes, flops=flops)
        if rows <= QUANT_GEMV_ROWS:
            for gcfg in quant_gemv_candidates(group, k):
                ms = bench(cycling(lambda w, s, z, x=x, c=gcfg: quant_gemv(
                    x, w, s, z, bits, group, None, c, counters)))
                emit("quant", {**case, "impl": str(gcfg)}, ms, nbytes=nbytes)


WGMMA_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # int8: up to 64


def _wgmma_case(shape: dict[str, Any], n: int, k: int, group: int, bits: int,
                rows_list: tuple[int, ...] = WGMMA_ROWS,
                dtype: torch.dtype = torch.bfloat16) -> None:  # fmt: skip
    """int4 or int8 at decode batch sizes, kernel against kernel on one weight (cycled over
    copies so that L2 serves none of it): bf16 cuBLAS, torch's int4 kernel (tinygemm, int4
    only), the fastest of the Triton GEMV and GEMM candidates (the plan's pick, as the tuner
    would find it), dequantize + cuBLAS above 64 rows (the plans' pick there so far), and
    the wgmma kernel at its default launch and with the scale on either side."""
    import torch.nn.functional as F

    from asyncengine_kernels import quant_wgmma as wg
    from asyncengine_kernels.gemv_split_k import gemv_counters
    from asyncengine_kernels.quant_linear import (
        quant_gemm,
        quant_gemm_candidates,
        quant_gemv,
        quant_gemv_candidates,
    )

    wbytes, weights, tiny, _, dense_weights = _int_weight_copies(n, k, bits, group, dtype)
    packed = [(wg.pack_quant_wgmma(qweight, bits), scales, zeros)
              for qweight, scales, zeros in weights]  # fmt: skip
    kernel = f"int{bits}"
    dense = [(d,) for d in dense_weights]
    counters = gemv_counters(64, n, "cuda")
    cycling = _cycle_over

    for rows in (r for r in rows_list if r <= wg.max_rows(bits)):
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        nbytes, flops = wbytes + 2 * rows * (n + k), 2 * rows * n * k
        case = {**shape, "rows": rows}
        ms = bench(cycling(lambda w, x=x: F.linear(x, w), dense))
        half = "bf16" if dtype == torch.bfloat16 else "fp16"
        emit(kernel, {**case, "impl": f"{half} cublas"}, ms, nbytes=2 * n * k, flops=flops)
        if rows > wg.SLICE_MAX_ROWS:
            ms = _dequantize_cublas_ms(x, weights, bits, group)
            emit(kernel, {**case, "impl": "dequantize + cublas"}, ms, nbytes=nbytes, flops=flops)
        if bits == 4 and tiny:
            ms = bench(cycling(lambda w, sz, x=x: torch.ops.aten._weight_int4pack_mm(
                x, w, group, sz), tiny))
            emit(kernel, {**case, "impl": "torch int4 (tinygemm)"}, ms, nbytes=nbytes)
        best: tuple[float, str] = (math.inf, "")
        if rows <= QUANT_GEMV_ROWS:
            for gcfg in quant_gemv_candidates(group, k):
                ms = bench(cycling(lambda w, s, z, x=x, c=gcfg: quant_gemv(
                    x, w, s, z, bits, group, None, c, counters), weights))
                best = min(best, (ms, str(gcfg)))
        for cfg in quant_gemm_candidates(group, k) if rows > 1 else []:
            ms = bench(cycling(lambda w, s, z, x=x, c=cfg: quant_gemm(
                x, w, s, z, bits, group, None, c, counters), weights))
            best = min(best, (ms, str(cfg)))
        emit(kernel, {**case, "impl": f"triton best: {best[1]}"}, best[0], nbytes=nbytes)
        # Past one launch's rows the call runs 128-row launches, each with this config.
        per_launch = min(rows, wg.launch_max_rows(bits))
        default = wg.quant_wgmma_config(per_launch, n, k, group, bits=bits)
        launches = {default}
        # Groups of 32 take the scale on the weights only.
        for on_acc in (True, False) if group >= wg.CHUNK_K else (False,):
            base = wg.quant_wgmma_config(per_launch, n, k, group, scale_on_acc=on_acc,
                                         bits=bits)
            splits = [max(wg.ITER_K, int(base.k_split * factor) // group * group or group)
                      for factor in (0.5, 1, 2)]  # fmt: skip
            if per_launch > wg.SLICE_MAX_ROWS:
                # A K split of three, the rule before four (o and down: 192 programs, which
                # left 72 of 132 multiprocessors one; four ran down 4-10 % faster).
                unit = max(wg.ITER_K, group)
                splits.append(-(-k // (3 * unit)) * unit)
            for k_split in splits:
                launches.add(wg.QuantWgmmaConfig(base.rows, k_split, on_acc, base.x_ring))
                if not on_acc:  # the asynchronous wgmma beside the synchronous one
                    launches.add(wg.QuantWgmmaConfig(base.rows, k_split, on_acc, base.x_ring,
                                                     async_mma=True))  # fmt: skip
        for cfg in sorted(launches, key=str):
            ms = bench(cycling(lambda w, s, z, x=x, c=cfg: wg.quant_wgmma_matmul(
                x, w, s, z, group, None, c, counters, bits=bits, has_zero=False), packed))
            tag = " (default)" if cfg == default else ""
            emit(kernel, {**case, "impl": f"{cfg}{tag}"}, ms, nbytes=nbytes)


def bench_wgmma(bits: int, rows: tuple[int, ...] = WGMMA_ROWS,
                shapes: tuple[str, ...] = tuple(QUANT_SHAPES), group: int = 128,
                dtype: torch.dtype = torch.bfloat16) -> None:  # fmt: skip
    for name in shapes:
        n, k = QUANT_SHAPES[name]
        shape = {"workload": "L1", "layer": name, "n": n, "k": k, "bits": bits, "group": group,
                 "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
        run_case(f"int{bits}", shape, _wgmma_case, n=n, k=k, group=group, bits=bits,
                 rows_list=rows, dtype=dtype)  # fmt: skip


FP8_ROWS = (1, 4, 16, 64, 256, 1024, 4096)


def _fp8_case(shape: dict[str, Any], n: int, k: int) -> None:
    from asyncengine_kernels.fp8_linear import (
        FP8_GEMV_MIN_BLOCK_N,
        fp8_gemm,
        fp8_gemm_candidates,
        fp8_gemv,
        fp8_gemv_candidates,
        fp8_scaled_mm,
        quantize_rows,
        quantize_weight_per_channel,
    )
    from asyncengine_kernels.gemv_split_k import gemv_counters

    wbytes = n * k + 4 * n
    # Enough distinct weights (as the layers are) that L2 serves none of the reads.
    copies = max(4, math.ceil(512 * 2**20 / wbytes))
    weights = []
    for _ in range(copies):
        q, scale = quantize_weight_per_channel(
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        )
        weights.append((q, scale.view(-1)))
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02

    def cycling(call: Callable[..., Any]) -> Callable[[], Any]:
        turn = itertools.count()
        return lambda: call(*weights[next(turn) % copies])

    def row(case: dict[str, Any], impl: str, ms: float, nbytes: float, flops: float,
            **extra: Any) -> None:  # fmt: skip
        tflops = flops / ms / 1e9
        emit("fp8", {**case, "impl": impl, **extra, "frac_fp8": round(tflops / FP8_TFLOPS, 3)},
             ms, nbytes=nbytes, flops=flops)  # fmt: skip

    for rows in FP8_ROWS:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        case, flops = {**shape, "rows": rows}, 2 * rows * n * k
        nbytes = wbytes + 2 * rows * (n + k)
        ms = bench(lambda x=x: torch.nn.functional.linear(x, dense))
        emit("fp8", {**case, "impl": "bf16 cublas"}, ms, nbytes=2 * n * k + 2 * rows * (n + k),
             flops=flops)  # fmt: skip
        quant_ms = bench(lambda x=x: quantize_rows(x))
        xq, xs, _ = quantize_rows(x)
        w8a8_bytes = wbytes + rows * (k + 4 + 2 * n)
        ms = bench(cycling(lambda w, s, a=xq, b=xs: fp8_scaled_mm(a, b, w, s, None,
                                                                  torch.bfloat16)))  # fmt: skip
        row(case, "_scaled_mm", ms, w8a8_bytes, flops, quant_ms=round(quant_ms, 4))
        for cfg in fp8_gemm_candidates():
            call = lambda w, s, a=xq, b=xs, c=cfg: fp8_gemm(a, b, w, s, None, torch.bfloat16, c)  # noqa: E731
            ms = bench(cycling(call))
            row(case, f"triton {cfg}", ms, w8a8_bytes, flops, quant_ms=round(quant_ms, 4))
        if rows <= 16:
            cnt = gemv_counters(1, n, "cuda", FP8_GEMV_MIN_BLOCK_N)
            for gcfg in fp8_gemv_candidates(rows):
                ms = bench(cycling(lambda w, s, x=x, c=gcfg, cnt=cnt: fp8_gemv(
                    x, w, s, None, c, counters=cnt)))
                row(case, f"triton {gcfg}", ms, nbytes, flops)


def _fp8_row_case(shape: dict[str, Any], n: int, k: int, transform: str) -> None:
    """One row through every FP8 one-row form, with the layer's input transform where a
    decode step runs it: "norm" (q/k/v, gate/up: the residual add and RMSNorm, in the
    whole-row kernel, else the norm kernel first), "gated" (down: SiLU-and-mul of
    [gate, up]) or "plain" (o). The bf16 whole-row GEMV with the same transform is the
    16-bit reference."""
    from asyncengine_kernels.activation import silu_and_mul
    from asyncengine_kernels.fp8_linear import (
        FP8_GEMV_MIN_BLOCK_N,
        FP8_WHOLE_ROW_CONFIGS,
        fp8_gemv,
        fp8_gemv_candidates,
        quantize_weight_per_channel,
    )
    from asyncengine_kernels.gemv import (
        PERSISTENT_GEMV_CONFIGS,
        WholeRowGemvConfig,
        gemv_triton,
        rms_norm_gemv,
    )
    from asyncengine_kernels.gemv_split_k import gemv_counters
    from asyncengine_kernels.rms_norm import fused_add_rms_norm

    copies = max(4, math.ceil(512 * 2**20 / (n * k)))
    weights = []
    for _ in range(copies):
        q, scale = quantize_weight_per_channel(
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        )
        weights.append((q, scale.view(-1)))
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
             for _ in range(max(4, copies // 2))]  # fmt: skip
    x = torch.randn(1, 2 * k if transform == "gated" else k, device="cuda", dtype=torch.bfloat16)
    residual, norm_w = torch.randn(1, k, device="cuda", dtype=torch.bfloat16), torch.ones(
        k, device="cuda", dtype=torch.bfloat16)  # fmt: skip
    counters = gemv_counters(1, n, "cuda", FP8_GEMV_MIN_BLOCK_N)
    turn = itertools.count()

    def timed(impl: str, call: Callable[[torch.Tensor, torch.Tensor | None], Any],
              pool: list, bytes_per: int) -> None:  # fmt: skip
        ms = bench(lambda: call(*pool[next(turn) % len(pool)]))
        emit("fp8row", {**shape, "rows": 1, "transform": transform, "impl": impl}, ms,
             nbytes=bytes_per)  # fmt: skip

    def whole_row(cfg: WholeRowGemvConfig, w: torch.Tensor, s: torch.Tensor | None) -> Any:
        if transform == "norm":
            return rms_norm_gemv(x, residual, norm_w, 1e-5, w, None, cfg, scale=s)
        return gemv_triton(x, w, None, cfg, gated=transform == "gated", scale=s)

    def normed_input() -> torch.Tensor:
        return fused_add_rms_norm(x, residual, norm_w, 1e-5)[0]

    dense_pool = [(w, None) for w in dense]
    if k <= 8192:
        for cfg in PERSISTENT_GEMV_CONFIGS:
            timed(f"bf16 {cfg}", lambda w, s, c=cfg: whole_row(c, w, s), dense_pool, 2 * n * k)
        for cfg in FP8_WHOLE_ROW_CONFIGS:
            timed(f"fp8 {cfg}", lambda w, s, c=cfg: whole_row(c, w, s), weights, n * k + 4 * n)
    for cfg in fp8_gemv_candidates(1):
        if transform == "norm":
            timed(f"fp8 norm kernel + {cfg}", lambda w, s, c=cfg: fp8_gemv(
                normed_input(), w, s, None, c, counters=counters), weights, n * k + 4 * n)
        else:
            timed(f"fp8 {cfg}", lambda w, s, c=cfg: fp8_gemv(
                x, w, s, None, c, gated=transform == "gated", counters=counters), weights,
                n * k + 4 * n)  # fmt: skip
    if transform == "gated":  # the activation kernel, then the plain GEMV
        timed("fp8 silu kernel + default", lambda w, s: fp8_gemv(
            silu_and_mul(x), w, s, None, counters=counters), weights, n * k + 4 * n)


def bench_fp8_row() -> None:
    """FP8 one-row decode GEMVs at the W1 shapes with their input transforms."""
    transforms = {(12288, 4096): "norm", (4096, 4096): "plain", (22016, 4096): "norm",
                  (4096, 11008): "gated"}  # fmt: skip
    for n, k in GEMV_SHAPES["W1"]:
        shape = {"workload": "W1", "n": n, "k": k}
        run_case("fp8row", shape, _fp8_row_case, n=n, k=k, transform=transforms[(n, k)])


def bench_fp8() -> None:
    for wl in ("W1", "W2"):
        for n, k in GEMV_SHAPES[wl]:
            shape = {"workload": wl, "n": n, "k": k}
            run_case("fp8", shape, _fp8_case, n=n, k=k)


def bench_quant(rows: tuple[int, ...] = QUANT_ROWS,
                shapes: tuple[str, ...] = tuple(QUANT_SHAPES)) -> None:  # fmt: skip
    for bits, group in QUANT_FORMATS:
        for name in shapes:
            n, k = QUANT_SHAPES[name]
            shape = {"workload": "W1", "layer": name, "n": n, "k": k, "bits": bits,
                     "group": group}  # fmt: skip
            run_case("quant", shape, _quant_case, n=n, k=k, bits=bits, group=group,
                     rows_list=rows)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--only",
        choices=[
            "attention", "prefill", "sweep", "elementwise", "sampling", "gemv", "quant", "fp8",
            "fp8row", "kvfp8", "skinny", "int4", "int8",
        ],
    )
    parser.add_argument("--sweep", action="store_true", help="also sweep decode configs")
    parser.add_argument("--sweep-batches", default="1,4,8,16,32,64", help="decode sweep batches")
    parser.add_argument("--sweep-contexts", default="640,2000", help="decode sweep lengths")
    parser.add_argument(
        "--no-prefill-sweep", action="store_true", help="skip the prefill config sweeps"
    )
    parser.add_argument("--quant-rows", nargs="+", default=[",".join(map(str, QUANT_ROWS))],
                        help="batch rows of the quantized matmul bench (16 64 or 16,64)")
    parser.add_argument("--quant-dtype", choices=["bfloat16", "float16"], default="bfloat16",
                        help="activations of the int4/int8 wgmma bench (--only int4/int8)")
    parser.add_argument("--quant-group", type=int, default=128,
                        help="group size of the int4/int8 wgmma bench")
    parser.add_argument("--quant-shapes", nargs="+", default=["w1"],
                        choices=["w1", *QUANT_SHAPES],
                        help="W1 layers of the quantized matmul bench (w1: all four)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device: the kernels are benchmarked on a GPU"}))
        return
    torch.manual_seed(0)
    if args.only in (None, "attention"):
        bench_attention()
    if args.only == "prefill":
        bench_prefill(sweep=not args.no_prefill_sweep)
    if args.sweep or args.only == "sweep":
        sweep_decode(
            [int(b) for b in args.sweep_batches.split(",")],
            [int(c) for c in args.sweep_contexts.split(",")],
        )
        if not args.no_prefill_sweep:
            sweep_prefill()
    if args.only in (None, "kvfp8"):
        sweep_fp8_kv_decode()
    if args.only in (None, "elementwise"):
        bench_elementwise()
    if args.only in (None, "sampling"):
        bench_sampling()
    if args.only in (None, "gemv"):
        bench_gemv()
    if args.only in (None, "quant"):
        rows = tuple(int(r) for arg in args.quant_rows for r in arg.split(",") if r)
        names = [n for name in args.quant_shapes
                 for n in (QUANT_SHAPES if name == "w1" else (name,))]  # fmt: skip
        bench_quant(rows, tuple(dict.fromkeys(names)))
    if args.only in ("int4", "int8"):
        rows = tuple(int(r) for arg in args.quant_rows for r in arg.split(",") if r)
        bench_wgmma(int(args.only[3:]),
                    rows if args.quant_rows != parser.get_default("quant_rows") else WGMMA_ROWS,
                    group=args.quant_group, dtype=getattr(torch, args.quant_dtype))
    if args.only in (None, "fp8"):
        bench_fp8()
    if args.only in (None, "fp8row"):
        bench_fp8_row()
    if args.only in (None, "skinny"):
        bench_skinny()


if __name__ == "__main__":
    main()
