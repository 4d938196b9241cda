"""Long disconnect storm: the CI storm round (tests/reliability/test_disconnect_storm.py),
repeated for minutes against one in-process server and engine.

Each round opens 64 connections of 4 streamed requests; a random half of the clients vanish
mid-stream (clean close, reset, abort, reset before the first token, or stop reading). After
every round the engine must be idle with every KV block free, and every surviving request
must equal offline greedy decoding. Prints the running totals; exits 1 on the first failure.

    .venv/bin/python scripts/storm.py --duration 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


async def storm(duration: float, model_dir: Path, seed: int) -> dict[str, Any]:
    from asyncengine.async_engine import AsyncLLMEngine
    from asyncengine.config import EngineArgs
    from tests.reliability.conftest import ENGINE_ARGS, kv_audit, serving
    from tests.reliability.test_disconnect_storm import storm_round

    args = EngineArgs(model=str(model_dir), **{**ENGINE_ARGS, "num_kv_blocks": 48})
    engine = AsyncLLMEngine.from_engine_args(args)
    totals: dict[str, int] = {"rounds": 0}
    t0 = time.monotonic()
    try:
        async with serving(engine) as server:
            while time.monotonic() - t0 < duration:
                counts = await storm_round(engine, model_dir, server, seed + totals["rounds"])
                totals["rounds"] += 1
                for key, value in counts.items():
                    totals[key] = totals.get(key, 0) + value
                print(f"[{time.monotonic() - t0:7.1f}s] {json.dumps(totals)}", flush=True)
        totals.update(await kv_audit(engine))
    finally:
        await engine.shutdown()
    totals["duration_s"] = round(time.monotonic() - t0, 1)
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of storms")
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)

    import torch
    import uvloop

    from tests.tiny_models import build_tiny_model_dir

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model_dir(Path(tmp) / "tiny-llama", "llama3")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            try:
                totals = runner.run(storm(ns.duration, model_dir, ns.seed))
            except AssertionError as exc:
                print(f"FAILED: {exc}", file=sys.stderr)
                return 1
    print(json.dumps(totals, indent=2))
    return 0 if totals.get("blocks_leaked") == 0 and totals.get("requests_lost") == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
