"""S1 and H1 of BENCHMARKS.md: serving through the WebSocket server (`--api websocket`) or
the OpenAI-compatible HTTP API (`--api openai`: streamed `/v1/completions`) at several rates.

Starts the server in this process (or uses `--url`), drives it from a separate client
process over real connections on loopback with Poisson arrivals at each rate in `--rates`
(`inf` sends everything at once: saturation), then runs the same requests through the
offline engine for the saturation comparison. Prompts are random token ids and EOS is
ignored, so lengths are exactly those drawn from `--seed`. One JSON line per rate/system.
Over HTTP each request is one streamed POST; the tokens of each chunk are counted from
vLLM's `stream_options.continuous_usage_stats`.

  python scripts/bench_serving.py --shape llama2-7b --rates 1,4,16,inf --num-requests 512 \\
      --input-len 512 --output-len 256 --device cuda [--api openai]
  python scripts/bench_serving.py --model /path/to/model --rates 2,inf --device cpu
  python scripts/bench_serving.py --api openai --url http://127.0.0.1:8000 --shape llama2-7b

Mixed lengths: `--input-len-range LO,HI` / `--output-len-range LO,HI` draw each length
log-uniformly from [LO, HI] (as many requests per doubling of length: mostly short, with a
long tail, the shape of chat and RAG traffic). `--workload long-mixed` is issue #20's long-prompt
case: prompts 32-8192 and outputs 32-1024 tokens on the Llama-3.1-8B shape, 256 requests at
6 and 12 req/s, over the OpenAI API. Each record carries `fraction_of_floor`: the least time
one H200 needs for those requests at those arrival times (bench_common's floor), over the
measured time. `--max-num-batched-tokens-sweep 2048,4096,...` runs the whole benchmark once
per chunked-prefill budget, each in a fresh process (a fresh server and engine), and prints
a markdown table of TTFT, ITL, throughput and fraction of the floor per budget and rate.

  python scripts/bench_serving.py --workload long-mixed --device cuda \
      --max-num-batched-tokens-sweep 2048,4096,8192,16384

`multi-turn` (first argument) is the multi-turn chat benchmark through vllm-router, policy
against policy on the same conversations (scripts/bench_multiturn.py says more):

  python scripts/bench_serving.py multi-turn --device cpu --data-parallel-size 2
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import multiprocessing as mp
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from frontends.cli import add_engine_args, engine_args_from, run_async
from scripts.bench_common import (
    SHAPES,
    dummy_model_dir,
    emit,
    floor_seconds_for,
    param_count,
    request_floor_seconds,
)

# Named workloads: defaults for the flags below (explicit flags still win).
WORKLOADS: dict[str, dict[str, Any]] = {
    # Issue #20 item 4: long prompts among short ones, Poisson arrivals through the OpenAI API;
    # 9216 = the longest prompt plus the longest output.
    "long-mixed": dict(shape="llama3.1-8b", api="openai", input_len_range="32,8192",
                       output_len_range="32,1024", max_model_len=9216, num_requests=256,
                       rates="6,12", skip_offline=True, skip_tokenizer_init=True),
}


@dataclasses.dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclasses.dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = dataclasses.field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    error: str = ""

    def add_tokens(self, n: int, now: float, sent: float, last: float) -> float:
        """Account `n` tokens arriving together at `now`; returns the new last-arrival time.
        The first arrival sets TTFT; a merged delta's gap is spread over its tokens."""
        if self.output_tokens == 0:
            self.ttft = now - sent
            self.itls.extend([0.0] * (n - 1))
        else:
            self.itls.extend([(now - last) / n] * n)
        self.output_tokens += n
        return now


def parse_range(text: str | None) -> tuple[int, int] | None:
    """`LO,HI` as a pair of token counts, 1 <= LO <= HI."""
    if not text:
        return None
    lo, hi = (int(v) for v in text.split(","))
    if not 1 <= lo <= hi:
        raise ValueError(f"length range {text!r}: need 1 <= LO <= HI")
    return lo, hi


def log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi] whose logarithm is uniform: each doubling of length is
    drawn as often (floor of a continuous log-uniform draw on [lo, hi + 1))."""
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def make_requests(n: int, input_len: int, output_len: int, jitter: float, vocab: int,
                  seed: int, content_seed: int = 0,
                  input_range: tuple[int, int] | None = None,
                  output_range: tuple[int, int] | None = None) -> list[BenchRequest]:
    """Lengths come from `seed`; token ids from `content_seed`, so every run can have the
    same shapes with fresh content (no prefix-cache hits from a previous run). A length
    with a range is drawn log-uniformly from it, else uniformly within ±jitter of its mean."""
    rng = random.Random(seed)
    ids_rng = random.Random(f"{seed}/{content_seed}")

    def draw(mean: int, span: tuple[int, int] | None) -> int:
        if span is not None:
            return log_uniform_int(rng, *span)
        lo, hi = max(1, round(mean * (1 - jitter))), max(1, round(mean * (1 + jitter)))
        return rng.randint(lo, hi)

    # Avoid the lowest ids, which are often special tokens in real vocabularies.
    low = min(100, vocab // 2)
    out = []
    for _ in range(n):
        in_len, out_len = draw(input_len, input_range), draw(output_len, output_range)
        out.append(BenchRequest([ids_rng.randrange(low, vocab) for _ in range(in_len)], out_len))
    return out


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ----------------------------------------------------------------------- client process
async def _drive(url: str, api_key: str | None, requests: list[BenchRequest],
                 arrivals: list[float], num_connections: int) -> tuple[list[RequestResult], float]:
    from frontends.client import AsyncClient

    clients = [AsyncClient(url, api_key) for _ in range(num_connections)]
    for c in clients:
        await c.connect()
    clock = time.perf_counter  # the loop's clock may tick in whole milliseconds (uvloop)

    async def one(i: int, start_at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start_at - clock()))
        req = requests[i]
        sent = last = clock()
        res = RequestResult(ok=False)
        try:
            async for chunk in clients[i % num_connections].generate(
                prompt_token_ids=req.prompt_token_ids, max_tokens=req.output_len,
                temperature=0.0, ignore_eos=True,
            ):
                if chunk.token_ids:
                    last = res.add_tokens(len(chunk.token_ids), clock(), sent, last)
            res.e2e = clock() - sent
            res.ok = True
        except Exception as exc:  # reported per request in the summary
            res.error = f"{type(exc).__name__}: {exc}"
        return res

    t0 = clock() + 0.05
    results = await asyncio.gather(*(one(i, t0 + a) for i, a in enumerate(arrivals)))
    duration = clock() - t0
    for c in clients:
        await c.close()
    return list(results), duration


def _http_client_module() -> Any:
    """httpx's successor where it is installed (the `openai` client's), else httpx."""
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx


async def _drive_openai(url: str, api_key: str | None, requests: list[BenchRequest],
                        arrivals: list[float]) -> tuple[list[RequestResult], float]:
    """The requests as streamed `/v1/completions` POSTs, one connection each."""
    import msgspec

    httpx = _http_client_module()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(requests) + 1,
                          max_keepalive_connections=len(requests) + 1)
    client = httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=None)
    model = (await client.get("/v1/models")).json()["data"][0]["id"]
    clock = time.perf_counter

    async def one(i: int, start_at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start_at - clock()))
        req = requests[i]
        body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        sent = last = clock()
        res = RequestResult(ok=False)
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: "
                                       f"{(await response.aread())[:200]!r}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = msgspec.json.decode(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"].get("message"))
                    if not chunk["choices"]:
                        continue  # the closing usage chunk
                    n = chunk["usage"]["completion_tokens"] - res.output_tokens
                    if n > 0:
                        last = res.add_tokens(n, clock(), sent, last)
            res.e2e = clock() - sent
            res.ok = True
        except Exception as exc:  # reported per request in the summary
            res.error = f"{type(exc).__name__}: {exc}"
        return res

    t0 = clock() + 0.05
    results = await asyncio.gather(*(one(i, t0 + a) for i, a in enumerate(arrivals)))
    duration = clock() - t0
    await client.aclose()
    return list(results), duration


def _client_process(conn: Any, api: str, url: str, api_key: str | None,
                    requests: list[BenchRequest], arrivals: list[float],
                    num_connections: int) -> None:
    if api == "openai":
        conn.send(run_async(_drive_openai(url, api_key, requests, arrivals)))
    else:
        conn.send(run_async(_drive(url, api_key, requests, arrivals, num_connections)))
    conn.close()


async def run_clients(api: str, url: str, api_key: str | None, requests: list[BenchRequest],
                      arrivals: list[float],
                      num_connections: int) -> tuple[list[RequestResult], float]:
    """Run the clients in their own process so they do not share the server's GIL."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_client_process,
                       args=(child, api, url, api_key, requests, arrivals, num_connections))
    proc.start()
    child.close()
    result = await asyncio.to_thread(parent.recv)
    await asyncio.to_thread(proc.join)
    return result


# ----------------------------------------------------------------------- reporting
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclasses.dataclass
class FloorModel:
    """What the floor needs to know of the served model and engine."""

    shape: str
    max_num_seqs: int
    weight_bytes: int
    kv_elem_bytes: int = 2


def serving_floor(model: FloorModel, requests: list[BenchRequest],
                  arrivals: list[float]) -> dict[str, float]:
    """The least time from the first arrival to the last token on one H200: the larger of
    the work's floor (all requests' prefill, KV and weight reads) and the arrival bound (no
    request finishes before it arrives and runs alone at the floor)."""
    lens = [(len(r.prompt_token_ids), r.output_len) for r in requests]
    work = floor_seconds_for(model.shape, [p for p, _ in lens], lens, model.max_num_seqs,
                             model.weight_bytes, model.kv_elem_bytes)
    arrival_bound = max((a + request_floor_seconds(model.shape, p, o, model.weight_bytes,
                                                   model.kv_elem_bytes)
                         for a, (p, o) in zip(arrivals, lens, strict=True)), default=0.0)
    return {**work, "work_s": work["total_s"], "arrival_bound_s": arrival_bound,
            "total_s": max(work["total_s"], arrival_bound)}


def summarize(system: str, rate: float, results: list[RequestResult], duration: float,
              common: dict[str, Any], requests: list[BenchRequest] | None = None,
              arrivals: list[float] | None = None,
              floor_model: FloorModel | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    itls = [x for r in ok for x in r.itls]
    out_tokens = sum(r.output_tokens for r in ok)
    record = {
        "system": system, "rate": "inf" if math.isinf(rate) else rate,
        "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": round(duration, 3),
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": out_tokens / duration,
        "ttft_p50_ms": pct(ttfts, 0.5) * 1e3, "ttft_p90_ms": pct(ttfts, 0.9) * 1e3,
        "ttft_p99_ms": pct(ttfts, 0.99) * 1e3,
        "itl_p50_ms": pct(itls, 0.5) * 1e3, "itl_p99_ms": pct(itls, 0.99) * 1e3,
        "e2e_p50_s": pct([r.e2e for r in ok], 0.5),
        **common,
    }
    if requests is not None:
        done = [q for q, r in zip(requests, results, strict=True) if r.ok]
        prompt_tokens = sum(len(q.prompt_token_ids) for q in done)
        record["prompt_tokens"] = prompt_tokens
        record["total_tokens_per_s"] = (prompt_tokens + out_tokens) / duration
        if floor_model is not None and arrivals is not None and len(done) == len(requests):
            floor = serving_floor(floor_model, requests, arrivals)
            record["floor"] = {k: round(v, 6) for k, v in floor.items()}
            record["fraction_of_floor"] = round(floor["total_s"] / duration, 4)
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        record["errors"] = errors[:5]
    return record


def sweep_table(records: list[dict[str, Any]]) -> str:
    """One markdown row per chunked-prefill budget and rate."""
    head = ("| max_num_batched_tokens | rate (req/s) | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
            "| ITL p99 ms | output tok/s | fraction of floor |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in records:
        frac = r.get("fraction_of_floor")
        lines.append(
            f"| {r['max_num_batched_tokens']} | {r['rate']} | {r['ttft_p50_ms']:.1f} "
            f"| {r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} "
            f"| {r['output_tokens_per_s']:.1f} | {'—' if frac is None else f'{frac:.3g}'} |")
    return "\n".join(lines)


def offline_run(llm_engine: Any, requests: list[BenchRequest]) -> tuple[float, int]:
    """The same requests through the engine's own step loop: (seconds, output tokens)."""
    from asyncengine.sampling_params import RequestOutputKind, SamplingParams

    for i, req in enumerate(requests):
        llm_engine.add_request(
            f"offline-{i}", None,
            SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True,
                           output_kind=RequestOutputKind.FINAL_ONLY),
            prompt_token_ids=req.prompt_token_ids)
    t0 = time.perf_counter()
    tokens = 0
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    _sync()
    return time.perf_counter() - t0, tokens


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------- main
async def bench(ns: argparse.Namespace) -> None:
    from asyncengine.async_engine import AsyncLLMEngine
    from frontends.openai_api import OpenAIConfig, serve_openai
    from frontends.server import ServerConfig, serve_engine

    http = ns.api == "openai"
    rates = [float(r) for r in ns.rates.split(",")]
    input_range, output_range = parse_range(ns.input_len_range), parse_range(ns.output_len_range)
    lengths: dict[str, Any] = {
        "input_len": list(input_range) if input_range else ns.input_len,
        "output_len": list(output_range) if output_range else ns.output_len,
        "len_dist": "log-uniform" if input_range or output_range else "uniform",
        "len_jitter": ns.len_jitter,
    }
    common: dict[str, Any] = {
        "benchmark": ns.workload or ("H1" if http else "S1"), "api": ns.api,
        "num_requests": ns.num_requests, **lengths, "seed": ns.seed,
        "connections": ns.num_requests if http else ns.num_connections, "host": platform.node(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }
    engine = None
    if ns.url is None:
        if ns.shape is not None:
            ns.model, ns.load_format = str(dummy_model_dir(ns.shape)), "dummy"
        engine = AsyncLLMEngine.from_engine_args(engine_args_from(ns))
        vocab = int(engine.model_config.vocab_size)
        common["model"] = engine.model_name
        common["device"] = engine.stats().device.name or str(getattr(engine.engine, "device", ""))
        common["max_num_batched_tokens"] = engine.engine.max_num_batched_tokens
    else:
        vocab = ns.vocab_size or (SHAPES[ns.shape]["vocab_size"] if ns.shape else 32000)
        common["url"] = ns.url
        common["max_num_batched_tokens"] = ns.max_num_batched_tokens
    floor_model = None
    if ns.shape is not None and ns.quantization in (None, "none"):
        # The floor's numbers are one H200's; bf16 weights, the KV cache's element size.
        floor_model = FloorModel(ns.shape, ns.max_num_seqs, 2 * param_count(ns.shape),
                                 1 if ns.kv_cache_dtype.startswith("fp8") else 2)

    def requests_for(run: int) -> list[BenchRequest]:
        return make_requests(ns.num_requests, ns.input_len, ns.output_len, ns.len_jitter,
                             vocab, ns.seed, content_seed=run, input_range=input_range,
                             output_range=output_range)

    # Prompts of the run's lengths, so prefill and chunking see the same shapes when timed.
    warmup = make_requests(ns.num_warmup, ns.input_len, min(ns.output_len, 16), 0.0, vocab,
                           ns.seed + 1, content_seed=-1, input_range=input_range)

    async def serve_rates(url: str, api_key: str | None) -> dict[float, dict[str, Any]]:
        records = {}
        if warmup:
            await run_clients(ns.api, url, api_key, warmup, [0.0] * len(warmup), 1)
        for run, rate in enumerate(rates):
            arrivals = arrival_times(ns.num_requests, rate, ns.seed)
            requests = requests_for(run)
            results, duration = await run_clients(ns.api, url, api_key, requests, arrivals,
                                                  ns.num_connections)
            system = "asyncengine-openai" if http else "asyncengine-serve"
            records[rate] = summarize(system, rate, results, duration, common, requests,
                                      arrivals, floor_model)
            emit(records[rate])
        return records

    if engine is None:
        await serve_rates(ns.url, ns.api_key)
        return
    if http:
        http_config = OpenAIConfig(port=0, max_queued_requests=max(1024, ns.num_requests),
                                   max_queued_prompt_tokens=1 << 30)
        async with serve_openai(engine, http_config) as api_server:
            records = await serve_rates(api_server.url, None)
    else:
        config = ServerConfig(port=0, max_queued_requests=max(1024, ns.num_requests),
                              max_queued_prompt_tokens=1 << 30,
                              max_requests_per_connection=max(256, ns.num_requests))
        async with serve_engine(engine, config) as server:
            records = await serve_rates(server.url, None)
    if not ns.skip_offline:
        # The offline loop runs on the step thread too, the thread that built the engine and
        # served: the comparison then measures the frontend alone.
        await engine.run_in_engine_thread(lambda e: offline_run(e, warmup))
        seconds, tokens = await engine.run_in_engine_thread(
            lambda e: offline_run(e, requests_for(len(rates)))
        )
    await engine.shutdown()

    if not ns.skip_offline:
        offline = {"system": "asyncengine-offline", "rate": "inf",
                   "completed": ns.num_requests, "duration_s": round(seconds, 3),
                   "request_throughput": ns.num_requests / seconds,
                   "output_tokens_per_s": tokens / seconds, **common}
        sat = max(rates)
        if sat in records:
            served = records[sat]["output_tokens_per_s"]
            offline["serve_over_offline"] = served / offline["output_tokens_per_s"]
            offline["frontend_overhead"] = 1.0 - offline["serve_over_offline"]
        emit(offline)


def sweep_command(argv: list[str], budget: int) -> list[str]:
    """This script with the same flags, one chunked-prefill budget and no sweep (a later
    flag wins over an earlier one)."""
    return [sys.executable, str(Path(__file__).resolve()), *argv,
            "--max-num-batched-tokens", str(budget), "--max-num-batched-tokens-sweep", ""]


def run_sweep(argv: list[str], budgets: list[int]) -> list[dict[str, Any]]:
    """The benchmark once per chunked-prefill budget, each in its own process (a fresh
    engine and server, all of the GPU's memory); their JSON lines pass through."""
    records = []
    for budget in budgets:
        cmd = sweep_command(argv, budget)
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(line, end="", flush=True)
                if line.startswith("{"):
                    record = json.loads(line)
                    if record.get("system") != "asyncengine-offline":
                        records.append(record)
        if proc.returncode:
            print(f"budget {budget}: exit status {proc.returncode}", file=sys.stderr)
    return records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                        help="a named workload: defaults for the flags below "
                             "(long-mixed: issue #20's long prompts)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="a BENCHMARKS.md model shape with dummy weights (sets --model)")
    parser.add_argument("--api", choices=["websocket", "openai"], default="websocket",
                        help="websocket: S1 over the WebSocket protocol; openai: H1, streamed "
                             "/v1/completions over HTTP")
    parser.add_argument("--url", default=None,
                        help="benchmark a running server instead (ws://… for websocket, "
                             "http://… for openai)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="vocabulary size for prompts when using --url")
    parser.add_argument("--rates", default="1,4,16,inf",
                        help="request rates (req/s), comma-separated; inf = all at once")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--num-warmup", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--len-jitter", type=float, default=0.5,
                        help="lengths uniform in [L*(1-j), L*(1+j)]")
    parser.add_argument("--input-len-range", default=None, metavar="LO,HI",
                        help="prompt lengths log-uniform in [LO, HI] (replaces --input-len)")
    parser.add_argument("--output-len-range", default=None, metavar="LO,HI",
                        help="output lengths log-uniform in [LO, HI] (replaces --output-len)")
    parser.add_argument("--max-num-batched-tokens-sweep", default=None, metavar="B1,B2,...",
                        help="run everything once per chunked-prefill budget (a fresh process "
                             "each) and print a markdown table")
    parser.add_argument("--num-connections", type=int, default=8)
    parser.add_argument("--skip-offline", action="store_true")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, with a named workload's values as defaults under explicit ones."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.workload is not None:
        parser.set_defaults(**WORKLOADS[ns.workload])
        ns = parser.parse_args(argv)
    if ns.seed is None:
        ns.seed = 0
    return ns


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["multi-turn"]:  # its own mode: conversations through vllm-router
        from scripts.bench_multiturn import main as multi_turn

        multi_turn(argv[1:])
        return
    ns = parse_args(argv)
    if ns.max_num_batched_tokens_sweep:
        budgets = [int(b) for b in ns.max_num_batched_tokens_sweep.split(",")]
        print(sweep_table(run_sweep(argv, budgets)), flush=True)
        return
    run_async(bench(ns))


if __name__ == "__main__":
    main()
