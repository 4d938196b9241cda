"""Tensor parallelism on one multi-GPU host: correctness first, then W1/W2 and L1.

1. check: greedy output at TP=2/4/8 equals TP=1 token for token on a random-weight model
   (a float32 safetensors checkpoint written here; 16 query / 4 KV heads, so TP=8 also
   replicates KV heads), with CUDA graphs and eagerly.
2. bench: W1 and W2 throughput at TP=2/4, L1 latency at TP=1/2/4/8 (BENCHMARKS.md's
   workloads and shapes, dummy bf16 weights). Each figure is also given as a fraction of
   the limit of the GPUs it used: N x (787.5 TFLOP/s bf16, 4.25 TB/s) per H200.

Every configuration runs in its own child process (fresh GPUs, and a failure or hang of one
cannot stop the others); one JSON line per result, a summary line per phase last.

  python scripts/bench_tp.py                      # check, then every benchmark
  python scripts/bench_tp.py --phase check --tp 1 2 4 8
  python scripts/bench_tp.py --phase bench --workloads l1 --tp 1 2 4 8
  python scripts/bench_tp.py --device cpu --phase check --tp 1 2 --check-shape small  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.bench_common import SHAPES, dummy_model_dir, emit, param_count
from scripts.bench_throughput import (
    PEAK_BW,
    PEAK_FLOPS,
    WORKLOADS,
    floor_seconds,
    greedy_params,
    make_prompts,
    run_steps,
    warm_up,
)

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
BENCH_TP = {"w1": [2, 4], "w2": [2, 4], "l1": [1, 2, 4, 8]}
CHECK_SHAPES: dict[str, dict[str, Any]] = {
    # Heads divide by 8 and KV heads (4) do not: TP=8 puts each KV head on two ranks.
    "medium": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
    ),
    "small": dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=1000,
    ),
}  # fmt: skip
CHECK_LENGTHS = [1, 7, 16, 17, 64, 100, 250, 500, 3, 33, 129, 1000]
CHECK_MAX_TOKENS = 32


# --------------------------------------------------------------- check model
def write_check_model(shape: str, seed: int) -> Path:
    """A random float32 Llama checkpoint (HF names), identical for every TP size."""
    from safetensors.torch import save_file

    c = CHECK_SHAPES[shape]
    path = Path(tempfile.gettempdir()) / f"asyncengine-tp-check-{shape}-{seed}"
    if (path / "model.safetensors").is_file():
        return path
    path.mkdir(exist_ok=True)
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        # Wide enough that logits have clear winners: summation order cannot flip argmax.
        return torch.randn(*shape, generator=gen) * 0.05

    tensors = {
        "model.embed_tokens.weight": rand(v, h),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": rand(v, h),
    }
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
        }
    save_file(tensors, str(path / "model.safetensors"))
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
        tie_word_embeddings=False,
        **c,
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def check_prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in CHECK_LENGTHS]


# ------------------------------------------------------------ child: one run
def child_check(args: argparse.Namespace) -> None:
    from asyncengine import LLM, SamplingParams

    model_dir = Path(args.model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device=args.device,
        tensor_parallel_size=args.tp,
        skip_tokenizer_init=True,
        enforce_eager=args.enforce_eager,
        max_num_seqs=16,
        max_num_batched_tokens=512,  # the longer prompts are prefilled in chunks
        enable_prefix_caching=False,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=CHECK_MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(check_prompts(vocab), params, use_tqdm=False)
        emit({"child": "check", "tokens": [list(o.outputs[0].token_ids) for o in outs]})
    finally:
        llm.llm_engine.shutdown()


def child_bench(args: argparse.Namespace) -> None:
    """One workload at one TP size, timed as scripts/bench_throughput.py times it."""
    from asyncengine import EngineArgs
    from asyncengine.llm_engine import LLMEngine

    w = dict(WORKLOADS[args.workload])
    if args.num_requests:
        w["num_requests"] = args.num_requests
    tp = args.tp
    engine = LLMEngine(
        EngineArgs(
            model=str(dummy_model_dir(w["shape"])),
            load_format="dummy",
            skip_tokenizer_init=True,
            tensor_parallel_size=tp,
            max_num_seqs=1 if args.workload == "l1" else args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enforce_eager=args.enforce_eager,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=False,
            device=args.device,
            dtype="bfloat16" if args.device != "cpu" else "float32",
        )
    )
    try:
        record = _time_workload(engine, w, args)
    finally:
        engine.shutdown()
    emit(record)


def _time_workload(engine: Any, w: dict, args: argparse.Namespace) -> dict[str, Any]:
    tp = args.tp
    vocab = SHAPES[w["shape"]]["vocab_size"]
    params = greedy_params(w["output_len"])
    warm_up(engine, w, params)  # on every rank: each compiles every kernel variant
    prompts = make_prompts(w, vocab, args.seed)
    peak_running = 0

    def on_step(_: float) -> None:
        nonlocal peak_running
        peak_running = max(peak_running, len(engine.scheduler.running))

    out_tokens, elapsed, step_times = run_steps(engine, prompts, params, "r", on_step)
    n, p_len = w["num_requests"], w["prompt_len"]
    params_n = param_count(w["shape"])
    # The floor of one GPU, divided by the N GPUs that share the FLOPs and the bytes.
    floor_1 = floor_seconds(w, peak_running)
    limit_tok_s = tp * n * w["output_len"] / floor_1["total_s"]
    flops = 2 * params_n * (n * p_len + out_tokens)
    record: dict[str, Any] = {
        "workload": args.workload,
        "system": "asyncengine",
        "tensor_parallel_size": tp,
        "graphs": not args.enforce_eager,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "output_tokens": out_tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(out_tokens / elapsed, 1),
        "output_tok_s_per_gpu": round(out_tokens / elapsed / tp, 1),
        "total_tok_s": round((out_tokens + n * p_len) / elapsed, 1),
        "limit_output_tok_s": round(limit_tok_s, 1),
        "fraction_of_limit": round(out_tokens / elapsed / limit_tok_s, 3),
        # Dense-matmul work only (attention excluded), against 787.5 TFLOP/s per GPU.
        "tflops_per_gpu": round(flops / elapsed / tp / 1e12, 2),
        "fraction_of_gpu_flops": round(flops / elapsed / tp / PEAK_FLOPS, 4),
        "peak_running": peak_running,
        "kv_blocks_per_rank": engine.pool.num_blocks,
        "steps": len(step_times),
    }
    if args.workload == "l1":
        decode = step_times[1:]
        decode_s = sum(decode) / max(len(decode), 1)
        weight_bytes_per_gpu = params_n * 2 / tp
        record["ms_per_token"] = round(1000 * elapsed / max(out_tokens, 1), 3)
        record["decode_ms_per_token"] = round(1000 * decode_s, 3)
        record["floor_ms_per_token"] = round(1000 * weight_bytes_per_gpu / PEAK_BW, 3)
        # Each decode step reads every rank's weight shard once: bytes/s per GPU vs 4.25 TB/s.
        record["tb_s_per_gpu"] = round(weight_bytes_per_gpu / decode_s / 1e12, 3)
        record["fraction_of_limit"] = round(weight_bytes_per_gpu / decode_s / PEAK_BW, 3)
    return record


# ----------------------------------------------------------- parent: driving
def run_child(argv: list[str], timeout: float, log: Path) -> tuple[list[dict], str | None]:
    """Run this script as a child; its JSON lines, or an error text if it failed."""
    env = dict(os.environ, **NO_MULTICAST_ENV, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    with log.open("a") as err:
        err.write(f"\n=== {' '.join(argv)}\n")
        err.flush()
        try:
            proc = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout, env=env
            )
        except subprocess.TimeoutExpired:
            return [], f"timed out after {timeout:.0f}s (a hang in a collective?); see {log}"
    records = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    if proc.returncode != 0:
        return records, f"exit code {proc.returncode}; see {log}"
    return records, None


def first_mismatch(ref: list[list[int]], got: list[list[int]]) -> dict[str, int] | None:
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        if a != b:
            diffs = (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            pos = next(diffs, min(len(a), len(b)))
            return {"prompt": i, "position": pos}
    return None


def usable(tp: int, device: str) -> bool:
    return device == "cpu" or tp <= torch.cuda.device_count()


def phase_check(args: argparse.Namespace, log: Path) -> bool:
    model_dir = write_check_model(args.check_shape, args.seed)
    sizes = sorted(set([1, *args.tp]))
    results: dict[tuple[int, bool], list[list[int]]] = {}
    ok = True
    for eager in (False, True) if args.device != "cpu" else (True,):
        for tp in sizes:
            if not usable(tp, args.device):
                emit({"check": "greedy_equal", "tensor_parallel_size": tp, "skipped": "GPUs"})
                continue
            argv = ["--child", "check", "--tp", str(tp), "--model-dir", str(model_dir)]
            argv += ["--device", args.device] + (["--enforce-eager"] if eager else [])
            records, error = run_child(argv, args.timeout, log)
            tokens = next((r["tokens"] for r in records if r.get("child") == "check"), None)
            if tokens is None:
                emit({"check": "greedy_equal", "tensor_parallel_size": tp, "graphs": not eager,
                      "error": error})  # fmt: skip
                ok = False
                continue
            results[(tp, eager)] = tokens
            ref = results.get((1, eager))
            if tp == 1 or ref is None:
                continue
            pairs = [
                (a, b)
                for ra, rb in zip(ref, tokens, strict=True)
                for a, b in zip(ra, rb, strict=False)
            ]
            equal = tokens == ref
            ok &= equal
            emit(
                {
                    "check": "greedy_equal",
                    "tensor_parallel_size": tp,
                    "graphs": not eager,
                    "shape": args.check_shape,
                    "equal": equal,
                    "token_agreement": round(sum(a == b for a, b in pairs) / len(pairs), 4),
                    "first_mismatch": first_mismatch(ref, tokens),
                }
            )
    return ok


def phase_bench(args: argparse.Namespace, log: Path) -> None:
    latency: dict[tuple[int, bool], float] = {}
    for workload in args.workloads:
        sizes = args.tp if args.tp_given else BENCH_TP[workload]
        modes = [False, True] if (workload == "l1" and args.also_eager) else [args.enforce_eager]
        for eager in modes:
            for tp in sizes:
                if not usable(tp, args.device):
                    emit({"workload": workload, "tensor_parallel_size": tp, "skipped": "GPUs"})
                    continue
                argv = ["--child", "bench", "--workload", workload, "--tp", str(tp)]
                argv += ["--device", args.device, "--seed", str(args.seed)]
                argv += ["--max-num-seqs", str(args.max_num_seqs)]
                argv += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
                argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
                if args.num_requests:
                    argv += ["--num-requests", str(args.num_requests)]
                if eager:
                    argv.append("--enforce-eager")
                records, error = run_child(argv, args.timeout, log)
                for r in records:
                    emit(r)
                    if r.get("workload") == "l1" and "decode_ms_per_token" in r:
                        latency[(tp, eager)] = r["decode_ms_per_token"]
                if error:
                    emit({"workload": workload, "tensor_parallel_size": tp, "graphs": not eager,
                          "error": error})  # fmt: skip
    if latency:
        summary = {
            f"tp{tp}{'_eager' if eager else ''}": {
                "decode_ms_per_token": ms,
                "speedup_vs_tp1": round(latency[(1, eager)] / ms, 3)
                if (1, eager) in latency
                else None,
            }
            for (tp, eager), ms in sorted(latency.items())
        }
        emit({"summary": "l1_by_tp", **summary})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--phase", choices=["all", "check", "bench"], default="all")
    ap.add_argument("--tp", type=int, nargs="+", help="TP sizes (default: per workload)")
    ap.add_argument("--workloads", nargs="+", default=["w1", "w2", "l1"], choices=list(WORKLOADS))
    ap.add_argument("--check-shape", choices=sorted(CHECK_SHAPES), default="medium")
    ap.add_argument("--also-eager", action="store_true", help="L1 also with enforce_eager")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the engine default")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per child run")
    ap.add_argument("--log", default=str(Path(tempfile.gettempdir()) / "bench_tp.log"))
    # Internal: one configuration in a child process.
    ap.add_argument("--child", choices=["check", "bench"], help=argparse.SUPPRESS)
    ap.add_argument("--workload", choices=list(WORKLOADS), help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.update(NO_MULTICAST_ENV)
    if args.child:
        args.tp = args.tp[0] if args.tp else 1
        (child_check if args.child == "check" else child_bench)(args)
        return
    args.tp_given = args.tp is not None
    args.tp = args.tp or [1, 2, 4, 8]
    log = Path(args.log)
    ok = True
    if args.phase in ("all", "check"):
        ok = phase_check(args, log)
        emit({"summary": "check", "all_equal": ok})
    if args.phase in ("all", "bench"):
        phase_bench(args, log)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
