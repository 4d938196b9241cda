"""Soak test: minutes of steady mixed load against an in-process server, watching for drift.

Workers keep a mix going over real sockets: greedy and sampled completions, chat, bursts of
concurrent requests on one connection, cancels mid-stream, clients that vanish mid-stream
(clean close, reset, abort), clients that stop reading, and malformed messages. A monitor
samples the process RSS, the KV pool and the queues. At the end the engine must be idle with
every KV block free, no worker may have seen an unexpected error, and every greedy output
must agree with every other greedy output of the same prompt (each is a prefix of the
longest one seen).

    .venv/bin/python scripts/soak.py --duration 240             # tiny random model
    .venv/bin/python scripts/soak.py --model default --duration 600
    .venv/bin/python scripts/soak.py --report soak.json

Exit status 0 when the run is clean, 1 otherwise. RSS growth is reported from the end of the
warm-up (the first `--warmup` seconds: allocator pools and caches fill) to the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import platform
import random
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_WORDS = ["river", "stone", "cloud", "paper", "light", "music", "garden", "engine", "window",
          "forest", "silver", "orange", "planet", "signal", "harbor", "winter"]
_ACTIONS = {  # name: weight
    "complete": 30, "sampled": 10, "chat": 8, "burst": 8, "cancel": 14, "vanish": 14,
    "stall": 4, "bad": 12,
}


class Tally:
    """Counters and the greedy consistency oracle shared by the workers."""

    def __init__(self) -> None:
        self.actions: collections.Counter[str] = collections.Counter()
        self.unexpected: list[str] = []
        self.greedy: dict[str, list[int]] = {}  # prompt -> the longest greedy output seen
        self.mismatches = 0
        self.greedy_checks = 0
        self.tokens_received = 0

    def check_greedy(self, prompt: str, ids: list[int]) -> None:
        """Greedy outputs of one prompt must all be prefixes of the longest one."""
        best = self.greedy.get(prompt)
        self.greedy_checks += best is not None
        if best is None or len(ids) > len(best):
            if best is not None and ids[: len(best)] != best:
                self.mismatches += 1
            self.greedy[prompt] = list(ids)
        elif best[: len(ids)] != ids:
            self.mismatches += 1


def _make_prompts(n: int) -> list[str]:
    rng = random.Random(1234)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 12))) for _ in range(n)]


# A fixed pool, so that greedy outputs of one prompt recur and can be compared.
_PROMPTS = _make_prompts(48)


def _prompt(rng: random.Random) -> str:
    return rng.choice(_PROMPTS)


async def _complete(client: Any, tally: Tally, rng: random.Random, **params: Any) -> None:
    prompt = _prompt(rng)
    max_tokens = rng.randint(4, 64)
    out = await client.complete(prompt, max_tokens=max_tokens, ignore_eos=True, **params)
    assert out.finish_reason == "length", out.finish_reason
    assert len(out.token_ids) == out.usage.completion_tokens == max_tokens
    tally.tokens_received += len(out.token_ids)
    if params.get("temperature") == 0.0:
        tally.check_greedy(prompt, out.token_ids)


async def _raw_connect(url: str, stalled: bool = False) -> Any:
    from websockets.asyncio.client import connect

    if not stalled:
        return await connect(url, compression=None)
    host, port = url.split("//")[1].split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect((host, int(port.rstrip("/"))))
    sock.setblocking(False)
    return await connect(url, sock=sock, max_queue=1, compression=None)


def _generate(rid: str, prompt: str, max_tokens: int) -> str:
    return json.dumps({"type": "generate", "request_id": rid, "prompt": prompt,
                       "params": {"max_tokens": max_tokens, "temperature": 0.0,
                                  "ignore_eos": True}})


async def run_action(action: str, client: Any, url: str, tally: Tally,
                     rng: random.Random) -> None:
    if action == "complete":
        await _complete(client, tally, rng, temperature=0.0)
    elif action == "sampled":
        await _complete(client, tally, rng, temperature=0.8, top_p=0.9,
                        seed=rng.randrange(1 << 30))
    elif action == "chat":
        out = await client.complete(messages=[{"role": "user", "content": _prompt(rng)}],
                                    max_tokens=rng.randint(4, 32), temperature=0.0)
        assert out.finish_reason in ("length", "stop")
    elif action == "burst":
        await asyncio.gather(*(_complete(client, tally, rng, temperature=0.0)
                               for _ in range(rng.randint(2, 6))))
    elif action == "cancel":  # leave the stream early: the client library sends `cancel`
        stop_after = rng.randint(1, 8)
        gen = client.generate(_prompt(rng), max_tokens=128, ignore_eos=True)
        seen = 0
        async for chunk in gen:
            assert not chunk.finished, "finished before the cancel"
            seen += 1
            if seen >= stop_after:
                break
        await gen.aclose()
    elif action in ("vanish", "stall"):
        ws = await _raw_connect(url, stalled=action == "stall")
        await ws.send(_generate("v", _prompt(rng), 200 if action == "stall" else 96))
        if action == "stall":  # reads nothing for a while, then disappears
            await asyncio.sleep(rng.uniform(0.5, 2.0))
        else:
            for _ in range(rng.randint(1, 4)):
                await ws.recv()
        how = "reset" if action == "stall" else rng.choice(["close", "reset", "abort"])
        if how == "close":
            await ws.close()
        else:
            if how == "reset":
                sock = ws.transport.get_extra_info("socket")
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            ws.transport.abort()
    elif action == "bad":
        ws = await _raw_connect(url)
        frame = rng.choice([
            "{not json", '{"type": "teleport"}', '{"type": "generate", "request_id": "x"}',
            '{"type": "cancel", "request_id": "nobody"}', "[" * 5000 + "]" * 5000,
            '{"type": "generate", "request_id": "y", "prompt": "x", "params": {"top_p": 9}}',
        ])
        await ws.send(frame)
        event = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert event["type"] == "error", event
        await ws.close()
    else:
        raise ValueError(action)


async def worker(i: int, url: str, deadline: float, tally: Tally, seed: int) -> None:
    from frontends.client import AsyncClient, ConnectionLostError

    rng = random.Random(seed + i)
    names, weights = zip(*_ACTIONS.items(), strict=True)
    client = AsyncClient(url)
    await client.connect()
    try:
        while time.monotonic() < deadline:
            action = rng.choices(names, weights)[0]
            try:
                await asyncio.wait_for(run_action(action, client, url, tally, rng), 120)
                tally.actions[action] += 1
            except (Exception, TimeoutError) as exc:
                tally.unexpected.append(f"{action}: {exc!r}"[:300])
                if isinstance(exc, ConnectionLostError):
                    client = AsyncClient(url)
                    await client.connect()
    finally:
        await client.close()


def rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


async def monitor(engine: Any, server: Any, interval: float, samples: list[dict[str, Any]],
                  t0: float, warmup: float, heap: dict[str, Any]) -> None:
    import tracemalloc

    while True:
        await asyncio.sleep(interval)
        if tracemalloc.is_tracing() and "base" not in heap and time.monotonic() - t0 >= warmup:
            heap["base"] = tracemalloc.take_snapshot()
        s = engine.stats()
        samples.append({
            "t": round(time.monotonic() - t0, 1), "rss_mb": round(rss_bytes() / 2**20, 1),
            "kv_used": s.kv_blocks_used, "kv_total": s.kv_blocks_total,
            "running": s.num_running, "waiting": s.num_waiting,
            "in_flight": engine.num_in_flight, "connections": len(server._connections),
            "generated": s.generation_tokens_total,
        })
        last = samples[-1]
        print(f"[{last['t']:7.1f}s] rss {last['rss_mb']:7.1f} MB  kv {last['kv_used']:4d}/"
              f"{last['kv_total']}  run {last['running']:3d}  wait {last['waiting']:3d}  "
              f"streams {last['in_flight']:3d}  conns {last['connections']:3d}  "
              f"tokens {last['generated']}", flush=True)


def _heap_growth(base: Any, top: int = 12) -> list[str]:
    """Where Python allocations grew since `base` (a tracemalloc snapshot), largest first."""
    import tracemalloc

    if base is None or not tracemalloc.is_tracing():
        return []
    stats = tracemalloc.take_snapshot().compare_to(base, "lineno")
    return [str(s) for s in stats[:top]]


def _slope_mb_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) points, in MB per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(m for _, m in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    cov = sum((t - mx) * (m - my) for t, m in points)
    return 60.0 * cov / var if var else 0.0


async def soak(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    import torch

    from asyncengine.async_engine import AsyncLLMEngine
    from asyncengine.config import EngineArgs
    from frontends.server import ServerConfig, serve_engine

    torch.set_num_threads(args.torch_threads)
    engine_args = EngineArgs(model=model_dir, device="cpu", dtype="float32",
                             max_model_len=512, num_kv_blocks=args.num_kv_blocks,
                             max_num_seqs=args.max_num_seqs, enforce_eager=True, seed=0)
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    tally = Tally()
    samples: list[dict[str, Any]] = []
    config = ServerConfig(port=0, max_queued_requests=4 * args.max_num_seqs,
                          max_pending_frames=16)
    async with serve_engine(engine, config) as server:
        t0 = time.monotonic()
        rss_start = rss_bytes()
        heap: dict[str, Any] = {}
        mon = asyncio.create_task(monitor(engine, server, args.sample, samples, t0,
                                          args.warmup, heap))
        deadline = t0 + args.duration
        await asyncio.gather(*(worker(i, server.url, deadline, tally, args.seed)
                               for i in range(args.clients)))
        elapsed = time.monotonic() - t0
        mon.cancel()
        heap_growth = _heap_growth(heap.get("base"))
        # Drain: every stream ends and every dead connection goes.
        for _ in range(600):
            if engine.num_in_flight == 0 and not server._connections:
                break
            await asyncio.sleep(0.05)

        def audit(e: Any) -> dict[str, int]:
            e.check_integrity()
            return {"blocks_leaked": e.pool.num_blocks - e.pool.num_free_blocks,
                    "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                    "swapped": len(e.scheduler.swapped)}

        for _ in range(600):
            if not await engine.run_in_engine_thread(lambda e: e.has_unfinished_requests()):
                break
            await asyncio.sleep(0.05)
        counts = await engine.run_in_engine_thread(audit)
        final_stats = engine.stats()
        streams_left = engine.num_in_flight
        connections_left = len(server._connections)
    await engine.shutdown()

    after_warmup = [s for s in samples if s["t"] >= args.warmup]
    base = after_warmup[0] if after_warmup else (samples[0] if samples else None)
    rss_end = rss_bytes()
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} "
                   f"{platform.release()}, Python {platform.python_version()}, "
                   f"torch {torch.__version__} ({args.torch_threads} intra-op thread)",
        "model": args.model,
        "duration_s": round(elapsed, 1),
        "clients": args.clients,
        "actions": dict(tally.actions),
        "requests": sum(tally.actions.values()),
        "generated_tokens": final_stats.generation_tokens_total,
        "generation_tokens_per_s": round(final_stats.generation_tokens_total / elapsed, 1),
        "preemptions": final_stats.num_preemptions,
        "unexpected_errors": len(tally.unexpected),
        "unexpected_error_samples": tally.unexpected[:10],
        "greedy_checks": tally.greedy_checks,
        "greedy_mismatches": tally.mismatches,
        **counts,
        "streams_left": streams_left,
        "connections_left": connections_left,
        "kv_blocks_total": final_stats.kv_blocks_total,
        "kv_used_max": max((s["kv_used"] for s in samples), default=0),
        "rss_start_mb": round(rss_start / 2**20, 1),
        "rss_after_warmup_mb": base["rss_mb"] if base else None,
        "rss_end_mb": round(rss_end / 2**20, 1),
        "rss_max_mb": max((s["rss_mb"] for s in samples), default=None),
        "rss_growth_after_warmup_mb": round(rss_end / 2**20 - base["rss_mb"], 1) if base
        else None,
        "rss_slope_after_warmup_mb_per_min": round(_slope_mb_per_min(
            [(s["t"], s["rss_mb"]) for s in after_warmup]), 2),
        "warmup_s": args.warmup,
        "requests_finished": final_stats.num_requests_finished,
        "requests_aborted": final_stats.num_requests_aborted,
        "heap_growth_top": heap_growth,
        "samples": samples,
    }
    report["clean"] = (report["unexpected_errors"] == 0 and report["greedy_mismatches"] == 0
                       and counts == dict.fromkeys(counts, 0) and streams_left == 0
                       and connections_left == 0)
    return report


def resolve_model(name: str, workdir: Path) -> str:
    if name == "tiny":
        from tests.tiny_models import build_tiny_model_dir

        return str(build_tiny_model_dir(workdir / "tiny-llama", "llama3"))
    if name == "default":
        from models.default_model import default_model_dir

        return str(default_model_dir())
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=240.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=30.0,
                        help="seconds excluded from the RSS growth figure")
    parser.add_argument("--model", default="tiny",
                        help='"tiny" (a random 2-layer Llama built here), "default" (the '
                             "embedded SmolLM2-135M) or a model directory")
    parser.add_argument("--clients", type=int, default=12, help="concurrent workers")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, default=256)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--sample", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="trace Python allocations and report where they grew after the "
                             "warm-up (slows the run down)")
    args = parser.parse_args(argv)
    if args.tracemalloc:
        import tracemalloc

        tracemalloc.start(8)

    import logging

    import uvloop

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = resolve_model(args.model, Path(tmp))
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            report = runner.run(soak(args, model_dir))
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["clean"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
