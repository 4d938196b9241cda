"""C1 of BENCHMARKS.md: offline throughput on the CPU with the embedded SmolLM2-135M.

32 requests (by default) with prompt and output lengths drawn uniformly from 16-128 under a
fixed seed, random prompt token ids, greedy, EOS ignored, float32. The engine runs them all
at once; the peer in the same run is HF transformers `generate` on the same converted
weights, in static batches with left padding and attention masks, as its users run it.
Each static batch generates its longest request's length; only the tokens each request asked
for count as output. The best HF batch size tried is the peer of the final ratio.

Prints one JSON line per system and a final line with the ratio (target: >= 2x on any draw,
`--seed`). `--profile` adds a cProfile of a short engine run and, per batch size, how a decode
step's time splits between the linears, the LM head, attention and the other ops.

  python scripts/bench_cpu.py
  python scripts/bench_cpu.py --hf-batch-sizes 8,16,32 --threads 2 --profile
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# OpenMP threads that spin while waiting starve each other when other processes share the
# cores: a 32x576x1536 matmul on 2 threads measured 20x slower on a busy 2-core box, and 1.1x
# with passive waiting. Set before torch loads its OpenMP runtime; export ACTIVE to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.bench_common import common_prefix, emit

MIN_LEN, MAX_LEN = 16, 128
TARGET_RATIO = 2.0


def make_workload(num_requests: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, reproducible from the seed."""
    rng = random.Random(seed)
    work = []
    for _ in range(num_requests):
        prompt_len = rng.randint(MIN_LEN, MAX_LEN)
        output_len = rng.randint(MIN_LEN, MAX_LEN)
        # Skip the low ids, where the special tokens live.
        work.append(([rng.randrange(10, vocab) for _ in range(prompt_len)], output_len))
    return work


def machine_note() -> dict[str, Any]:
    load1, _, _ = os.getloadavg()
    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_avg_1m": round(load1, 2),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def record(system: str, work: list[tuple[list[int], int]], out_tokens: int, elapsed: float,
           config: dict[str, Any]) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p, _ in work)
    return {
        "benchmark": "C1",
        "system": system,
        "num_requests": len(work),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(out_tokens / elapsed, 2),
        "total_tok_s": round((prompt_tokens + out_tokens) / elapsed, 2),
        "config": config | {"machine": machine_note()},
    }


# ------------------------------------------------------------------- systems
Work = list[tuple[list[int], int]]


class EngineSystem:
    """The engine on the embedded model: all requests at once through `LLM.generate`."""

    name = "asyncengine"

    def __init__(self, args: argparse.Namespace) -> None:
        from asyncengine import LLM

        engine_args: dict[str, Any] = {"dtype": "float32", "device": "cpu"}
        if args.max_num_batched_tokens:
            engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
        if args.async_scheduling is not None:
            engine_args["async_scheduling"] = args.async_scheduling
        self.llm = LLM(model=None, **engine_args)

    @staticmethod
    def params(n: int) -> Any:
        from asyncengine import SamplingParams

        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def warm_up(self, work: Work) -> None:
        # A prefill, mixed steps and decodes at a small size.
        self.llm.generate([p for p, _ in work[:4]], self.params(8), use_tqdm=False)

    def run_once(self, work: Work) -> tuple[float, list[list[int]]]:
        engine = self.llm.llm_engine
        timing = getattr(engine, "step_timing", None)
        for k in timing or {}:
            timing[k] = 0
        start = time.perf_counter()
        outs = self.llm.generate(
            [p for p, _ in work], [self.params(n) for _, n in work], use_tqdm=False
        )
        elapsed = time.perf_counter() - start
        self.last_timing = dict(timing) if timing is not None else None
        return elapsed, [list(o.outputs[0].token_ids) for o in outs]

    def config(self) -> dict[str, Any]:
        engine = self.llm.llm_engine
        config: dict[str, Any] = {
            "dtype": "float32",
            "max_num_batched_tokens": engine.max_num_batched_tokens,
            "max_num_seqs": engine.scheduler.max_num_seqs,
            "kv_blocks": engine.pool.num_blocks,
            "block_size": engine.pool.block_size,
            "num_preemptions": engine.scheduler.num_preemptions,
        }
        if self.last_timing is not None:
            config["step_timing_s"] = {k: round(v, 3) for k, v in self.last_timing.items()}
        # What start-up tuning picked per linear layer group (timings vary between runs).
        from models.linear_tuning import describe_matmul_plans

        config["matmul_plans"] = describe_matmul_plans(engine.runner.model)
        return config

    def profile(self, work: Work) -> None:
        """cProfile of a shortened run (printed to stderr): where the host time goes."""
        import cProfile
        import io
        import pstats

        short = [(p, min(n, 32)) for p, n in work]
        prof = cProfile.Profile()
        prof.enable()
        self.llm.generate([p for p, _ in short], [self.params(n) for _, n in short],
                          use_tqdm=False)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        print(buf.getvalue(), file=sys.stderr)
        for batch in (1, 8, len(work)):
            print(json.dumps(self.decode_step_split(work[:batch])), file=sys.stderr)

    def decode_step_split(self, work: Work, steps: int = 3) -> dict[str, Any]:
        """Milliseconds per decode step of len(work) requests, by group of torch ops."""
        from torch.profiler import ProfilerActivity, profile

        engine = self.llm.llm_engine
        for i, (p, _) in enumerate(work):
            engine.add_request(f"profile-{i}", p, self.params(2 * steps + 4))
        engine.step()
        while not engine.runner.last_step_decode_only:  # past the prefill
            engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall_ms = 1000 * (time.perf_counter() - start) / steps
        with profile(activities=[ProfilerActivity.CPU]) as prof, _labelled_native_kernels():
            for _ in range(steps):
                engine.step()
        while engine.has_unfinished_requests():
            engine.step()
        groups = {
            # The layers' linears, and the LM head where start-up tuning kept BLAS for it.
            "matmul_blas": ("aten::mm", "aten::addmm"),
            "matmul_onednn_packed": ("mkldnn::_linear_pointwise", "aten::mkldnn_linear",
                                     "aten::to_mkldnn", "aten::_to_dense"),
            # The C kernels (asyncengine_kernels/cpu_gemm.py,
            # asyncengine_kernels/cpu_decode_attention.py), labelled for the profiler by
            # _labelled_native_kernels; the GEMM includes the RMSNorm or SiLU-and-mul it forms.
            "matmul_cpu_gemm": ("cpu_gemm",),
            "attention_c_decode": ("cpu_decode_attention",),
            "attention_sdpa": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
            "kv_gather": ("aten::index_select",),
        }
        self_ms = {e.key: e.self_cpu_time_total / 1000 / steps for e in prof.key_averages()}
        split = {g: sum(self_ms.get(k, 0.0) for k in keys) for g, keys in groups.items()}
        split["other_ops"] = sum(self_ms.values()) - sum(split.values())
        # Python between the ops (the profiler's own cost inflates the ops a little).
        split["rest"] = wall_ms - sum(self_ms.values())
        return {"decode_batch": len(work), "step_ms": round(wall_ms, 1)} | {
            k: round(v, 1) for k, v in split.items()
        }


@contextlib.contextmanager
def _labelled_native_kernels() -> Iterator[None]:
    """Name the C kernels' calls for torch.profiler (ctypes calls are no torch ops)."""
    from torch.profiler import record_function

    import asyncengine_kernels.cpu_attention as cpu_attention
    from asyncengine_kernels.cpu_gemm import CpuGemmLib

    def labelled(fn: Any, label: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return fn(*args, **kwargs)

        return call

    targets = [(CpuGemmLib, name, "cpu_gemm")
               for name in ("linear", "linear_gated", "linear_normed")]  # fmt: skip
    targets.append((cpu_attention, "paged_decode_attention_cpu", "cpu_decode_attention"))
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    for owner, name, label in targets:
        setattr(owner, name, labelled(getattr(owner, name), label))
    try:
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


class HFStaticSystem:
    """HF `generate` in static batches of `batch_size`, left-padded with attention masks."""

    def __init__(self, model: Any, batch_size: int, pad_id: int) -> None:
        self.model, self.batch_size, self.pad_id = model, batch_size, pad_id
        self.name = f"hf-generate-static-bs{batch_size}"

    def _generate(self, batch: Work) -> list[list[int]]:
        width = max(len(p) for p, _ in batch)
        new = max(n for _, n in batch)  # one length per call: the batch's longest request
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                min_new_tokens=new, pad_token_id=self.pad_id,
            )
        return [out[i, width : width + n].tolist() for i, (_, n) in enumerate(batch)]

    def _batches(self, work: Work) -> list[Work]:
        return [work[i : i + self.batch_size] for i in range(0, len(work), self.batch_size)]

    def warm_up(self, work: Work) -> None:
        self._generate(work[: min(self.batch_size, 4)])

    def run_once(self, work: Work) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        tokens = [t for batch in self._batches(work) for t in self._generate(batch)]
        return time.perf_counter() - start, tokens

    def config(self, work: Work) -> dict[str, Any]:
        generated = sum(len(b) * max(n for _, n in b) for b in self._batches(work))
        return {
            "dtype": "float32",
            "batch_size": self.batch_size,
            "padding": "left",
            "tokens_generated_incl_padding_waste": generated,
        }


def load_hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


# --------------------------------------------------------------------- main
def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """How far two greedy runs agree (float32 sums in another order may flip near-ties)."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = sum(common_prefix(x, y) for x, y in zip(a, b, strict=True))
    total = sum(len(x) for x in a)
    return {"identical_requests": same / len(a), "common_prefix_tokens": prefix / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-sizes", default="8,32",
                    help="comma-separated static batch sizes to try for the HF peer")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (C1: 2)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine's async_scheduling (default: the engine's, off on CPU)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds; each round runs every system once and the best time counts "
                         "(rounds interleave the systems, so a busy spell hits them alike)")
    ap.add_argument("--skip-hf", action="store_true", help="engine only (no ratio)")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile a short engine run (printed to stderr)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from models.config import ModelConfig
    from models.default_model import default_model_dir

    model_dir = default_model_dir()
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    work = make_workload(args.num_requests, vocab, args.seed)

    engine = EngineSystem(args)
    systems: list[Any] = [engine]
    if not args.skip_hf:
        model = load_hf(model_dir)
        pad_id = model.config.pad_token_id
        if pad_id is None:
            eos = model.config.eos_token_id
            pad_id = eos if isinstance(eos, int) else 0
        systems += [HFStaticSystem(model, int(b), pad_id) for b in args.hf_batch_sizes.split(",")]
    for system in systems:
        system.warm_up(work)

    best: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    loads: list[float] = []
    for _ in range(args.repeat):
        for system in systems:
            loads.append(os.getloadavg()[0])
            elapsed, tokens[system.name] = system.run_once(work)
            best[system.name] = min(best.get(system.name, float("inf")), elapsed)
    expected = [n for _, n in work]
    for name, toks in tokens.items():
        assert [len(t) for t in toks] == expected, f"{name}: output lengths differ"

    records = []
    for system in systems:
        config = system.config() if system is engine else system.config(work)
        config["rounds"] = args.repeat
        if system is not engine:
            config["greedy_agreement_with_engine"] = greedy_agreement(
                tokens[engine.name], tokens[system.name]
            )
        out_tokens = sum(len(t) for t in tokens[system.name])
        records.append(record(system.name, work, out_tokens, best[system.name], config))
        emit(records[-1])
    if args.profile:
        engine.profile(work)
    if args.skip_hf:
        return
    peer = max(records[1:], key=lambda r: r["output_tok_s"])
    ratio = records[0]["output_tok_s"] / peer["output_tok_s"]
    emit({
        "benchmark": "C1",
        "ratio_output_tok_s": round(ratio, 3),
        "ratio_total_tok_s": round(records[0]["total_tok_s"] / peer["total_tok_s"], 3),
        "engine": records[0]["system"],
        "peer": peer["system"],
        "target": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        # Other processes on the machine slow every system; a high load makes the ratio noisy.
        "load_avg_1m_during_runs": [round(x, 2) for x in loads],
        "machine": machine_note(),
    })


if __name__ == "__main__":
    main()
