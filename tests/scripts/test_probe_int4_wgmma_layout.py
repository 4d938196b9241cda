"""The int4 packing lands in wgmma's register operand with no data movement: the probe
compiles for sm_90 (its `assert_trivial` conversion would fail otherwise), its machine code
multiplies from registers without `ldmatrix`, shuffles or a spill, and the bit-trick
conversion keeps the instructions a weight value costs below the CUDA-core GEMV's 3.7."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _has_gluon_hopper() -> bool:
    try:
        hopper = "triton.experimental.gluon.language.nvidia.hopper"
        return importlib.util.find_spec(hopper) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or importlib.util.find_spec("triton.backends.nvidia") is None
    or not _has_gluon_hopper(),
    reason="needs Triton with its CUDA backend (it bundles ptxas) and Gluon's Hopper module",
)
@pytest.mark.parametrize("rows", [8, 64])
def test_int4_codes_reach_the_register_operand_untouched(tmp_path: Path, rows: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "probe_int4_wgmma_layout.py"),
         "--rows", str(rows)],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    stats = json.loads(lines[-1])
    assert stats["trivial_conversion"] and stats["HGMMA"] == 4
    assert stats["ptx"]["ldmatrix"] == 0 and stats["ptx"]["shfl"] == 0
    assert stats["local_bytes"] == 0 and stats["LDL"] == 0 and stats["STL"] == 0
    if rows == 8:  # a decode step's width, where the one-row GEMV's 3.7 is the comparison
        assert 0 < stats["instructions_per_value"] < 3.7
