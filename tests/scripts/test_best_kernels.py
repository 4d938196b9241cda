"""`scripts/best_kernels.py`: the fastest row per shape and implementation family."""

from __future__ import annotations

import io
import json
import sys

import pytest

from scripts import best_kernels


def test_family_drops_tile_sizes_but_keeps_the_form() -> None:
    assert best_kernels.family("gemv n128 k128 split4 w4 s3 pairs") == "gemv pairs"
    assert best_kernels.family("gemv n64 k128x4 at once w4 pairs") == "gemv at once pairs"
    assert best_kernels.family("bf16 cublas") == "bf16 cublas"


def test_keeps_the_fastest_of_each_family(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    shape = {"kernel": "quant", "n": 4096, "k": 4096, "bits": 4, "rows": 1}
    rows = [
        {**shape, "impl": "gemv n128 k128 split4 w4 s3 pairs", "ms": 0.012},
        {**shape, "impl": "gemv n64 k128 split8 w4 s3 pairs", "ms": 0.010},
        {**shape, "impl": "bf16 cublas", "ms": 0.011},
        {**shape, "error": "boom"},
    ]
    text = "\n".join(json.dumps(r) for r in rows) + "\nnot json\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    best_kernels.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("error:")
    assert "split8" in out[1] and "0.0100" in out[1]
    assert "cublas" in out[2]
    assert len(out) == 3
