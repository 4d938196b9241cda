"""W1 / W2 (offline throughput) and L1 (single-stream latency) of BENCHMARKS.md.

Runs one system per invocation (`--system engine|hf`) so each gets the whole GPU, and prints
one JSON line per result. The engine run also reports M1 (KV pool occupancy and waste at the
peak number of running requests) and where the step time goes (schedule / launch / wait
for the device / postprocess on the host, and the kernels' share of GPU time with --profile-steps).

  python scripts/bench_throughput.py --workload w1 --system engine
  python scripts/bench_throughput.py --workload w1 --system hf --hf-batch-size 128
  python scripts/bench_throughput.py --workload l1 --system engine
  python scripts/bench_throughput.py --workload l1 --quantization gptq-int4
  python scripts/bench_throughput.py --workload w1 --kv-cache-dtype fp8
  python scripts/bench_throughput.py --workload w2 --quantization fp8 --kv-cache-dtype fp8

`--quantization` serves the dummy shape in a weight-only format (random codes, scales that
give weights of the 16-bit dummy's magnitude), or with FP8 e4m3 weights (`fp8`: what
`quantization="fp8"` makes of a 16-bit checkpoint: per-channel scales, per-token dynamic
activations for the W8A8 GEMMs); the floors then count the quantized bytes.
`--structured-outputs json` measures the cost of constrained decoding (see
scripts/bench_structured.py).
`--kv-cache-dtype fp8` stores the KV cache in e4m3 (scales 1.0, the dummy checkpoint has
none): the pool holds twice the blocks and the floors count one byte per K/V element.

Parallel sampling: `--n 8` samples each prompt 8 times in one request (the prompt's KV
computed once and shared); `--n 8 --n-as-requests` sends the same work as 8 separate
requests per prompt (sample j with seed + j: the same tokens), the baseline to compare
tokens/s and `m1.peak_used_blocks` against.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.bench_common import (
    PEAK_BW,
    SHAPES,
    dummy_model_dir,
    emit,
    floor_seconds_for,
    param_count,
    warmth,
    warmth_delta,
)
from scripts.bench_common import (
    PEAK_FLOPS as PEAK_FLOPS,  # bench_tp imports it from here
)

WORKLOADS = {
    "w1": dict(shape="llama2-7b", num_requests=512, prompt_len=512, output_len=256),
    "w2": dict(shape="llama3-8b", num_requests=1000, prompt_len=1000, output_len=1000),
    "l1": dict(shape="llama2-7b", num_requests=1, prompt_len=512, output_len=256),
    "smoke": dict(shape="tiny", num_requests=64, prompt_len=128, output_len=64),
}
# --quantization: the quantization_config written into the dummy model's config.json.
_CT_WEIGHTS = {"type": "int", "symmetric": True, "dynamic": False, "actorder": None}
QUANT_SCHEMES: dict[str, dict[str, Any]] = {
    "gptq-int4": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                  "desc_act": False},
    "gptq-int8": {"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True,
                  "desc_act": False},
    "awq-int4": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                 "version": "gemm"},
    "ct-w4a16": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                 "ignore": ["lm_head"], "config_groups": {"group_0": {
                     "targets": ["Linear"], "weights": {**_CT_WEIGHTS, "num_bits": 4,
                                                        "strategy": "group", "group_size": 128}}}},
    "ct-w8a16": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                 "ignore": ["lm_head"], "config_groups": {"group_0": {
                     "targets": ["Linear"], "weights": {**_CT_WEIGHTS, "num_bits": 8,
                                                        "strategy": "channel"}}}},
    # No quantization_config: the 16-bit dummy, quantized at load (`quantization="fp8"`).
    "fp8": {},
}  # fmt: skip


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def weight_bytes(shape: str, quantization: str | None = None) -> int:
    """Bytes of weights one decode step reads: every parameter in bf16, or the linear
    layers' packed codes plus a bf16 scale and zero per group and column."""
    params = param_count(shape)
    if quantization is None:
        return 2 * params
    from models.config import ModelConfig

    c = SHAPES[shape]
    cfg = ModelConfig.from_dict({**c, "quantization_config": QUANT_SCHEMES[quantization]},
                                quantization_method(quantization))  # fmt: skip
    qc = cfg.quantization
    assert qc is not None
    h, inter, hd = c["hidden_size"], c["intermediate_size"], cfg.head_dim
    attn = h * hd * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)
    linear = c["num_hidden_layers"] * (attn + 3 * h * inter)
    shapes = [(hd * (c["num_attention_heads"] + 2 * c["num_key_value_heads"]), h), (h, h),
              (2 * inter, h), (h, inter)]  # fmt: skip
    from models.quantization.config import IntQuantConfig

    def per_row(k: int) -> int:  # FP8: one scale per output channel
        return k // qc.group_size_for(k) if isinstance(qc, IntQuantConfig) else 1

    groups = c["num_hidden_layers"] * sum(n * per_row(k) for n, k in shapes)
    # A bf16 scale and zero per group, or FP8's one float32 scale per output channel.
    return 2 * (params - linear) + linear * qc.bits // 8 + 2 * 2 * groups


def quantization_method(quantization: str | None) -> str | None:
    """The engine's `quantization=` for a --quantization choice."""
    if quantization is None:
        return None
    return QUANT_SCHEMES[quantization].get("quant_method", quantization)


def quantized_model_dir(shape: str, quantization: str) -> Path:
    """The dummy shape's directory with a quantization_config (load_format='dummy')."""
    path = dummy_model_dir(shape).with_name(f"asyncengine-dummy-{shape}-{quantization}")
    path.mkdir(exist_ok=True)
    config = {**SHAPES[shape], "quantization_config": QUANT_SCHEMES[quantization]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def floor_seconds(w: dict, concurrency: int, quantization: str | None = None,
                  kv_elem_bytes: int = 2) -> dict[str, float]:  # fmt: skip
    """Lower bound on the run time from the hardware limits (see BENCHMARKS.md); with n
    samples per prompt, n sequences decode per request and shared prompts prefill once."""
    samples = w.get("n", 1)
    n, p, o = w["num_requests"] * samples, w["prompt_len"], w["output_len"]
    prefills = w["num_requests"] if w.get("shared_prompts", True) else n
    return floor_seconds_for(w["shape"], [p] * prefills, [(p, o)] * n, concurrency,
                             weight_bytes(w["shape"], quantization), kv_elem_bytes)


def greedy_params(output_len: int) -> Any:
    """Exactly `output_len` greedy tokens (EOS ignored), reported once when finished."""
    from asyncengine import SamplingParams
    from asyncengine.sampling_params import RequestOutputKind

    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def sampling_params(output_len: int, n: int, seed: int) -> Any:
    """Exactly `output_len` tokens per sample, `n` seeded samples per request (temperature
    1: parallel samples only differ when sampled), reported once when finished."""
    if n == 1:
        return greedy_params(output_len)
    from asyncengine import SamplingParams
    from asyncengine.sampling_params import RequestOutputKind

    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=output_len,
                          ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


def request_plan(prompts: list[list[int]], params: Any, as_requests: bool
                 ) -> list[tuple[list[int], Any]]:
    """(prompt, params) per request: each prompt once with its n samples, or (the baseline)
    its n samples as n requests, sample j seeded seed + j as the parallel request's are."""
    if not as_requests or params.n == 1:
        return [(p, params) for p in prompts]
    one = [dataclasses.replace(params, n=1, seed=params.seed + j) for j in range(params.n)]
    return [(p, q) for p in prompts for q in one]


def warm_up(engine: Any, w: dict, params: Any) -> None:
    """A few requests through prefill, mixed and decode steps: compiles every kernel variant."""
    vocab = SHAPES[w["shape"]]["vocab_size"]
    for i, p in enumerate(make_prompts(dict(w, num_requests=4), vocab, seed=99)):
        engine.add_request(f"warm-{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
    _sync()


def make_prompts(w: dict, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (w["num_requests"], w["prompt_len"]), generator=gen).tolist()


def override_split_kv(spec: str) -> dict[str, int]:
    """Patch the decode attention's split heuristic (and small-tile key count) for a run."""
    pa = importlib.import_module("asyncengine_kernels.paged_attention")
    values = [int(v) for v in spec.split(",")]
    pa.SPLIT_KV_PROGRAMS_PER_SM, pa.MAX_SPLIT_SEGMENTS = values[0], values[1]
    if len(values) > 2:
        original = pa._small_tile_config
        pa._small_tile_config = lambda group, elem, split=False, programs_per_sm=0.0: {
            **original(group, elem, split, programs_per_sm), "TILE": values[2]
        }
    return dict(zip(["programs_per_sm", "max_segments", "tile"], values, strict=False))


def run_engine(w: dict, args: argparse.Namespace) -> None:
    from asyncengine import EngineArgs
    from asyncengine.llm_engine import LLMEngine
    from models.linear_tuning import describe_matmul_plans

    # Before the engine exists: its CUDA graphs capture the decode attention's launches.
    split_kv = override_split_kv(args.split_kv) if args.split_kv else None
    if args.no_hopper_prefill:
        import asyncengine_kernels.prefill_attention as prefill

        prefill.HOPPER_PREFILL = False
    if args.graph_head_layers:
        from asyncengine.model_runner import ModelRunner

        ModelRunner.graph_head_layers = args.graph_head_layers
    quant = args.quantization
    model_dir = dummy_model_dir(w["shape"]) if quant is None else quantized_model_dir(
        w["shape"], quant
    )  # fmt: skip
    engine_args = EngineArgs(
        model=str(model_dir),
        load_format="dummy",
        quantization=quantization_method(quant),
        skip_tokenizer_init=True,
        max_num_seqs=args.max_num_seqs,
        schedule_conservativeness=args.schedule_conservativeness,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        async_scheduling=False if args.sync else None,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        dtype=args.dtype or ("bfloat16" if args.device != "cpu" else "float32"),
    )
    t0 = time.perf_counter()
    engine = LLMEngine(engine_args)
    # Loading, tuning and graph capture: a cold start when the caches are empty.
    engine_start_s = round(time.perf_counter() - t0, 1)
    params = sampling_params(w["output_len"], args.n, args.seed)
    warm_up(engine, w, params)
    plans = describe_matmul_plans(engine.runner.model)
    for round_ in range(args.repeat):
        record = timed_run(engine, w, params, args, f"r{round_}-")
        if args.repeat > 1:
            record["round"] = round_ + 1
        record["engine_start_s"] = engine_start_s
        record["engine_args"] = dataclasses.asdict(engine_args)
        record["matmul_plans"] = plans
        if split_kv:
            record["split_kv_override"] = split_kv
        emit(record)
    if args.profile_steps:
        profile_steps(engine, w, params, args.profile_steps)


def run_steps(
    engine: Any, prompts: list[list[int]], params: Any, prefix: str,
    on_step: Callable[[float], None] | None = None, as_requests: bool = False,
) -> tuple[int, float, list[float]]:
    """Add every prompt, step until all finish (synchronized at the end); returns the output
    tokens, the elapsed seconds and each step's seconds. `on_step` sees each step's time."""
    step_times: list[float] = []
    start = time.perf_counter()
    for i, (p, q) in enumerate(request_plan(prompts, params, as_requests)):
        engine.add_request(f"{prefix}{i}", p, q)
    out_tokens = 0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        step_times.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step(step_times[-1])
        for o in outs:
            out_tokens += sum(len(c.token_ids) for c in o.outputs)
    _sync()
    return out_tokens, time.perf_counter() - start, step_times


def timed_run(engine, w: dict, params, args: argparse.Namespace, prefix: str) -> dict:
    """One timed pass of the workload through a warm engine; the result record."""
    vocab = SHAPES[w["shape"]]["vocab_size"]
    for k in engine.step_timing:
        engine.step_timing[k] = 0
    prompts = make_prompts(w, vocab, args.seed)
    pool, bs = engine.pool, engine.pool.block_size
    peak = {"running": 0, "used_blocks": 0, "live_tokens": 0}
    peak_used_blocks = 0
    by_kind = {"decode_s": 0.0, "prefill_or_mixed_s": 0.0}
    by_kind_steps = {"decode_s": 0, "prefill_or_mixed_s": 0}

    def on_step(seconds: float) -> None:
        nonlocal peak, peak_used_blocks
        peak_used_blocks = max(peak_used_blocks, pool.num_used_blocks)
        kind = "decode_s" if engine.runner.last_step_decode_only else "prefill_or_mixed_s"
        by_kind[kind] += seconds
        by_kind_steps[kind] += 1
        running = engine.scheduler.running
        if len(running) >= peak["running"]:
            live = sum(r.num_computed_tokens for r in running)
            peak = {
                "running": len(running),
                "used_blocks": pool.num_used_blocks,
                "live_tokens": live,
            }

    before = warmth()
    out_tokens, elapsed, step_times = run_steps(engine, prompts, params, prefix, on_step,
                                                as_requests=args.n_as_requests)
    w = dict(w, n=params.n, shared_prompts=not args.n_as_requests)
    kv_elem_bytes = 1 if args.kv_cache_dtype != "auto" else 2
    floor = floor_seconds(w, peak["running"], args.quantization, kv_elem_bytes)
    limit_tok_s = w["num_requests"] * w["n"] * w["output_len"] / floor["total_s"]
    timing = engine.step_timing
    record = {
        "workload": args.workload,
        "system": "asyncengine",
        "n": params.n,
        "n_as_requests": args.n_as_requests,
        "graphs": not args.enforce_eager,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_num_seqs": engine.scheduler.max_num_seqs,
        "schedule_conservativeness": args.schedule_conservativeness,
        "preemptions": engine.scheduler.num_preemptions,
        "weight_gib": round(weight_bytes(w["shape"], args.quantization) / 2**30, 2),
        "output_tokens": out_tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(out_tokens / elapsed, 1),
        # Prompt tokens as requested (n separate requests each send the prompt).
        "total_tok_s": round((out_tokens + w["num_requests"] * w["prompt_len"]
                              * (w["n"] if args.n_as_requests else 1)) / elapsed, 1),
        "limit_output_tok_s": round(limit_tok_s, 1),
        "fraction_of_limit": round(out_tokens / elapsed / limit_tok_s, 3),
        "floor": {k: round(v, 2) for k, v in floor.items()},
        "steps": int(timing["steps"]),
        "host_schedule_s": round(timing["schedule_s"], 3),
        "host_launch_s": round(timing["launch_s"], 3),
        "wait_for_device_s": round(timing["wait_s"], 3),
        "async_scheduling": engine.async_scheduling,
        "host_postprocess_s": round(timing["postprocess_s"], 3),
        "step_time_by_kind_s": {k: round(v, 3) for k, v in by_kind.items()},
        "steps_by_kind": by_kind_steps,
        "slowest_steps_ms": [round(1000 * t, 1) for t in sorted(step_times)[-5:]],
        "warm_up_misses": warmth_delta(before),
        "m1": {
            "kv_blocks": pool.num_blocks,
            "kv_pool_gib": round(pool.num_blocks * engine.runner.block_bytes() / 2**30, 2),
            "gpu_total_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
            if torch.cuda.is_available()
            else None,
            "peak_running": peak["running"],
            "used_blocks_at_peak": peak["used_blocks"],
            "peak_used_blocks": peak_used_blocks,
            # Parallel samples count their shared prompt once each: sharing makes it < 0.
            "waste_at_peak": round(1 - peak["live_tokens"] / max(peak["used_blocks"] * bs, 1), 4),
        },
    }
    if args.workload == "l1":
        decode = step_times[1:]
        record["ms_per_token"] = round(1000 * elapsed / max(out_tokens, 1), 3)
        record["decode_ms_per_token"] = round(1000 * sum(decode) / max(len(decode), 1), 3)
        weights_floor_ms = 1000 * weight_bytes(w["shape"], args.quantization) / PEAK_BW
        record["floor_ms_per_token"] = round(weights_floor_ms, 3)
        record["fraction_of_limit"] = round(weights_floor_ms / record["decode_ms_per_token"], 3)
    return record


def profile_steps(engine, w: dict, params, steps: int) -> None:
    """GPU time per kernel (each kernel counted once: its self device time) over the step
    that admits the batch (all of L1's prompt), then over `steps` more prefill/mixed steps,
    then over `steps` decode-only steps. The engine is warm: the timed passes ran first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    vocab = SHAPES[w["shape"]]["vocab_size"]
    n = min(w["num_requests"], engine.scheduler.max_num_seqs)
    for i, p in enumerate(make_prompts(dict(w, num_requests=n), vocab, seed=7)):
        engine.add_request(f"prof-{i}", p, params)

    def in_prefill() -> bool:
        return any(r.num_tokens_to_compute > 1 for r in engine.scheduler.requests.values())

    def measure(phase: str, steps: int = steps) -> None:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            _sync()
            wall = time.perf_counter() - t0
        averages = prof.key_averages()
        # Device-side events only: a CPU op (aten::mm) also carries its kernels' device time.
        kernels = [e for e in averages if e.device_type == DeviceType.CUDA]
        host = [e for e in averages if e.device_type == DeviceType.CPU and e.self_cpu_time_total]

        def rows(events: list, attr: str, n: int) -> list[dict]:
            top = sorted(events, key=lambda e: -getattr(e, attr))[:n]
            return [
                {
                    "name": e.key[:70],
                    "ms_per_step": round(getattr(e, attr) / 1000 / steps, 4),
                    "calls_per_step": round(e.count / steps, 1),
                }
                for e in top
            ]

        emit(
            {
                "workload": f"profile-{phase}",
                "steps": steps,
                "running": len(engine.scheduler.running),
                "wall_ms_per_step": round(1000 * wall / steps, 3),
                "gpu_kernel_ms_per_step": round(
                    sum(e.self_device_time_total for e in kernels) / 1000 / steps, 3
                ),
                "kernels": rows(kernels, "self_device_time_total", 14),
                # What the host spends inside torch ops and CUDA API calls; the rest of the
                # wall time is Python (and the profiler's own cost).
                "host_op_ms_per_step": round(
                    sum(e.self_cpu_time_total for e in host) / 1000 / steps, 3
                ),
                "host_ops": rows(host, "self_cpu_time_total", 10),
            }
        )

    measure("first-step", 1)
    if in_prefill():
        measure("prefill-or-mixed")
    while in_prefill():
        engine.step()
    engine.step()
    measure("decode")
    engine.abort_request([f"prof-{i}" for i in range(n)])
    while engine.has_unfinished_requests():
        engine.step()


def run_hf(w: dict, args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        **{
            k: v
            for k, v in SHAPES[w["shape"]].items()
            if k not in ("architectures", "model_type", "torch_dtype")
        }
    )
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    model.eval()
    vocab = cfg.vocab_size
    prompts = torch.tensor(make_prompts(w, vocab, args.seed), device="cuda")
    bsz = args.hf_batch_size if args.workload != "l1" else 1

    def gen(batch: torch.Tensor, new: int) -> torch.Tensor:
        return model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
        )

    with torch.inference_mode():
        gen(prompts[:bsz], 4)  # warm-up
        _sync()
        start = time.perf_counter()
        out_tokens = 0
        for i in range(0, len(prompts), bsz):
            batch = prompts[i : i + bsz]
            out = gen(batch, w["output_len"])
            out_tokens += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        _sync()
        elapsed = time.perf_counter() - start
    record = {
        "workload": args.workload,
        "system": f"hf-generate-static-bs{bsz}",
        "output_tokens": out_tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(out_tokens / elapsed, 1),
    }
    if args.workload == "l1":
        record["ms_per_token"] = round(1000 * elapsed / out_tokens, 3)
    emit(record)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="w1")
    ap.add_argument("--system", choices=["engine", "hf"], default="engine")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the engine default")
    ap.add_argument("--schedule-conservativeness", type=float, default=1.0,
                    help="room admission keeps for growth (0: none, admit what fits now)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--hf-batch-size", type=int, default=128)
    ap.add_argument("--profile-steps", type=int, default=0)
    ap.add_argument("--sync", action="store_true", help="no asynchronous scheduling")
    ap.add_argument("--repeat", type=int, default=1, help="timed passes through one engine")
    ap.add_argument(
        "--split-kv",
        help="decode attention override PROGRAMS_PER_SM,MAX_SEGMENTS[,TILE] (heuristic tuning)",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                    help="activations (default bfloat16 on a GPU, float32 on the CPU); most "
                         "GPTQ and AWQ checkpoints declare float16")  # fmt: skip
    ap.add_argument("--n", type=int, default=1, help="samples per prompt (parallel sampling)")
    ap.add_argument("--n-as-requests", action="store_true",
                    help="send the --n samples as separate requests (the baseline)")
    ap.add_argument("--quantization", choices=sorted(QUANT_SCHEMES),
                    help="serve the dummy weights in this weight-only format (engine only)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                    help="KV cache element type (engine only): fp8 stores e4m3")
    ap.add_argument("--no-hopper-prefill", action="store_true",
                    help="prefill attention on the Triton kernel, not the Gluon one (A/B)")
    ap.add_argument("--graph-head-layers", type=int, default=0,
                    help="split small decode graphs after this many layers (A/B; 0: whole)")
    ap.add_argument("--tokenizer", default=None,
                    help="with --structured-outputs: a tokenizer directory of 49,152 tokens "
                         "(default: the embedded SmolLM2's, which the GPU machine lacks)")
    ap.add_argument("--structured-outputs", choices=["json"], default=None,
                    help="engine only: the workload free, then every request constrained to a "
                         "JSON schema, then free again (scripts/bench_structured.py)")
    args = ap.parse_args()
    if args.quantization and args.system != "engine":
        ap.error("--quantization runs the engine only")
    if args.kv_cache_dtype != "auto" and args.system != "engine":
        ap.error("--kv-cache-dtype runs the engine only")
    w = dict(WORKLOADS[args.workload])
    if args.num_requests:
        w["num_requests"] = args.num_requests
    if args.workload == "l1":
        args.max_num_seqs = 1
    if args.structured_outputs:
        if args.system != "engine" or args.quantization or args.n != 1:
            ap.error("--structured-outputs runs the engine only, unquantized, n = 1")
        from scripts.bench_structured import run as run_structured

        run_structured(w, args)
        return
    (run_engine if args.system == "engine" else run_hf)(w, args)


if __name__ == "__main__":
    main()
