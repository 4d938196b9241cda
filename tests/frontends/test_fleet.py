"""`serve --data-parallel-size N`: replicas of the tiny model behind the real vllm-router.

The worker routes answered through the router; a replica killed under load (non-streamed
requests all complete, streams on it end with an error, never silently; the router stops
sending it work; the supervisor restarts it and it rejoins); and every way the fleet cannot
start is one error line, a non-zero exit and no process left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontends import fleet as fleet_mod
from frontends.cli import build_parser, main
from frontends.fleet import Fleet, FleetConfig, FleetError, engine_argv, gpu_assignment

from .conftest import UNIT

pytestmark = pytest.mark.skipif(not fleet_mod.router_installed(),
                                reason="vllm-router is not installed (asyncengine[router])")

ROOT = Path(__file__).resolve().parents[2]
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
                "--num-kv-blocks", "160", "--enforce-eager"]
# The router's health checks every second, one failure marks a replica down, one success up.
FAST_ROUTER = ["--health-failure-threshold", "1", "--health-success-threshold", "1",
               "--health-check-timeout-secs", "1"]


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def command_ports() -> tuple[int, int]:
    """(router, WebSocket) ports for `serve --data-parallel-size 2` with the default replica
    ports: the router's port, the two right after it (the replicas' OpenAI APIs) and the
    two WebSocket ports, five consecutive ports all free now. Two unrelated free ports
    could leave a replica's port taken (by the WebSocket port itself, or by another
    process), which made a port test fail on the wrong replica."""
    for _ in range(100):
        base = free_ports(1)[0]
        if base + 5 > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + 5):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base, base + 3
    raise RuntimeError("no five consecutive free ports")


def fleet_config(model_dir: Path, *, policy: str = "round_robin", size: int = 2,
                 **changes: Any) -> FleetConfig:
    router, *ports = free_ports(1 + 2 * size)
    return FleetConfig(
        size=size, replica_argv=["--model", str(model_dir), *ENGINE_FLAGS,
                                 "--served-model-name", "tiny"],
        policy=policy, router_port=router, worker_ports=ports[:size], ws_ports=ports[size:],
        health_check_interval_s=1, router_args=list(FAST_ROUTER), startup_timeout_s=240,
        **changes)


@pytest.fixture
async def fleet(model_dir: Path, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = Fleet(fleet_config(model_dir, log_dir=tmp_path))
    await f.start()
    try:
        yield f
    finally:
        await f.stop(timeout=10)
    assert not any(r.running for r in f.replicas)


async def _metric(http: httpx2.AsyncClient, url: str, suffix: str) -> float:
    text = (await http.get(f"{url}/metrics")).text
    return sum(s.value for fam in text_string_to_metric_families(text)
               for s in fam.samples if s.name.endswith(suffix))


# ------------------------------------------------------------------ through the router
async def test_worker_routes_through_the_router(fleet: Fleet) -> None:
    url = fleet.config.router_url
    async with httpx2.AsyncClient(base_url=url, timeout=60 * UNIT) as http:
        assert (await http.get("/v1/models")).json()["data"][0]["id"] == "tiny"
        r = await http.post("/tokenize", json={"prompt": "hello there"})
        assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0
        tokens = r.json()["tokens"]
        r = await http.post("/detokenize", json={"tokens": tokens})
        assert r.status_code == 200 and "hello there" in r.json()["prompt"]
        body = {"model": "tiny", "prompt": "a prompt that leaves cached blocks behind " * 3,
                "max_tokens": 4, "temperature": 0}
        texts = set()
        for _ in range(2):  # round robin: one on each replica
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200
            texts.add(r.json()["choices"][0]["text"])
        assert len(texts) == 1  # the same weights and seed everywhere
        loads = (await http.get("/get_loads")).json()["workers"]
        assert sorted(w["worker"] for w in loads) == sorted(fleet.config.worker_urls)
        assert all(w["load"] == 0 for w in loads)
        # The router fans /flush_cache out; every replica dropped its cached blocks.
        assert (await http.post("/flush_cache")).status_code == 200
        for worker in fleet.config.worker_urls:
            assert (await http.get(f"{worker}/version")).status_code == 200
            stats = await http.post(f"{worker}/flush_cache")
            assert stats.json()["flushed_blocks"] == 0  # already flushed by the router
            assert await _metric(http, worker, "request_success_total") == 1


async def _stream(http: httpx2.AsyncClient, max_tokens: int, i: int) -> dict[str, Any]:
    """One streamed completion: how it ended (done, error event, or broken connection) and
    the tokens it got (from vLLM's per-chunk usage)."""
    body = {"model": "tiny", "prompt": f"stream number {i}", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    tokens, outcome = 0, "silent"
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"outcome": f"http {r.status_code}", "tokens": 0}
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    outcome = "done" if outcome == "silent" else outcome
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        outcome = "error event"
                    elif event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
    except httpx2.HTTPError as exc:
        outcome = f"broken: {type(exc).__name__}"
    return {"outcome": outcome, "tokens": tokens}


async def _worker_health(http: httpx2.AsyncClient, router: str) -> dict[str, bool]:
    workers = (await http.get(f"{router}/workers")).json()["workers"]
    return {w["url"]: w["is_healthy"] for w in workers}


async def test_a_replica_killed_under_load(fleet: Fleet) -> None:
    router = fleet.config.router_url
    victim = fleet.replicas[0]
    victim_url, survivor_url = fleet.config.worker_urls
    supervisor = asyncio.create_task(fleet.supervise())
    async with httpx2.AsyncClient(base_url=router, timeout=120 * UNIT) as http:

        async def one(i: int) -> int:
            r = await http.post("/v1/completions", json={
                "model": "tiny", "prompt": f"request {i}", "max_tokens": 8,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            return int(r.json()["usage"]["completion_tokens"])

        streams = [asyncio.create_task(_stream(http, 480, i)) for i in range(4)]
        plain = [asyncio.create_task(one(i)) for i in range(12)]
        # Kill the victim while it holds streams (round robin: two of the four) and whatever
        # plain requests are still on it: the 8-token ones can end between two polls of a
        # loaded machine, the 480-token streams cannot.
        async with asyncio.timeout(60 * UNIT):
            while (await http.get(f"{victim_url}/get_load")).json()["load"] < 2:
                await asyncio.sleep(0.01)
        victim.kill()
        plain += [asyncio.create_task(one(i)) for i in range(12, 24)]
        assert await asyncio.gather(*plain) == [8] * 24  # every one completed

        ended = await asyncio.gather(*streams)
        outcomes = [e["outcome"] for e in ended]
        assert "silent" not in outcomes, ended  # nothing ends without [DONE] or an error
        assert all(e["tokens"] == 480 for e in ended if e["outcome"] == "done"), ended
        broken = [o for o in outcomes if o != "done"]
        assert broken and all(o.startswith(("broken", "error event")) for o in broken), ended

        # The router marks it down; the supervisor restarts it; it rejoins and gets work.
        async with asyncio.timeout(30 * UNIT):
            while (await _worker_health(http, router)).get(victim_url, True):
                await asyncio.sleep(0.1)
        async with asyncio.timeout(240 * UNIT):
            while victim.restarts == 0 or not (await _worker_health(http, router))[victim_url]:
                await asyncio.sleep(0.2)
        assert (await _worker_health(http, router))[survivor_url]
        # Healthy again, it gets work once the router's circuit breaker for it closes too.
        async with asyncio.timeout(120 * UNIT):
            i = 0
            while await _metric(http, victim_url, "request_success_total") < 1:
                assert await asyncio.gather(one(i), one(i + 1)) == [8, 8]
                i += 2
                await asyncio.sleep(0.5)
    supervisor.cancel()
    await asyncio.gather(supervisor, return_exceptions=True)


# ------------------------------------------------------------------ refusals
def _children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True) if c.is_running()
            and c.status() != psutil.STATUS_ZOMBIE}


def _no_children_left(before: set[int]) -> None:
    assert _children() <= before


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "asyncengine: error:" in line]
    assert len(lines) == 1, err
    return lines[0]


def test_flags() -> None:
    ns = build_parser().parse_args(["serve"])
    assert ns.data_parallel_size == 1 and ns.router_policy == "cache_aware"
    ns = build_parser().parse_args(["serve", "--data-parallel-size", "2", "--router-policy",
                                    "power_of_two", "--max-num-seqs", "8",
                                    "--no-enable-prefix-caching", "--device", "cpu"])
    assert ns.data_parallel_size == 2 and ns.router_policy == "power_of_two"
    assert engine_argv(ns) == ["--device", "cpu", "--no-enable-prefix-caching",
                               "--max-num-seqs", "8"]


def test_gpu_assignment() -> None:
    cfg = FleetConfig(size=2, replica_argv=[], device="cuda", worker_ports=[1, 2],
                      ws_ports=[3, 4])
    assert gpu_assignment(cfg, ["3", "5"]) == ["3", "5"]
    with pytest.raises(FleetError, match=r"needs 2 GPU.*1 GPU visible"):
        gpu_assignment(cfg, ["0"])
    shared = FleetConfig(size=2, replica_argv=[], device="cuda", replicas_per_gpu=2,
                         gpu_memory_utilization=0.45, worker_ports=[1, 2], ws_ports=[3, 4])
    assert gpu_assignment(shared, ["0"]) == ["0", "0"]
    with pytest.raises(FleetError, match="more than the whole GPU"):
        gpu_assignment(FleetConfig(size=2, replica_argv=[], device="cuda",
                                   replicas_per_gpu=2, worker_ports=[1, 2], ws_ports=[3, 4]),
                       ["0"])


def test_free_port_skips_ports_the_fleet_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """The OS hands out a port again once its probing socket closes, so the router's metrics
    port once landed on a replica's chosen (not yet bound) WebSocket port."""
    offered = iter([5001, 5002, 5003])

    class Probe:
        def __enter__(self) -> Probe:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            self.port = next(offered)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(fleet_mod.socket, "socket", Probe)
    assert fleet_mod.free_port(avoid={5001, 5002}) == 5003


def test_more_replicas_than_gpus_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["serve", "--data-parallel-size", "3", "--device", "cuda"])
    assert status != 0
    assert "needs 3 GPU(s)" in _one_error_line(capsys)


def test_without_the_router_installed(monkeypatch: pytest.MonkeyPatch, model_dir: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(fleet_mod, "router_installed", lambda: False)
    before = _children()
    status = main(["serve", "--model", str(model_dir), *ENGINE_FLAGS,
                   "--data-parallel-size", "2", "--openai-port", str(free_ports(1)[0])])
    assert status != 0
    assert "pip install 'asyncengine[router]'" in _one_error_line(capsys)
    _no_children_left(before)


def test_a_port_in_use_is_one_line(model_dir: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    router, ws = command_ports()
    before = _children()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", router + 2))  # replica 1's OpenAI port
        taken.listen()
        status = main(["serve", "--model", str(model_dir), *ENGINE_FLAGS,
                       "--data-parallel-size", "2", "--openai-port", str(router),
                       "--port", str(ws)])
    assert status != 0
    line = _one_error_line(capsys)
    assert f"cannot listen on 127.0.0.1:{router + 2} for replica 1's OpenAI API" in line
    _no_children_left(before)


async def test_a_refused_fleet_leaves_no_log_folder(model_dir: Path) -> None:
    cfg = fleet_config(model_dir)
    fleet = Fleet(cfg)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", cfg.worker_ports[0]))
        taken.listen()
        with pytest.raises(FleetError, match="cannot listen"):
            await fleet.start()
    assert not fleet.log_dir.exists()


async def test_a_router_that_fails_to_start(model_dir: Path, tmp_path: Path) -> None:
    cfg = fleet_config(model_dir, log_dir=tmp_path)
    cfg.router_args.append("--no-such-router-flag")
    fleet = Fleet(cfg)
    refused = r"vllm-router exited with status \S+ while starting"
    with pytest.raises(FleetError, match=refused) as info:
        await fleet.start()
    assert "\n" not in str(info.value)
    assert all(r.proc is not None and not r.running for r in fleet.replicas)
    assert fleet.router is not None and not fleet.router.running


def test_the_command_stops_every_process_on_sigterm(model_dir: Path, tmp_path: Path) -> None:
    router, ws = command_ports()
    proc = subprocess.Popen(
        [sys.executable, "-m", "frontends.cli", "serve", "--model", str(model_dir),
         *ENGINE_FLAGS, "--data-parallel-size", "2", "--openai-port", str(router),
         "--port", str(ws), "--router-health-check-interval", "1",
         "--served-model-name", "tiny"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx2.get(f"http://127.0.0.1:{router}/readiness", timeout=5).status_code \
                        == 200:
                    break
            except httpx2.TransportError:
                pass
            assert time.monotonic() < deadline, "the fleet did not come up"
            time.sleep(0.5)
        r = httpx2.post(f"http://127.0.0.1:{router}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 3  # two replicas and the router
        proc.terminate()
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert "fleet stopped" in out and "Traceback" not in out
        _gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, alive
        for port in (router, router + 1, router + 2):
            with socket.socket() as s:  # nobody listens there any more
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
                s.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
