"""`models.plan_cache`: tuned matmul choices kept on disk between starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.plan_cache import PlanCache, device_identity, plan_key, source_digest


def test_entries_round_trip_and_bad_ones_read_as_missing(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path / "plans")
    assert cache.load("k") is None
    cache.store("k", ["gemv n32 k128x4 at once w2 pairs", "dequantize + BLAS"], about="64x128")
    assert cache.load("k") == ["gemv n32 k128x4 at once w2 pairs", "dequantize + BLAS"]
    assert json.loads((tmp_path / "plans" / "k.json").read_text())["about"] == "64x128"
    (tmp_path / "plans" / "bad.json").write_text("{not json")
    (tmp_path / "plans" / "odd.json").write_text(json.dumps({"kinds": [1, 2]}))
    assert cache.load("bad") is None and cache.load("odd") is None
    assert not list((tmp_path / "plans").glob("*.tmp"))


def test_a_folder_that_cannot_be_written_costs_only_the_saving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:  # fmt: skip
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = PlanCache(blocker / "plans")  # a path below a file: mkdir fails
    cache.store("k", ["BLAS"])
    assert cache.load("k") is None
    assert "not saved" in caplog.text


def test_keys_follow_every_part() -> None:
    base = ["cuda", "H200", 4096, 4096, "int4"]
    assert plan_key(base) == plan_key(list(base))
    assert plan_key(base) != plan_key([*base[:-1], "int8"])
    assert len(plan_key(base)) == 32 and plan_key(base).isalnum()


def test_the_key_parts_name_the_device_and_the_kernel_sources() -> None:
    assert device_identity(torch.device("cpu")) == ["cpu", torch.__version__]
    digest = source_digest()
    assert len(digest) == 64 and digest == source_digest()


def test_cached_kinds_keep_their_names() -> None:
    """Entries name kinds by `describe()`, which holds their config's `str`: a start reads
    back only kinds whose names have not changed, so these must stay as they are."""
    from asyncengine_kernels.gemv import TiledGemvConfig, WholeRowGemvConfig
    from asyncengine_kernels.quant_linear import QuantAtOnceGemvConfig
    from models.matmul_plan import TritonGemv
    from models.quantization.fp8 import Fp8WholeRowGemv
    from models.quantization.kinds import QuantTritonGemv

    names = [
        TritonGemv(TiledGemvConfig(8, 512, 4, 4)).describe(),
        TritonGemv(WholeRowGemvConfig(2, 4, 3, programs_per_sm=4)).describe(),
        Fp8WholeRowGemv(WholeRowGemvConfig(2, 4, 3, programs_per_sm=8, pairs=True)).describe(),
        QuantTritonGemv(QuantAtOnceGemvConfig(32, 128, tiles=4, num_warps=2)).describe(),
    ]
    assert names == [
        "Triton GEMV tiled[8, 512, 4, 4]",
        "Triton GEMV whole_row[2, 4, 4, 3]",
        "fp8 Triton whole-row GEMV (W8A16) whole_row[2, 8, 4, 3] pairs",
        "quantized Triton GEMV gemv n32 k128x4 at once w2 pairs",
    ]
