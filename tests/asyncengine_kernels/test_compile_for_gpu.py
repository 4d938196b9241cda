"""The decode and prefill kernels compile for an H200 (sm_90) on this CPU-only machine.

The interpreter runs what the kernels compute; this runs Triton's real compiler down to a
cubin (`scripts/compile_kernels.py`), so a change that would not build on the GPU fails in CI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="needs Triton with its CUDA backend (it bundles ptxas)",
)
def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier run's cache
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_kernels.py"), "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    errors = [r for r in rows if "error" in r]
    assert proc.returncode == 0 and not errors, errors or proc.stderr[-2000:]
    summary = rows[-1]
    assert summary["failed"] == 0 and summary["compiled"] >= 11
    assert all(r["cubin_bytes"] > 0 for r in rows[:-1])
