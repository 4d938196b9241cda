"""The scheduler alone on a batch workload, each step costed by a simple model of the GPU.

Runs `asyncengine.scheduler.Scheduler` over a pool of blocks with no model: each scheduled
chunk is "computed", each request that reaches its last known token gets a token, and
requests end at max_tokens (as `ignore_eos` benchmarks do). A step is costed as the time to
read the weights once, plus the K/V it reads at the copy rate, plus a fixed time per prefill
token; the defaults are Llama-3-8B's with FP8 weights and KV on the H200 (W2's shape). What
comes out is a modelled throughput, the preemptions and the most requests that ran at once,
for comparing admission policies, not a figure to report as measured.

    python scripts/simulate_admission.py --num-requests 3000 --conservativeness 1 0
    python scripts/simulate_admission.py --kv-bytes-per-token 131072 --pool-tokens 850000

`--max-tokens` above `--output-len` models a chat server: each request may write up to
max_tokens but stops after a length drawn uniformly from 1 to output_len (seeded).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine.admission import GrowthEstimate
from asyncengine.block_pool import BlockPool
from asyncengine.request import Request, RequestStatus
from asyncengine.sampling_params import SamplingParams
from asyncengine.scheduler import Scheduler

COPY_RATE = 4.25e12  # bytes/s, the H200's measured copy rate


def simulate(args: argparse.Namespace, conservativeness: float) -> dict:
    pool = BlockPool(args.pool_tokens // args.block_size, args.block_size, False)
    growth = GrowthEstimate(conservativeness=conservativeness,
                            finish_margin=args.finish_margin)
    max_tokens = args.max_tokens or args.output_len
    if args.warm:  # as after bench_throughput's warm-up: requests seen running to max_tokens
        growth.observe_finish(_finished(args.output_len, max_tokens),
                              RequestStatus.FINISHED_LENGTH)
    sched = Scheduler(pool, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, growth=growth)
    rng = random.Random(args.seed)
    stops = {}
    for i in range(args.num_requests):
        prompt = list(range(i * args.prompt_len, (i + 1) * args.prompt_len))
        sched.add_request(Request(f"r{i}", None, prompt, SamplingParams(), max_tokens))
        stops[f"r{i}"] = rng.randint(1, args.output_len) if args.max_tokens else max_tokens
    seconds, outputs, peak, steps = 0.0, 0, 0, 0
    step_s = args.weight_bytes / COPY_RATE
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps += 1
        peak = max(peak, len(sched.running))
        kv_tokens = sum(s.request.num_computed_tokens for s in out.scheduled)
        prefill = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        seconds += step_s + kv_tokens * args.kv_bytes_per_token / COPY_RATE
        seconds += prefill * args.prefill_s_per_token
        for s in out.scheduled:
            req = s.request
            needs_logits = s.needs_logits
            req.num_computed_tokens += s.num_new_tokens
            if needs_logits:
                req.append_token(1)
                outputs += 1
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
                elif req.num_output_tokens >= stops[req.request_id]:
                    sched.finish_request(req, RequestStatus.FINISHED_STOPPED)
    return {
        "conservativeness": conservativeness,
        "modelled_output_tok_s": round(outputs / seconds),
        "preemptions": sched.num_preemptions,
        "peak_running": peak,
        "steps": steps,
        "final_ratio": round(growth.ratio, 3) if conservativeness > 0 else None,
    }


def _finished(output_len: int, max_tokens: int) -> Request:
    req = Request("warm", None, [0], SamplingParams(), max_tokens)
    req.output_token_ids = [1] * output_len
    return req


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="each request's max_tokens; above --output-len, requests stop early")
    ap.add_argument("--finish-margin", type=float, default=GrowthEstimate.finish_margin,
                    help="GrowthEstimate.finish_margin ('inf': finishes do not lower the ratio)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-tokens", type=int, default=1_700_000,
                    help="KV pool size (W2 FP8 on the H200: about 1.7M tokens)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--conservativeness", type=float, nargs="+", default=[1.0, 0.0])
    ap.add_argument("--weight-bytes", type=float, default=8.5e9)
    ap.add_argument("--kv-bytes-per-token", type=int, default=64 * 1024,
                    help="K and V of all layers (Llama-3-8B in e4m3: 64 KiB)")
    ap.add_argument("--prefill-s-per-token", type=float, default=15e-6)
    ap.add_argument("--no-warm", dest="warm", action="store_false",
                    help="start with nothing learnt (no finished requests seen)")
    args = ap.parse_args()
    for c in args.conservativeness:
        print(json.dumps(simulate(args, c)), flush=True)


if __name__ == "__main__":
    main()
