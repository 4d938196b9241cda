"""The quantized plan kinds against their reference, and the agreement check the start-up
tuner runs before timing a kind: a kind giving NaN or wrong values is never planned."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from asyncengine_kernels.quant_linear import QuantAtOnceGemvConfig, QuantGemmConfig
from models.config import ModelConfig
from models.loader import load_model
from models.matmul_plan import MatmulKind, MatmulPlan, PlanEntry
from models.quantization.config import IntQuantConfig
from models.quantization.kinds import (
    DequantMatmul,
    QuantTritonGemm,
    QuantTritonGemv,
    QuantWgmma,
    agrees_with_reference,
    all_int_kinds,
    fallback_kinds,
    pack_wgmma_copy,
    release_unplanned_copies,
    tuning_kinds,
    wgmma_serves,
)
from tests.quant_writers import Scheme

Make = Callable[[Scheme], tuple[Path, Path]]


@dataclass(frozen=True)
class _Corrupted(MatmulKind):
    """The reference with one output value replaced (NaN, or off by a large amount)."""

    value: float
    name: ClassVar[str] = "corrupted"

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
              gated: bool = False, glu: bool = False) -> torch.Tensor:  # fmt: skip
        y = DequantMatmul().apply(layer, x, bias).clone()
        y[-1, 0] = self.value if self.value != self.value else y[-1, 0] + self.value
        return y


def _down_proj(quantized: Make, scheme: Scheme) -> torch.nn.Module:
    qdir, _ = quantized(scheme)
    cfg = ModelConfig.from_dir(qdir)
    model = load_model(qdir, cfg, dtype=torch.float32, device=torch.device("cpu"))
    return model.model.layers[0].mlp.down_proj


def test_the_triton_kinds_agree_and_a_corrupted_one_does_not(quantized: Make) -> None:
    """The GEMM on float32; the GEMV, whose products are in half-precision pairs, on bf16."""
    layer = _down_proj(quantized, Scheme("gptq", 8, 32, sym=True))
    x = torch.randn(7, layer.in_features, generator=torch.Generator().manual_seed(0))
    assert agrees_with_reference(QuantTritonGemm(QuantGemmConfig(16, 32, 32, 4, 1)), layer,
                                 x, None)  # fmt: skip
    scale = float(DequantMatmul().apply(layer, x, None).abs().max())
    assert agrees_with_reference(_Corrupted(0.001 * scale), layer, x, None)
    assert not agrees_with_reference(_Corrupted(0.5 * scale), layer, x, None)
    assert not agrees_with_reference(_Corrupted(float("nan")), layer, x, None)
    layer.scales.data = layer.scales.data.to(torch.bfloat16)
    layer.zeros.data = layer.zeros.data.to(torch.bfloat16)
    gemv = QuantTritonGemv(QuantAtOnceGemvConfig(32, 32, tiles=2))
    assert agrees_with_reference(gemv, layer, x[:2].to(torch.bfloat16), None)


def test_the_at_once_gemv_applies_silu_and_mul_itself(quantized: Make) -> None:
    """The down projection's [gate, up] input: the at-once GEMV fused, as the reference
    takes the activated input; the tuner offers it with the fusion declared."""
    from asyncengine_kernels.activation import silu_and_mul
    from models.matmul_plan import InputTransform

    layer = _down_proj(quantized, Scheme("gptq", 4, 32, sym=True))
    pair = torch.randn(1, 2 * layer.in_features, generator=torch.Generator().manual_seed(1))
    pair = pair.to(torch.bfloat16)
    layer.scales.data = layer.scales.data.to(torch.bfloat16)
    layer.zeros.data = layer.zeros.data.to(torch.bfloat16)
    kind = QuantTritonGemv(QuantAtOnceGemvConfig(32, 32, tiles=2))
    assert InputTransform.SILU_AND_MUL in kind.fusable_inputs
    want = DequantMatmul().apply(layer, silu_and_mul(pair).float(), None)
    got = kind.apply(layer, pair, None, gated=True).float()
    assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max())
    # The tuner times the GEMV at one row, as the kind that can fuse.
    gemvs = [k for k in tuning_kinds(layer, 1) if isinstance(k, QuantTritonGemv)]
    assert gemvs and all(InputTransform.SILU_AND_MUL in k.fusable_inputs for k in gemvs)


def _shape(group: int, k: int, bits: int = 4, cuda: bool = False) -> SimpleNamespace:
    """What `tuning_kinds` reads of an integer layer: its format, group, K and device (a
    stand-in for a GPU tensor where `cuda`)."""
    qweight = SimpleNamespace(is_cuda=True) if cuda else torch.empty(0, dtype=torch.int32)
    return SimpleNamespace(quant_config=IntQuantConfig("gptq", bits, group), group_size=group,
                           in_features=k, qweight=qweight)  # fmt: skip


def _names(kinds: list[MatmulKind]) -> list[str]:
    return [k.describe().removeprefix("quantized Triton ") for k in kinds]


def test_the_rule_table_names_a_few_kinds_per_row_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Llama-2-7B shape in int4 g128: the at-once GEMVs that won at 1-2 rows, two of them
    and the small GEMM tile split 4 at 4, that tile against dequantize + BLAS at 8-16, two
    64-row tiles against it at 64, and from 65 rows dequantize + BLAS alone (the Triton
    pass on a GPU; the GEMM tiles lost every layer at 256 rows, the step's timed size) where
    the layer has no copy of the codes for the wgmma matmul."""
    monkeypatch.delenv("ASYNCENGINE_TUNE_ALL_KINDS", raising=False)
    layer = _shape(128, 4096)
    one, two = ["GEMV gemv n32 k128x2 at once w1 pairs", "GEMV gemv n32 k128x4 at once w1 pairs"]
    small = "GEMM gemm 16x64x128 w4 s4 split4"
    got = {rows: _names(tuning_kinds(layer, rows)) for rows in (1, 2, 4, 8, 16, 64, 256, 1024)}
    assert got == {
        1: [one, two, "GEMV gemv n32 k128x8 at once w4 pairs"],
        2: [one, two, "GEMV gemv n32 k128x8 at once w4 pairs"],
        4: [one, two, small],
        8: [small, "dequantize + BLAS"],
        16: [small, "dequantize + BLAS"],
        64: ["GEMM gemm 64x64x128 w4 s3", "GEMM gemm 64x64x128 w4 s3 split2", "dequantize + BLAS"],
        256: ["dequantize + BLAS"],
        1024: ["dequantize + BLAS"],
    }
    assert all(isinstance(k, QuantTritonGemv) for k in tuning_kinds(layer, 1))
    gpu = _shape(128, 4096, cuda=True)
    assert _names(tuning_kinds(gpu, 64))[:2] == got[64][:2]
    assert _names(tuning_kinds(gpu, 256)) == ["Triton dequantize + BLAS"]
    assert _names(tuning_kinds(gpu, 1024)) == ["Triton dequantize + BLAS"]


def test_int8_rules_keep_the_at_once_gemvs_of_one_and_two_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """int8 g128 (without the wgmma matmul's copy of the codes): the at-once GEMVs of its
    one-row plans, the 2-row one up to 4 rows (beside the small GEMM tile at 3-4), and from
    5 rows the rules of int4."""
    monkeypatch.delenv("ASYNCENGINE_TUNE_ALL_KINDS", raising=False)
    layer = _shape(128, 4096, bits=8)
    assert _names(tuning_kinds(layer, 1)) == [
        "GEMV gemv n32 k128x2 at once w2 pairs", "GEMV gemv n32 k128x4 at once w1 pairs"
    ]  # fmt: skip
    assert _names(tuning_kinds(layer, 2)) == ["GEMV gemv n32 k128x2 at once w2 pairs"]
    assert _names(tuning_kinds(layer, 4)) == [
        "GEMV gemv n32 k128x2 at once w2 pairs", "GEMM gemm 16x64x128 w4 s4 split4"
    ]  # fmt: skip
    for rows in (8, 16, 64, 256, 1024):
        assert tuning_kinds(layer, rows) == tuning_kinds(_shape(128, 4096), rows)


def test_rule_kinds_are_among_every_config_the_flag_restores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """For the shapes and groups of real checkpoints, the rules only narrow the full sweep;
    `ASYNCENGINE_TUNE_ALL_KINDS=1` gives the full sweep back (12 kinds at 1-16 rows on a
    GPU, 6 above: here one fewer, the Triton dequantize pass being a GPU kind)."""
    monkeypatch.delenv("ASYNCENGINE_TUNE_ALL_KINDS", raising=False)
    for group, k, bits in [(128, 4096, 4), (128, 11008, 8), (32, 4096, 4), (64, 14336, 4),
                           (4096, 4096, 4), (11008, 11008, 8), (32, 4096, 8)]:  # fmt: skip
        for cuda in (False, True):
            layer = _shape(group, k, bits, cuda)
            for rows in (1, 2, 4, 8, 16, 64, 256, 1024):
                rule = tuning_kinds(layer, rows)
                full = all_int_kinds(layer, rows)
                where = (group, k, bits, rows, cuda)
                assert rule and set(rule) <= set(full) and len(rule) <= 3, where
    monkeypatch.setenv("ASYNCENGINE_TUNE_ALL_KINDS", "1")
    layer = _shape(128, 4096)
    assert tuning_kinds(layer, 1) == all_int_kinds(layer, 1)
    assert len(tuning_kinds(layer, 1)) == 11 and len(tuning_kinds(layer, 64)) == 5
    assert isinstance(tuning_kinds(layer, 1)[0], DequantMatmul)  # the reference first


def test_short_rows_keep_a_gemv_that_reads_the_whole_row(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:  # fmt: skip
    """K shorter than a rule's rows per program (a tiny model's 64 or 128): each program
    reads the whole row; group -1 takes 128-row tiles as a long group does."""
    monkeypatch.delenv("ASYNCENGINE_TUNE_ALL_KINDS", raising=False)
    assert _names(tuning_kinds(_shape(32, 128), 1)) == [
        "GEMV gemv n32 k32x4 at once w1 pairs", "GEMV gemv n32 k32x4 at once w4 pairs"
    ]  # fmt: skip
    assert _names(tuning_kinds(_shape(64, 64), 2))[0] == "GEMV gemv n32 k64x1 at once w1 pairs"
    assert _names(tuning_kinds(_shape(2048, 2048), 1))[0] == "GEMV gemv n32 k128x2 at once w1 pairs"


def test_int4_layers_with_the_wgmma_copy_also_time_it_up_to_256_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A layer holding the codes packed for `QuantWgmma` has it timed at every ladder step
    it serves (1-256 rows): beside the rules' other kinds at 1 and 256 rows, alone at 2-64
    (where it won every 7B layer, through the ring from 17 rows); without the copy, never."""
    monkeypatch.delenv("ASYNCENGINE_TUNE_ALL_KINDS", raising=False)
    plain = _shape(128, 4096, cuda=True)
    layer = _shape(128, 4096, cuda=True)
    layer.wgmma_words = torch.empty(0, dtype=torch.int32)
    for rows in (1, 256):
        got, without = tuning_kinds(layer, rows), tuning_kinds(plain, rows)
        assert [k for k in got if not isinstance(k, QuantWgmma)] == without, rows
        assert sum(isinstance(k, QuantWgmma) for k in got) == 1, rows
    for rows in (2, 4, 8, 16, 64):
        assert tuning_kinds(layer, rows) == [QuantWgmma()], rows
    assert len(tuning_kinds(plain, 64)) > 1  # without the copy the GEMM tiles are timed
    for rows in (1, 2, 4, 8, 16, 64, 256):
        assert QuantWgmma() in all_int_kinds(layer, rows)
    assert tuning_kinds(layer, 1024) == tuning_kinds(plain, 1024)
    assert QuantWgmma() not in all_int_kinds(layer, 1024)


def test_int8_layers_time_the_wgmma_copy_as_int4_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """int8's wgmma path is timed beside the rules' other kinds at 1 and 256 rows, alone at
    2-64 (where it won every 7B layer, through the ring from 17 rows), and not past 256 rows
    (its most)."""
    monkeypatch.delenv("ASYNCENGINE_TUNE_ALL_KINDS", raising=False)
    plain = _shape(128, 4096, bits=8, cuda=True)
    layer = _shape(128, 4096, bits=8, cuda=True)
    layer.wgmma_words = torch.empty(0, dtype=torch.int32)
    for rows in (1, 256):
        got, without = tuning_kinds(layer, rows), tuning_kinds(plain, rows)
        assert without and [k for k in got if not isinstance(k, QuantWgmma)] == without, rows
        assert sum(isinstance(k, QuantWgmma) for k in got) == 1, rows
    for rows in (2, 4, 8, 16, 64):
        assert tuning_kinds(layer, rows) == [QuantWgmma()], rows
        assert QuantWgmma() not in tuning_kinds(plain, rows), rows
    assert len(tuning_kinds(plain, 64)) > 1  # without the copy the GEMM tiles are timed
    assert tuning_kinds(layer, 1024) == tuning_kinds(plain, 1024)


@pytest.mark.parametrize("bits", [4, 8])
def test_fallbacks_are_the_rules_kinds_without_a_lone_wgmma(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """Where the rules time the wgmma matmul alone, the fallbacks (timed if it fails the
    agreement check) are what the rule names for a layer without its copy; elsewhere none."""
    monkeypatch.delenv("ASYNCENGINE_TUNE_ALL_KINDS", raising=False)
    plain = _shape(128, 4096, bits=bits, cuda=True)
    layer = _shape(128, 4096, bits=bits, cuda=True)
    layer.wgmma_words = torch.empty(0, dtype=torch.int32)
    for rows in (2, 4, 8, 16) + ((64,) if bits == 4 else ()):
        assert tuning_kinds(layer, rows) == [QuantWgmma()]
        assert fallback_kinds(layer, rows) == tuning_kinds(plain, rows) != [], rows
    for rows in (1, 256, 1024):  # the wgmma matmul is timed beside others, or not at all
        assert fallback_kinds(layer, rows) == [], rows
    assert all(fallback_kinds(plain, rows) == [] for rows in (1, 2, 16, 64))


def test_the_wgmma_copy_is_dropped_unless_the_plan_runs_it() -> None:
    words = torch.empty(8, dtype=torch.int32)
    kept = SimpleNamespace(wgmma_words=words, plan=MatmulPlan((
        PlanEntry(QuantWgmma(), 16), PlanEntry(DequantMatmul()),
    )))  # fmt: skip
    dropped = SimpleNamespace(wgmma_words=words, plan=MatmulPlan((PlanEntry(DequantMatmul()),)))
    release_unplanned_copies(kept)
    release_unplanned_copies(dropped)
    assert kept.wgmma_words is words and dropped.wgmma_words is None


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU (wgmma)",
)
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("dtype", "group"), [(torch.bfloat16, 128), (torch.float16, 128),
                                              (torch.bfloat16, 64), (torch.float16, 64),
                                              (torch.float16, 32)])
def test_gpu_the_wgmma_kind_agrees_with_the_reference(sym: bool, bits: int, dtype: torch.dtype,
                                                      group: int) -> None:  # fmt: skip
    """bf16 and fp16 layers (most GPTQ checkpoints declare fp16), groups of 128, 64 and 32."""
    from asyncengine_kernels.quant_linear import pack_int_weight

    n, k = 1024, 4096
    gen = torch.Generator().manual_seed(5)
    top = 1 << bits
    codes = torch.randint(0, top, (n, k), generator=gen)
    zeros = (torch.full((k // group, n), top / 2) if sym
             else torch.randint(0, top, (k // group, n), generator=gen))  # fmt: skip
    layer = SimpleNamespace(
        quant_config=IntQuantConfig("gptq", bits, group), group_size=group, in_features=k,
        out_features=n, input_perm=None, qweight=pack_int_weight(codes, bits).cuda(),
        scales=(torch.rand(k // group, n, generator=gen) * 0.01).to(dtype).cuda(),
        zeros=zeros.to(dtype).cuda(),
        gemv_counters=torch.zeros(n, dtype=torch.int32, device="cuda"),
    )  # fmt: skip
    assert wgmma_serves(layer)
    pack_wgmma_copy(layer)
    assert layer.wgmma_has_zero == (not sym)
    for rows in (1, 5, 16, 33, 64, 200, 256):
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        assert agrees_with_reference(QuantWgmma(), layer, x, None), rows
