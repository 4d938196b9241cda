"""Multi-turn chat through vllm-router: does cache-aware routing pay?

Conversations share a few long system prompts and grow turn by turn (each turn sends the
whole history plus a new user message), the traffic where a replica's prefix cache holds
most of each prompt if the router keeps a conversation where its prefix already is. For
each `--policies` entry a fresh fleet (`serve --data-parallel-size N`, the same replicas
and flags) serves the same conversations; replies are greedy, so every policy sees the
same requests. Per policy: the replicas' prefix-cache hit rate (prompt tokens found in the
cache over tokens looked up, from their /metrics), output and total token throughput, and
TTFT p50/p99 of the streamed chat completions. One JSON line per policy, then a table.

  python scripts/bench_serving.py multi-turn --device cpu --data-parallel-size 2 \\
      --num-conversations 8 --turns 3 --system-len 300
  python scripts/bench_serving.py multi-turn --device cuda --data-parallel-size 2 \\
      --replicas-per-gpu 2 --gpu-memory-utilization 0.45 --num-conversations 64 \\
      --turns 6 --system-prompts 8 --system-len 2000 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import httpx2

from frontends.fleet import Fleet, FleetConfig, free_port

_WORDS = ["river", "market", "engine", "signal", "garden", "orbit", "lantern", "copper",
          "meadow", "harbor", "pixel", "thunder", "velvet", "glacier", "summit", "quartz",
          "ember", "canyon", "falcon", "willow", "beacon", "prism", "cobalt", "saffron",
          "tundra", "ripple", "mosaic", "cipher"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def conversations(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """Each conversation: its system prompt (one of a few shared ones) and its user turns."""
    rng = random.Random(ns.seed)
    systems = [f"You are assistant number {i}. " + words(rng, ns.system_len)
               for i in range(ns.system_prompts)]
    return [{"system": systems[c % len(systems)],
             "users": [words(rng, ns.user_len) for _ in range(ns.turns)]}
            for c in range(ns.num_conversations)]


async def one_turn(http: httpx2.AsyncClient, messages: list[dict[str, str]],
                   max_tokens: int) -> dict[str, Any]:
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    ttft, text, usage = None, "", None
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                piece = choice["delta"].get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - sent
                text += piece
    assert usage is not None, "no usage chunk"
    return {"ttft": ttft or 0.0, "text": text, "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"]}


async def run_workload(url: str, convs: list[dict[str, Any]], ns: argparse.Namespace
                       ) -> dict[str, Any]:
    sem = asyncio.Semaphore(ns.concurrency)
    results: list[dict[str, Any]] = []
    replies: list[list[str]] = []

    async def conversation(conv: dict[str, Any]) -> None:
        messages = [{"role": "system", "content": conv["system"]}]
        mine: list[str] = []
        for user in conv["users"]:
            messages.append({"role": "user", "content": user})
            async with sem:
                out = await one_turn(http, messages, ns.max_tokens)
            results.append(out)
            mine.append(out["text"])
            messages.append({"role": "assistant", "content": out["text"]})
        replies.append(mine)

    async with httpx2.AsyncClient(base_url=url, timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in convs))
        elapsed = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in results)
    out_tokens = sum(r["completion_tokens"] for r in results)
    in_tokens = sum(r["prompt_tokens"] for r in results)
    return {"requests": len(results), "elapsed_s": round(elapsed, 3),
            "prompt_tokens": in_tokens, "output_tokens": out_tokens,
            "output_tok_per_s": round(out_tokens / elapsed, 2),
            "total_tok_per_s": round((in_tokens + out_tokens) / elapsed, 2),
            "req_per_s": round(len(results) / elapsed, 3),
            "ttft_p50_s": round(statistics.median(ttfts), 4),
            "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 4),
            "replies_digest": hash(tuple(tuple(r) for r in sorted(replies))) & 0xFFFFFFFF}


async def prefix_counters(urls: list[str]) -> list[tuple[float, float]]:
    """(hits, queries) of each replica, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    async with httpx2.AsyncClient(timeout=30) as http:
        for url in urls:
            text = (await http.get(f"{url}/metrics")).text
            values = {s.name: s.value for fam in text_string_to_metric_families(text)
                      for s in fam.samples}
            out.append((values.get("asyncengine_prefix_cache_hits_total", 0.0),
                        values.get("asyncengine_prefix_cache_queries_total", 0.0)))
    return out


def shape_with_tokenizer(shape: str, tokenizer_dir: Path) -> Path:
    """A dummy-weight model directory of `shape` that carries the tokenizer files of
    `tokenizer_dir`, its vocabulary resized to the tokenizer's (a real model's layers and
    a real tokenizer on a machine that holds no real weights)."""
    from transformers import AutoTokenizer

    from scripts.bench_common import SHAPES

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    path = Path(tempfile.gettempdir()) / f"asyncengine-dummy-{shape}-{tokenizer_dir.name}"
    path.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    config = dict(SHAPES[shape], vocab_size=vocab)
    config.pop("bos_token_id", None)
    config.pop("eos_token_id", None)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def serve_flags(ns: argparse.Namespace) -> list[str]:
    flags = ["--device", ns.device, "--served-model-name", "bench"]
    if ns.model:
        flags += ["--model", ns.model]
    if ns.shape:
        flags += ["--load-format", "dummy"]
    for name in ("dtype", "max_model_len", "num_kv_blocks", "gpu_memory_utilization",
                 "max_num_seqs"):
        value = getattr(ns, name)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags + list(ns.serve_arg)


async def bench_policy(policy: str, convs: list[dict[str, Any]], ns: argparse.Namespace
                       ) -> dict[str, Any]:
    n = ns.data_parallel_size
    ports = [free_port() for _ in range(1 + 2 * n)]
    config = FleetConfig(
        size=n, replica_argv=serve_flags(ns), device=ns.device, policy=policy,
        router_port=ports[0], worker_ports=ports[1:1 + n], ws_ports=ports[1 + n:],
        replicas_per_gpu=ns.replicas_per_gpu,
        gpu_memory_utilization=ns.gpu_memory_utilization or 0.9,
        health_check_interval_s=5, log_level="WARNING")
    fleet = Fleet(config)
    await fleet.start()
    try:
        before = await prefix_counters(config.worker_urls)
        record = await run_workload(config.router_url, convs, ns)
        await asyncio.sleep(0.5)  # the replicas' last stats snapshot
        after = await prefix_counters(config.worker_urls)
    finally:
        await fleet.stop(timeout=30)
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    per_replica = [round(a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    return {"bench": "multi-turn-chat", "policy": policy, "replicas": n,
            "device": ns.device, "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
            "prompt_tokens_looked_up_per_replica": per_replica, **record}


def table(records: list[dict[str, Any]]) -> str:
    rows = ["| policy | prefix hit rate | output tok/s | total tok/s | TTFT p50 | TTFT p99 | "
            "tokens looked up per replica |", "|---|---|---|---|---|---|---|"]
    for r in records:
        looked_up = r["prompt_tokens_looked_up_per_replica"]
        rows.append(f"| {r['policy']} | {r['prefix_hit_rate']:.1%} | {r['output_tok_per_s']} "
                    f"| {r['total_tok_per_s']} | {r['ttft_p50_s'] * 1000:.0f} ms | "
                    f"{r['ttft_p99_s'] * 1000:.0f} ms | {looked_up} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_serving.py multi-turn", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--shape", default=None,
                   help="instead of --model: a shape of bench_common (e.g. llama2-7b) with dummy "
                        "weights and the tokenizer of --tokenizer-dir (its vocabulary size)")
    p.add_argument("--tokenizer-dir", default=None,
                   help="with --shape: an HF directory whose tokenizer files are used")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--data-parallel-size", type=int, default=2)
    p.add_argument("--replicas-per-gpu", type=int, default=1)
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--num-conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-prompts", type=int, default=2,
                   help="distinct system prompts the conversations share")
    p.add_argument("--system-len", type=int, default=300, help="words per system prompt")
    p.add_argument("--user-len", type=int, default=24, help="words per user turn")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="turns in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more flag for every replica, repeatable")
    return p


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    if ns.shape:
        if not ns.tokenizer_dir:
            raise SystemExit("--shape needs --tokenizer-dir (chat turns are text)")
        ns.model = str(shape_with_tokenizer(ns.shape, Path(ns.tokenizer_dir)))
    convs = conversations(ns)
    records = []
    for policy in ns.policies.split(","):
        record = asyncio.run(bench_policy(policy, convs, ns))
        print(json.dumps(record), flush=True)
        records.append(record)
    if len({r["replies_digest"] for r in records}) > 1:
        print("note: replies differ between policies (greedy ties on different replicas)")
    print(table(records))


if __name__ == "__main__":
    main()
