"""`asyncengine serve` with the OpenAI-compatible API: the flags, one process serving both
protocols until SIGTERM drains it, and a port already taken reported in one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest

from frontends.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "128",
                "--num-kv-blocks", "32", "--enforce-eager"]


def test_openai_flags() -> None:
    ns = build_parser().parse_args(["serve"])
    assert ns.openai_port == 8000 and ns.served_model_name is None
    ns = build_parser().parse_args(["serve", "--openai-port", "0", "--served-model-name", "m"])
    assert ns.openai_port == 0 and ns.served_model_name == "m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_taken_port_is_one_error_line(model_dir: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status = main(["serve", "--model", str(model_dir), *ENGINE_FLAGS, "--port", "0",
                       "--openai-port", str(port)])
    assert status == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "asyncengine: error:" in line]
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], err


def test_serve_answers_openai_clients_and_drains_on_sigterm(model_dir: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "frontends.cli", "serve", "--model", str(model_dir),
         *ENGINE_FLAGS, "--port", "0", "--openai-port", str(port),
         "--served-model-name", "tiny"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx2.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        assert httpx2.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
        r = httpx2.post(f"{url}/v1/completions", timeout=60,
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 3,
                              "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert "OpenAI-compatible API for" in out and "Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
