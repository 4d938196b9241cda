"""Start-up choice of the matmul behind each linear layer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models.linear_tuning as tuning
from asyncengine_kernels.activation import silu_and_mul_ref
from asyncengine_kernels.cpu_gemm import gemm_available
from asyncengine_kernels.cpu_linear import cpu_packing_available
from asyncengine_kernels.gemv import GemvChoice, TiledGemvConfig
from asyncengine_kernels.rms_norm import fused_add_rms_norm_ref
from asyncengine_kernels.skinny_gemm import SkinnyChoice, SkinnyConfig
from models.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
)
from models.matmul_plan import (
    Blas,
    CpuGemm,
    CpuPacked,
    Epilogue,
    InputTransform,
    MatmulPlan,
    TritonGemv,
    TritonSkinnyGemm,
)


def _model() -> nn.Module:
    model = nn.ModuleDict({
        "up": ColumnParallelLinear(48, 96, bias=True),
        "down": RowParallelLinear(96, 48),
        "gated": RowParallelLinear(48, 48, input_transform=InputTransform.SILU_AND_MUL),
        "head": ParallelLMHead(300, 48),
    })  # fmt: skip
    for p in model.parameters():
        p.data.normal_()
    return model


def _fake_cpu_timings(winner: str, *, up_to: int | None = None, shape_n: int | None = None):
    """A stand-in for `time_cpu_kinds`: `winner` takes half BLAS's time (at rows up to
    `up_to`, for weights of `shape_n` rows, where given); elsewhere oneDNN-packed takes 95 %
    (inside its margin) and the CPU GEMM 120 % (clearly slower)."""
    calls: list[tuple[tuple[int, int], int, InputTransform]] = []

    def fake(weights, kinds, ladder, declared=InputTransform.NONE):  # type: ignore[no-untyped-def]
        per_rows = {}
        for rows in ladder:
            calls.append((tuple(weights[0].shape), rows, declared))
            wins = (up_to is None or rows <= up_to) and (
                shape_n is None or weights[0].shape[0] == shape_n
            )  # fmt: skip
            times = {k.describe(): 95.0 for k in kinds}
            times["BLAS"] = 100.0
            if "CPU GEMM" in times:
                times["CPU GEMM"] = 120.0  # clearly slower than BLAS unless it wins
            if wins and winner in times:
                times[winner] = 50.0
            per_rows[rows] = times
        return per_rows

    return fake, calls


def _check_outputs(model: nn.Module, rows: int) -> None:
    x = torch.randn(rows, 48)
    up = model["up"]
    torch.testing.assert_close(up(x), F.linear(x, up.weight, up.bias), atol=1e-4, rtol=1e-5)
    head = model["head"]
    torch.testing.assert_close(
        head.compute_logits(x), F.linear(x, head.weight)[:, :300], atol=1e-4, rtol=1e-5
    )
    h = torch.randn(rows, 96)
    down = model["down"]
    torch.testing.assert_close(down(h), F.linear(h, down.weight), atol=1e-4, rtol=1e-5)
    gated = model["gated"]
    torch.testing.assert_close(gated(h), F.linear(F.silu(h[:, :48]) * h[:, 48:], gated.weight),
                               atol=1e-4, rtol=1e-5)  # fmt: skip


def _winners() -> list[str]:
    names = ["BLAS"]
    if gemm_available():
        names.append(CpuGemm().describe())
    if cpu_packing_available():
        names.append(CpuPacked().describe())
    return names


@pytest.mark.parametrize("winner", _winners())
def test_cpu_layers_take_the_faster_path_and_stay_exact(
    monkeypatch: pytest.MonkeyPatch, winner: str
) -> None:
    """The kind that wins at every row count of the ladder serves up to its top, BLAS above;
    BLAS serves every batch when it wins."""
    fake, calls = _fake_cpu_timings(winner)
    monkeypatch.setattr(tuning, "time_cpu_kinds", fake)
    model = _model()
    plans, timings = tuning.plan_cpu_linears(model)
    if not tuning.cpu_kinds():
        assert plans == {} and timings == {}
        return
    assert set(timings) == {(96, 48), (48, 96), (48, 48), (300, 48)}
    assert all(set(per_rows) == set(tuning.CPU_ROW_LADDER) for per_rows in timings.values())
    # Each shape is timed once per row count, with its layers' input transform.
    assert sorted(calls) == sorted(
        (tuple(m.weight.shape), rows, m.input_transform)
        for m in model.values() for rows in tuning.CPU_ROW_LADDER
    )  # fmt: skip
    assert set(plans) == set(model.values())
    assert all(m.plan == MatmulPlan.default(m.input_transform) for m in model.values())
    tuning.tune_cpu_linears(model)
    top = tuning.CPU_ROW_LADDER[-1]
    for name, m in model.items():
        assert m.plan == plans[m], name
        small, large = m.plan.entry_for(1), m.plan.entry_for(top + 1)
        assert small.kind.describe() == winner and large.kind == Blas()
        assert small == m.plan.entry_for(top)  # one entry serves the whole ladder
        assert small.input is large.input is m.input_transform
        assert small.fuse_input == (m.input_transform in small.kind.fusable_inputs)
        assert (getattr(m, "gemm_weight", None) is not None) == (winner == "CPU GEMM")
        assert (getattr(m, "packed_weight", None) is not None) == (winner == "oneDNN-packed")
    for rows in (1, top, top + 1):
        _check_outputs(model, rows)


def test_cpu_linears_keep_blas_when_the_copies_would_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Packed copies double a layer's memory: a model whose copies would take more than the
    allowed share of the free host memory is not timed and keeps BLAS everywhere."""
    fake, calls = _fake_cpu_timings(CpuGemm().describe())
    monkeypatch.setattr(tuning, "time_cpu_kinds", fake)
    model = _model()
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in model.values())
    free = int(weight_bytes / tuning.CPU_PACKED_MAX_SHARE_OF_FREE) - 1
    monkeypatch.setattr(tuning, "_available_host_bytes", lambda: free)
    assert tuning.plan_cpu_linears(model) == ({}, {})
    assert calls == []
    if tuning.cpu_kinds():  # with room for the copies, the same model is tuned
        monkeypatch.setattr(tuning, "_available_host_bytes", lambda: free + 1)
        plans, _ = tuning.plan_cpu_linears(model)
        assert set(plans) == set(model.values()) and calls


@pytest.mark.skipif(not gemm_available(), reason="no C compiler for the CPU GEMM")
def test_a_shape_that_wins_only_at_small_batches_takes_the_kind_for_those(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GEMM wins for the head up to 8 rows and loses clearly everywhere else (oneDNN
    inside its margin): the head takes it for 1-8 rows, every other layer keeps BLAS."""
    fake, _ = _fake_cpu_timings(CpuGemm().describe(), up_to=8, shape_n=300)
    monkeypatch.setattr(tuning, "time_cpu_kinds", fake)
    model = _model()
    plans, _ = tuning.plan_cpu_linears(model)
    for m, plan in plans.items():
        if m is model["head"]:
            assert [e.max_rows for e in plan.entries] == [8, None]
            assert [e.kind for e in plan.entries] == [CpuGemm(), Blas()]
        else:
            assert plan == MatmulPlan.default(m.input_transform)
    tuning.tune_cpu_linears(model)
    for rows in (1, 8, 9):
        _check_outputs(model, rows)


def test_cpu_plan_merges_ranges_of_one_kind() -> None:
    """Ranges of one kind merge; a BLAS range between two others stays its own entry."""
    gemm, blas = CpuGemm(), Blas()
    times = {
        2: {"BLAS": 100.0, "CPU GEMM": 90.0},
        8: {"BLAS": 100.0, "CPU GEMM": 80.0},
        16: {"BLAS": 100.0, "CPU GEMM": 120.0},
        32: {"BLAS": 100.0, "CPU GEMM": 70.0},
        64: {"BLAS": 100.0, "CPU GEMM": 130.0},
    }
    plan = tuning._cpu_plan(times, [gemm], InputTransform.RMS_NORM)
    assert [(e.kind, e.max_rows) for e in plan.entries] == [
        (gemm, 8), (blas, 16), (gemm, 32), (blas, None)
    ]  # fmt: skip
    assert [e.fuse_input for e in plan.entries] == [True, False, True, False]


def test_large_or_non_float32_weights_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, calls = _fake_cpu_timings("CPU GEMM")
    monkeypatch.setattr(tuning, "time_cpu_kinds", fake)
    monkeypatch.setattr(tuning, "CPU_PACKED_MAX_BYTES", 48 * 96 * 4 - 1)
    model = _model()
    model["head"].to(torch.float16)
    model["gated"].to(torch.float16)
    plans, _ = tuning.plan_cpu_linears(model)
    assert set(plans) == set() and calls == []
    tuning.tune_cpu_linears(model)
    assert all(m.plan == MatmulPlan.default(m.input_transform) for m in model.values())


def test_gpu_tuning_ignores_cpu_layers() -> None:
    model = _model()
    assert tuning.plan_decode_gemvs(model) == ({}, {})
    assert tuning.tune_gpu_linears(model) == {}
    assert all(m.plan == MatmulPlan.default(m.input_transform) for m in model.values())


def test_plans_are_described_one_line_per_layer_group() -> None:
    """Layers of one name, shape and plan share a line."""
    model = nn.ModuleDict({
        "a": nn.ModuleDict({"o_proj": RowParallelLinear(16, 8)}),
        "b": nn.ModuleDict({"o_proj": RowParallelLinear(16, 8)}),
        "lm_head": ParallelLMHead(40, 8),
    })  # fmt: skip
    assert tuning.describe_matmul_plans(model) == [
        "o_proj 8x16: 1+ rows: BLAS",
        "lm_head 40x8: 1+ rows: BLAS",
    ]


TILED = TiledGemvConfig(8, 16, 4, 1)


def _decoder_layers() -> nn.ModuleDict:
    norm, gated = InputTransform.RMS_NORM, InputTransform.SILU_AND_MUL
    layers = nn.ModuleDict({
        "qkv_proj": ColumnParallelLinear(16, 24, bias=True, input_transform=norm),
        "gate_up_proj": MergedColumnParallelLinear(
            16, [32, 32], input_transform=norm, glu_output=True
        ),
        "down_proj": RowParallelLinear(32, 16, input_transform=gated),
        "norm": RMSNorm(16, 1e-5),
    })  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    for p in layers.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layers


@pytest.mark.parametrize("outcome", ["glu pair", "separate", "blas"])
def test_decode_planning_keeps_the_mlp_pair_consistent(
    monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    """The GPU tuner's planning, with the timings faked and the layers on the CPU: whichever
    arrangement wins, the MLP's batch-1 entries fit together and every batch size still
    gives the reference (the Triton GEMV runs in the interpreter)."""
    calls: list[dict] = []

    def fake_tune_gemv(weights, biases=None, reps=5, gated=False, normed=False, glu=False,
                       configs=None) -> GemvChoice:  # fmt: skip
        calls.append({"gated": gated, "normed": normed, "glu": glu, "configs": configs})
        if outcome == "blas":
            return GemvChoice(None, False, 1.0, {"blas": 1.0})
        fast = outcome == "glu pair" and (glu or not (gated or normed))
        ms = 0.4 if fast else 1.0
        return GemvChoice(TILED, gated or normed, ms, {"blas": 2.0, str(TILED): ms})

    def library_wins(weights, biases=None, rows=8, reps=5, gated=False, glu=False,
                     configs=None, normed=False) -> SkinnyChoice:  # fmt: skip
        return SkinnyChoice(None, False, 1.0, {"blas": 1.0})

    monkeypatch.setattr(tuning, "tune_gemv", fake_tune_gemv)
    monkeypatch.setattr(tuning, "tune_skinny", library_wins)
    layers = _decoder_layers()
    plans, timings = tuning._plan_groups(tuning._gemv_groups(layers, "cpu"), [TILED])
    assert all(call["configs"] == [TILED] for call in calls)
    assert sum(call["glu"] for call in calls) == 1  # the pair is timed once
    assert set(timings) == {(24, 16), (64, 16), (16, 32)}
    for name in ("qkv_proj", "gate_up_proj", "down_proj"):
        layers[name].set_plan(plans[layers[name]])
    gate_up, down = layers["gate_up_proj"].plan, layers["down_proj"].plan
    glu = gate_up.entry_for(1).epilogue is Epilogue.SILU_AND_MUL
    assert glu == (outcome == "glu pair")
    assert (down.entry_for(1).input is InputTransform.NONE) == glu
    assert down.entry_for(2).input is InputTransform.SILU_AND_MUL
    gemv = outcome != "blas"
    assert isinstance(layers["qkv_proj"].plan.entry_for(1).kind, TritonGemv) == gemv
    assert layers["qkv_proj"].plan.entry_for(1).fuse_input == gemv
    norm = layers["norm"]
    for rows in (1, 3):
        x, residual = torch.randn(rows, 16), torch.randn(rows, 16)
        h, want_residual = fused_add_rms_norm_ref(x, residual, norm.weight, 1e-5)
        mid, new_residual = layers["gate_up_proj"].forward_normed(x, residual, norm)
        want = F.linear(silu_and_mul_ref(F.linear(h, layers["gate_up_proj"].weight)),
                        layers["down_proj"].weight)  # fmt: skip
        torch.testing.assert_close(layers["down_proj"](mid), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new_residual, want_residual)
        qkv, _ = layers["qkv_proj"].forward_normed(x, residual, norm)
        qkv_proj = layers["qkv_proj"]
        torch.testing.assert_close(qkv, F.linear(h, qkv_proj.weight, qkv_proj.bias),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


def test_the_16_bit_tuning_compiles_every_call_in_a_pool_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the GPU, each of the 16-bit planner's timings (`_tuning_calls`) runs once under
    `compile_only` from pool threads before the serial pass; CPU layers skip the pool."""
    import threading
    from types import SimpleNamespace

    from asyncengine_kernels import gemv as gemv_module

    seen: list[tuple[str, bool]] = []

    def call() -> None:
        seen.append((threading.current_thread().name, getattr(gemv_module._compiling, "on", False)))

    cuda_layer = SimpleNamespace(weight=SimpleNamespace(device=torch.device("cuda")))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(tuning, "COMPILE_AHEAD_THREADS", 4)
    tuning._compile_tuning_calls([call] * 6, {"group": [cuda_layer]})  # type: ignore[dict-item]
    assert len(seen) == 6
    assert all(name.startswith("compile") and on for name, on in seen)
    seen.clear()
    cpu_layer = SimpleNamespace(weight=SimpleNamespace(device=torch.device("cpu")))
    tuning._compile_tuning_calls([call] * 6, {"group": [cpu_layer]})  # type: ignore[dict-item]
    assert seen == []


SKINNY = SkinnyConfig(32, 16, 2, 4, 1)


@pytest.mark.parametrize("pair_up_to", [0, 4])
def test_few_row_entries_go_to_the_skinny_matmul_where_it_wins(
    monkeypatch: pytest.MonkeyPatch, pair_up_to: int
) -> None:
    """Faked timings: the few-row matmul beats the library up to 8 rows and loses at 16;
    the MLP pair (GLU epilogue, plain down input) wins up to `pair_up_to` rows. Each layer
    gets those entries, the MLP's two layers matching at every row count, and every batch
    size still gives the reference (the Triton kernels run in the interpreter)."""
    calls: list[dict] = []

    def blas_at_one_row(weights, biases=None, reps=5, gated=False, normed=False, glu=False,
                        configs=None) -> GemvChoice:  # fmt: skip
        return GemvChoice(None, False, 1.0, {"blas": 1.0})

    def fake_tune_skinny(weights, biases=None, rows=8, reps=5, gated=False, glu=False,
                         configs=None, normed=False) -> SkinnyChoice:  # fmt: skip
        calls.append({"rows": rows, "gated": gated, "glu": glu, "configs": configs,
                      "normed": normed, "shape": tuple(weights[0].shape)})  # fmt: skip
        if rows > 8:
            return SkinnyChoice(None, False, 1.0, {"blas": 1.0, str(SKINNY): 1.5})
        # The MLP as a pair (the gate/up matmul with its epilogue, the down projection on a
        # plain input) costs 0.3 + 0.3 up to `pair_up_to` rows, else 0.5 + 0.5; apart, each
        # layer costs 0.4.
        down_plain = weights[0].shape == (16, 32) and not gated
        ms = (0.3 if rows <= pair_up_to else 0.5) if glu or down_plain else 0.4
        return SkinnyChoice(SKINNY, gated, ms, {"blas": 1.0, str(SKINNY): ms})

    monkeypatch.setattr(tuning, "tune_gemv", blas_at_one_row)
    monkeypatch.setattr(tuning, "tune_skinny", fake_tune_skinny)
    layers = _decoder_layers()
    plans, timings = tuning._plan_groups(tuning._gemv_groups(layers, "cpu"), [TILED],
                                         [SKINNY])  # fmt: skip
    assert all(call["configs"] == [SKINNY] for call in calls)
    # Three groups at four row counts, then the MLP pair's two forms at each.
    assert sorted({call["rows"] for call in calls}) == list(tuning.SKINNY_ROW_LADDER)
    assert len(calls) == 3 * 4 + 2 * 4
    # The normed groups (qkv, gate/up) are timed with their norm; the down projection not.
    assert {c["shape"] for c in calls if c["normed"]} == {(24, 16), (64, 16)}
    assert f"8 rows: {SKINNY}" in timings[(24, 16)]
    for name in ("qkv_proj", "gate_up_proj", "down_proj"):
        layers[name].set_plan(plans[layers[name]])
    qkv, gate_up, down = (layers[n].plan for n in ("qkv_proj", "gate_up_proj", "down_proj"))
    assert qkv.describe() == (
        f"1 row: BLAS, rms_norm before it; 2-8 rows: Triton skinny GEMM {SKINNY}, rms_norm "
        "before it; 9+ rows: BLAS, rms_norm before it"
    )
    for rows in range(1, 18):
        skinny = 2 <= rows <= 8
        for plan in (qkv, gate_up, down):
            assert isinstance(plan.entry_for(rows).kind, TritonSkinnyGemm) == skinny
        pair = 2 <= rows <= pair_up_to
        assert (gate_up.entry_for(rows).epilogue is Epilogue.SILU_AND_MUL) == pair
        assert (down.entry_for(rows).input is InputTransform.NONE) == pair
        # Apart, the down projection forms silu(gate) * up in its prologue.
        assert down.entry_for(rows).gated == (skinny and not pair)
    assert layers["down_proj"].skinny_counters is not None
    norm = layers["norm"]
    for rows in (1, 3, 6, 12, 17):
        x, residual = torch.randn(rows, 16), torch.randn(rows, 16)
        h, _ = fused_add_rms_norm_ref(x, residual, norm.weight, 1e-5)
        mid, _ = layers["gate_up_proj"].forward_normed(x, residual, norm)
        want = F.linear(silu_and_mul_ref(F.linear(h, layers["gate_up_proj"].weight)),
                        layers["down_proj"].weight)  # fmt: skip
        torch.testing.assert_close(layers["down_proj"](mid), want, atol=1e-5, rtol=1e-5)
        qkv_proj = layers["qkv_proj"]
        torch.testing.assert_close(qkv_proj.forward_normed(x, residual, norm)[0],
                                   F.linear(h, qkv_proj.weight, qkv_proj.bias),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


def test_an_empty_ladder_times_no_few_row_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    def blas_at_one_row(*args, **kwargs) -> GemvChoice:  # type: ignore[no-untyped-def]
        return GemvChoice(None, False, 1.0, {"blas": 1.0})

    def never(*args, **kwargs) -> SkinnyChoice:  # type: ignore[no-untyped-def]
        raise AssertionError("timed with an empty ladder")

    monkeypatch.setattr(tuning, "tune_gemv", blas_at_one_row)
    monkeypatch.setattr(tuning, "tune_skinny", never)
    layers = _decoder_layers()
    plans, _ = tuning._plan_groups(tuning._gemv_groups(layers, "cpu"), None, ladder=())
    assert all(plan == MatmulPlan.default(m.input_transform) for m, plan in plans.items())
    with pytest.raises(ValueError, match="ladder must rise"):
        tuning._plan_groups(tuning._gemv_groups(layers, "cpu"), None, ladder=(4, 2))
    with pytest.raises(ValueError, match="ladder must rise"):
        tuning._plan_groups(tuning._gemv_groups(layers, "cpu"), None, ladder=(2, 32))


def test_the_plan_merges_neighbouring_entries_that_run_alike() -> None:
    norm = InputTransform.RMS_NORM
    skinny = TritonSkinnyGemm(SKINNY)
    entries = [tuning.PlanEntry(Blas(), 1, norm), tuning.PlanEntry(skinny, 2, norm),
               tuning.PlanEntry(skinny, 4, norm), tuning.PlanEntry(Blas(), 8, norm),
               tuning.PlanEntry(Blas(), 16, norm)]  # fmt: skip
    plan = tuning._plan_of(entries, tuning.PlanEntry(Blas(), input=norm))
    assert [(type(e.kind), e.max_rows) for e in plan.entries] == [
        (Blas, 1), (TritonSkinnyGemm, 4), (Blas, None)
    ]  # fmt: skip


# ------------------------------------------------------------- quantized layers
def _three_layers(device: str, dtype: torch.dtype, qc: object, k_ab: int, k_c: int
                  ) -> nn.ModuleDict:  # fmt: skip
    """Layers of format `qc`: "a" and "b" of one shape [64, k_ab], and "c" [96, k_c] with an
    RMSNorm input; built under `dtype` as the model loader builds layers (their activations'
    dtype: the 16-bit kernels refuse float32 ones)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return nn.ModuleDict({
                "a": RowParallelLinear(k_ab, 64, quant_config=qc),
                "b": RowParallelLinear(k_ab, 64, quant_config=qc),
                "c": ColumnParallelLinear(k_c, 96, input_transform=InputTransform.RMS_NORM,
                                          quant_config=qc),
            })  # fmt: skip
    finally:
        torch.set_default_dtype(previous)


def _quantized_model(device: str, dtype: torch.dtype) -> nn.Module:
    """Two same-shape GPTQ int4 layers (group 32) with random codes, repacked as at load,
    and a third of another shape; K is 512, the least that the rules' small GEMM tile (split
    4 along K in steps of 128) fits."""
    from models.quantization.config import IntQuantConfig
    from models.quantization.layer import process_int_linear

    model = _three_layers(device, dtype, IntQuantConfig("gptq", 4, 32), 512, 512)
    gen = torch.Generator(device).manual_seed(0)
    for layer in model.values():
        layer.weight.data.random_(0, 16, generator=gen)
        layer.weight_zero.data.random_(0, 16, generator=gen)
        layer.weight_scale.data = (torch.rand(layer.weight_scale.shape, generator=gen,
                                              device=device) * 0.01).to(dtype)  # fmt: skip
        process_int_linear(layer)
    return model


def test_quantized_layers_are_planned_per_row_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timings that favour the GEMV up to 4 rows and the first GEMM tile of each step over
    dequantize + BLAS up to 64 rows give one entry per choice; the steps above 64 rows hold
    dequantize + BLAS alone, which is checked but not timed. RMSNorm inputs keep their
    declared transform."""
    from models.quantization.kinds import DequantMatmul, QuantTritonGemm, QuantTritonGemv

    def fake_times(kinds, x, pairs, reps, low_rows=1, *, declared):  # type: ignore[no-untyped-def]
        rows = x.shape[0]
        gemms = [k for k in kinds if isinstance(k, QuantTritonGemm)]

        def ms(kind: object) -> float:
            if isinstance(kind, QuantTritonGemv):
                return 1.0 if rows <= 4 else 9.0
            if isinstance(kind, QuantTritonGemm):
                return 2.0 + (0.1 if kind != gemms[0] else 0.0)
            return 3.0

        return {k.describe(): ms(k) for k in kinds}

    monkeypatch.setattr(tuning, "_time_kinds", fake_times)
    model = _quantized_model("cpu", torch.float32)
    plans, timings = tuning.plan_quantized_linears(model, device_type="cpu")
    assert set(plans) == set(model.values())
    assert plans[model["a"]] is plans[model["b"]] or plans[model["a"]] == plans[model["b"]]
    entries = plans[model["a"]].entries
    assert [e.max_rows for e in entries] == [4, 16, 64, None]
    assert [type(e.kind) for e in entries] == [
        QuantTritonGemv, QuantTritonGemm, QuantTritonGemm, DequantMatmul
    ]  # fmt: skip
    assert [e.kind.config.block_m for e in entries[1:3]] == [16, 64]
    assert all(e.input is InputTransform.RMS_NORM for e in plans[model["c"]].entries)
    assert set(timings) == {(64, 512), (96, 512)}
    assert set(timings[(64, 512)]) == {1, 2, 4, 8, 16, 64}  # one candidate above: not timed
    # The 16-bit tuners leave quantized layers alone, and they are described by shape.
    assert tuning.plan_cpu_linears(model)[0] == {}
    assert tuning.describe_matmul_plans(model)[0].startswith("a 64x512: 1+ rows: dequantize")


def test_a_step_of_one_candidate_is_checked_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ladder step of one kind is only checked against the reference; a step where no
    kind agrees (timed or not) plans the reference."""
    from models.quantization.kinds import DequantMatmul

    timed: list[int] = []
    checked: list[int] = []

    def fake_times(kinds, x, pairs, reps, low_rows=1, *, declared):  # type: ignore[no-untyped-def]
        timed.append(x.shape[0])
        return {}  # none agreed

    def none_agree(kinds, pairs, x, low_rows):  # type: ignore[no-untyped-def]
        checked.append(x.shape[0])
        return []

    monkeypatch.setattr(tuning, "_time_kinds", fake_times)
    monkeypatch.setattr(tuning, "_agreeing_kinds", none_agree)
    model = _quantized_model("cpu", torch.float32)
    plans, _ = tuning.plan_quantized_linears(model, device_type="cpu")
    assert sorted(set(timed)) == [1, 2, 4, 8, 16, 64]
    assert sorted(set(checked)) == [256, 1024]
    assert [type(e.kind) for e in plans[model["a"]].entries] == [DequantMatmul]


def test_candidates_that_all_fail_give_way_to_the_fallbacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Where a step's candidates all disagree with the reference (the wgmma matmul, timed
    alone where it serves), the format's fallback kinds are timed there instead and the
    fastest is planned, rather than the torch reference: for a lone candidate (only
    checked) and for two (timed)."""
    from asyncengine_kernels.quant_linear import QuantGemmConfig
    from models.quantization import kinds as int_kinds
    from models.quantization.kinds import DequantMatmul, QuantTritonGemm, QuantWgmma

    bad_gemm = QuantTritonGemm(QuantGemmConfig(64, 64, 64))
    failing = {QuantWgmma(), bad_gemm}
    reference = DequantMatmul()
    gemm = QuantTritonGemm(QuantGemmConfig(16, 64, 64))
    steps = {2: [QuantWgmma()], 64: [QuantWgmma(), bad_gemm]}
    monkeypatch.setattr(int_kinds, "tuning_kinds",
                        lambda layer, rows: steps.get(rows, [reference]))  # fmt: skip
    monkeypatch.setattr(int_kinds, "fallback_kinds",
                        lambda layer, rows: [gemm, reference] if rows in steps else [])
    monkeypatch.setattr(tuning, "_agreeing_kinds",
                        lambda kinds, pairs, x, low_rows: [k for k in kinds if k not in failing])
    timed: dict[int, list[str]] = {}  # per row count, what each shape's tuning timed

    def fake_times(kinds, x, pairs, reps, low_rows=1, *, declared):  # type: ignore[no-untyped-def]
        timed.setdefault(x.shape[0], []).extend(k.describe() for k in kinds)
        times = {gemm.describe(): 1.0, reference.describe(): 2.0}
        return {k.describe(): times[k.describe()] for k in kinds if k not in failing}

    monkeypatch.setattr(tuning, "_time_kinds", fake_times)
    model = _quantized_model("cpu", torch.float32)
    plans, _ = tuning.plan_quantized_linears(model, device_type="cpu")
    fallback = [gemm.describe(), reference.describe()]
    shapes = 2  # the model's two weight shapes, tuned in turn
    assert timed == {2: fallback * shapes,
                     64: ([f.describe() for f in steps[64]] + fallback) * shapes}
    entries = plans[model["a"]].entries
    assert [(e.kind, e.max_rows) for e in entries] == [
        (reference, 1), (gemm, 2), (reference, 16), (gemm, 64), (reference, None)
    ]  # fmt: skip


class _CountingReference(Blas):
    """A reference that counts its outputs (x W^T, as the exact kind computes it)."""

    calls: ClassVar[list[int]] = []

    def apply(self, layer, x, bias, *, gated=False, glu=False):  # type: ignore[no-untyped-def]
        _CountingReference.calls.append(x.shape[0])
        return super().apply(layer, x, bias)


@dataclass(frozen=True)
class _Scaled(Blas):
    """x W^T times a factor; raises where the factor is None."""

    factor: float | None = 1.0
    reference: ClassVar[Blas] = _CountingReference()

    def apply(self, layer, x, bias, *, gated=False, glu=False):  # type: ignore[no-untyped-def]
        if self.factor is None:
            raise RuntimeError("out of resources")
        return self.factor * super().apply(layer, x, bias)

    def describe(self) -> str:
        return f"scaled {self.factor}"


def test_agreement_computes_each_reference_once_per_layer_and_input(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Many kinds checked over many layers: the reference output of each layer and row
    count is computed once, not once per kind; a kind off by 2x is dropped with a warning,
    one that raises is dropped silently, and the exact ones stay, in order."""
    layers = [nn.Linear(8, 4, bias=False) for _ in range(3)]
    pairs = [(m, None) for m in layers]
    kinds = [_Scaled(1.0), _Scaled(2.0), _Scaled(None), _Scaled(1.0 + 1e-4)]
    _CountingReference.calls = []
    with caplog.at_level("WARNING", logger=tuning.logger.name):
        alive = tuning._agreeing_kinds(kinds, pairs, torch.randn(4, 8), low_rows=3)
    assert alive == [kinds[0], kinds[3]]
    assert sorted(_CountingReference.calls) == [3, 3, 3, 4, 4, 4]  # 3 layers x 2 row counts
    assert [r.message for r in caplog.records] == [
        "quantized scaled 2.0 disagrees with the reference at 4 rows; not planned"
    ]
    assert tuning._agrees_over_range(kinds[0], pairs, torch.randn(2, 8), low_rows=1)
    assert not tuning._agrees_over_range(kinds[2], pairs, torch.randn(2, 8), low_rows=1)


def test_compile_ahead_runs_nothing_on_the_cpu() -> None:
    """The threads serve CUDA launches only; on the CPU the serial pass compiles."""
    _CountingReference.calls = []
    pair = (nn.Linear(8, 4), None)
    tuning._compile_ahead([
        tuning.CompileJob(kind, pair, rows, 1, InputTransform.NONE)
        for kind in (_Scaled(None), _CountingReference()) for rows in (2, 4)
    ], "cpu")  # fmt: skip
    assert _CountingReference.calls == []


def test_every_uncached_step_compiles_ahead_in_one_pool(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:  # fmt: skip
    """Before the first step is timed, the planner hands the pool one job per candidate of
    every shape's steps up to `COMPILE_AHEAD_MAX_ROWS` rows (single-candidate steps too),
    each with the step's row range; shapes planned from the cache compile nothing ahead."""
    from models.plan_cache import PlanCache
    from models.quantization.method import get_quant_method

    handed: list[list[tuning.CompileJob]] = []
    monkeypatch.setattr(tuning, "_compile_ahead",
                        lambda jobs, device_type: handed.append(list(jobs)))  # fmt: skip
    model = _quantized_model("cpu", torch.float32)
    cache = PlanCache(tmp_path)
    tuning.plan_quantized_linears(model, device_type="cpu", cache=cache)
    (jobs,) = handed
    ladder = tuning.QUANT_ROW_LADDER
    steps = [(rows, ladder[i - 1] + 1 if i else 1) for i, rows in enumerate(ladder)
             if rows <= tuning.COMPILE_AHEAD_MAX_ROWS]  # fmt: skip
    shapes = {(j.pair[0].out_features, j.pair[0].in_features) for j in jobs}
    assert len(shapes) == 2
    for shape in shapes:
        layer = next(j.pair[0] for j in jobs if (j.pair[0].out_features,
                                                 j.pair[0].in_features) == shape)  # fmt: skip
        method = get_quant_method(layer.quant_config)
        want = [(kind, rows, low) for rows, low in steps
                for kind in method.tuning_kinds(layer, rows)]  # fmt: skip
        got = [(j.kind, j.rows, j.low_rows) for j in jobs if j.pair[0] is layer]
        assert got == want
    handed.clear()
    tuning.plan_quantized_linears(model, device_type="cpu", cache=cache)
    assert handed == [[]]


def test_the_compile_pool_also_runs_each_power_of_two_inside_a_step() -> None:
    """A step serving 17-64 rows compiles at 17 and 64 (the agreement check's inputs) and
    at 32 (the pool's): 32 is a multiple of 16 that pads to another wgmma launch than 64."""
    x = torch.randn(64, 4)
    assert [t.shape[0] for t in tuning._bucket_inputs(x, 17)] == [32]
    assert [t.shape[0] for t in tuning._bucket_inputs(torch.randn(256, 4), 65)] == [128]
    assert tuning._bucket_inputs(torch.randn(4, 4), 3) == []
    assert tuning._bucket_inputs(torch.randn(16, 4), 9) == []
    assert tuning._bucket_inputs(torch.randn(1, 4), 1) == []


def test_quantized_plans_are_read_back_from_the_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:  # fmt: skip
    """A second start with the same layers plans from the cache without timing; a cached
    kind that disagrees with the reference, or is no longer a candidate, is timed again."""
    from models.plan_cache import PlanCache
    from models.quantization.kinds import QuantTritonGemm, QuantTritonGemv

    timed: list[int] = []

    def fake_times(kinds, x, pairs, reps, low_rows=1, *, declared):  # type: ignore[no-untyped-def]
        timed.append(x.shape[0])
        # The GEMVs' half-precision pairs refuse this float32 model: they never agree.
        return {k.describe(): (1.0 if isinstance(k, QuantTritonGemm) else 2.0) for k in kinds
                if not isinstance(k, QuantTritonGemv)}  # fmt: skip

    monkeypatch.setattr(tuning, "_time_kinds", fake_times)
    model = _quantized_model("cpu", torch.float32)
    cache = PlanCache(tmp_path)
    plans, timings = tuning.plan_quantized_linears(model, device_type="cpu", cache=cache)
    # Two shapes, each step of more than one candidate (up to 64 rows) timed.
    steps = 2 * len([rows for rows in tuning.QUANT_ROW_LADDER if rows <= 64])
    assert len(timed) == steps
    assert len(list(tmp_path.glob("*.json"))) == 2
    timed.clear()
    again, timings = tuning.plan_quantized_linears(model, device_type="cpu", cache=cache)
    assert timed == [] and timings == {}
    assert again == plans
    # A cached choice that no longer agrees with the reference is timed anew.
    monkeypatch.setattr(tuning, "agrees_with_reference", lambda *a: False)
    tuning.plan_quantized_linears(model, device_type="cpu", cache=cache)
    assert len(timed) == steps
    monkeypatch.undo()
    monkeypatch.setattr(tuning, "_time_kinds", fake_times)
    # So is one the candidates no longer hold (the entry names a kind that is gone).
    for path in tmp_path.glob("*.json"):
        path.write_text(path.read_text().replace("gemm", "retired"))
    timed.clear()
    tuning.plan_quantized_linears(model, device_type="cpu", cache=cache)
    assert len(timed) == steps


def test_a_plan_of_fallback_kinds_is_read_back_from_the_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:  # fmt: skip
    """Where every candidate of a step fails, the format's fallbacks are timed and planned;
    the next start finds that plan in the cache (the fallbacks are known names there), times
    nothing and plans the same."""
    from models.plan_cache import PlanCache
    from models.quantization.kinds import DequantMatmul, QuantTritonGemm, TritonDequantMatmul
    from models.quantization.method import IntLinearMethod

    class Refusing(TritonDequantMatmul):  # a kernel that cannot run for these layers
        def describe(self) -> str:
            return "refusing"

        def apply(self, *args: object, **kwargs: object) -> torch.Tensor:
            raise ValueError("not on this GPU")

    model = _quantized_model("cpu", torch.float32)
    gemm = next(k for k in IntLinearMethod().tuning_kinds(model["a"], 16)
                if isinstance(k, QuantTritonGemm))  # fmt: skip
    monkeypatch.setattr(IntLinearMethod, "tuning_kinds",
                        lambda self, m, rows: [Refusing(), DequantMatmul()][: 1 + (rows > 64)])
    monkeypatch.setattr(IntLinearMethod, "fallback_kinds",
                        lambda self, m, rows: [gemm, DequantMatmul()] if rows <= 64 else [])
    timed: list[int] = []

    def fake_times(kinds, x, pairs, reps, low_rows=1, *, declared):  # type: ignore[no-untyped-def]
        timed.append(x.shape[0])
        return {k.describe(): (1.0 if k is gemm else 2.0) for k in kinds
                if not isinstance(k, Refusing)}  # fmt: skip

    monkeypatch.setattr(tuning, "_time_kinds", fake_times)
    cache = PlanCache(tmp_path)
    plans, _ = tuning.plan_quantized_linears(model, device_type="cpu", cache=cache)
    assert plans[model["a"]].entry_for(16).kind == gemm
    assert timed
    timed.clear()
    again, timings = tuning.plan_quantized_linears(model, device_type="cpu", cache=cache)
    assert timed == [] and timings == {} and again == plans


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_quantized_layers_are_tuned_and_stay_correct() -> None:
    from asyncengine_kernels.quant_linear import quant_matmul_ref

    model = _quantized_model("cuda", torch.bfloat16)
    tuning.tune_gpu_linears(model)
    layer = model["a"]
    for rows in (1, 3, 16, 100, 2048):
        name = layer.plan.entry_for(rows).kind.name
        assert name.startswith(("quantized", "dequantize", "Triton dequantize", "wgmma"))
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        want = quant_matmul_ref(x.float(), layer.qweight, layer.scales.float(),
                                layer.zeros.float(), 4, 32)  # fmt: skip
        torch.testing.assert_close(layer(x).float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_quantized_plans_round_trip_through_the_cache(tmp_path: Path) -> None:
    """The real kinds' descriptions name them again on the next start: the same plans,
    and nothing timed."""
    from models.plan_cache import PlanCache

    model = _quantized_model("cuda", torch.bfloat16)
    cache = PlanCache(tmp_path)
    plans, timings = tuning.plan_quantized_linears(model, cache=cache)
    assert timings and len(list(tmp_path.glob("*.json"))) == 2
    again, timings = tuning.plan_quantized_linears(model, cache=cache)
    assert timings == {} and again == plans


def _fp8_model(device: str, dtype: torch.dtype) -> nn.Module:
    """FP8 layers quantized at load from random 16-bit weights (dynamic activations)."""
    from asyncengine_kernels.fp8_linear import quantize_weight_per_channel
    from models.quantization.config import ONLINE_FP8
    from models.quantization.method import get_quant_method

    model = _three_layers(device, dtype, ONLINE_FP8, 128, 64)
    gen = torch.Generator().manual_seed(0)
    for layer in model.values():
        q, scale = quantize_weight_per_channel(torch.randn(layer.weight.shape, generator=gen))
        layer.weight.data.copy_(q.to(device))
        layer.weight_scale.data.copy_(scale.to(device) * 0.05)
        get_quant_method(ONLINE_FP8).process_weights_after_loading(layer)
    return model


def test_fp8_layers_are_planned_per_row_range_with_fused_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Timings favouring the whole-row GEMV at one row, the weight-only GEMV up to 8 rows,
    the first Triton GEMM tile of each step up to 64 and cuBLASLt past it (its steps of one
    candidate checked, not timed) give that plan; the W8A8 entries and the whole-row GEMV
    of a layer with an RMSNorm input form it themselves."""
    from models.quantization.fp8 import (
        Fp8DequantMatmul,
        Fp8Gemv,
        Fp8ScaledMM,
        Fp8TritonGemm,
        Fp8WholeRowGemv,
    )

    def fake_times(kinds, x, pairs, reps, low_rows=1, *, declared):  # type: ignore[no-untyped-def]
        assert x.dtype == torch.float32  # the layers' activation dtype, not the scales'
        rows = x.shape[0]
        gemms = [k for k in kinds if isinstance(k, Fp8TritonGemm)]

        def ms(kind: object) -> float:
            if isinstance(kind, Fp8WholeRowGemv):
                return 1.0
            if isinstance(kind, Fp8Gemv):
                return 1.5 if rows <= 8 else 9.0
            if isinstance(kind, Fp8TritonGemm):
                return 2.0 + (0.1 if kind != gemms[0] else 0.0)
            if isinstance(kind, Fp8ScaledMM):
                return 3.0 if rows <= 64 else 1.5
            return 50.0

        return {k.describe(): ms(k) for k in kinds}

    checked: list[int] = []

    def all_agree(kinds, pairs, x, low_rows):  # type: ignore[no-untyped-def]
        checked.append(x.shape[0])  # cuBLASLt's FP8 GEMM need not run on this CPU
        return list(kinds)

    monkeypatch.setattr(tuning, "_time_kinds", fake_times)
    monkeypatch.setattr(tuning, "_agreeing_kinds", all_agree)
    model = _fp8_model("cpu", torch.float32)
    assert isinstance(model["a"].plan.entries[0].kind, Fp8DequantMatmul)
    plans, timings = tuning.plan_quantized_linears(model, device_type="cpu")
    entries = plans[model["a"]].entries
    assert [e.max_rows for e in entries] == [1, 8, 16, 64, None]
    assert [type(e.kind) for e in entries] == [
        Fp8WholeRowGemv, Fp8Gemv, Fp8TritonGemm, Fp8TritonGemm, Fp8ScaledMM
    ]  # fmt: skip
    assert [e.kind.config.block_m for e in entries[2:4]] == [16, 64]
    normed = plans[model["c"]].entries
    assert all(e.input is InputTransform.RMS_NORM for e in normed)
    # The whole-row GEMV and the W8A8 GEMMs form the normed input themselves.
    assert [e.fuse_input for e in normed] == [True, False, True, True, True]
    assert set(timings) == {(64, 128), (96, 64)}
    assert set(timings[(64, 128)]) == {1, 2, 4, 8, 16, 64}
    assert sorted(set(checked)) == [256, 1024]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp8_layers_are_tuned_and_stay_correct() -> None:
    from asyncengine_kernels.fp8_linear import fp8_linear_ref
    from asyncengine_kernels.rms_norm import fused_add_rms_norm
    from models.layers import RMSNorm

    model = _fp8_model("cuda", torch.bfloat16)
    tuning.tune_gpu_linears(model)
    layer, normed = model["a"], model["c"]
    norm = RMSNorm(64, 1e-5).to("cuda", torch.bfloat16)
    for rows in (1, 3, 16, 100, 2048):
        assert layer.plan.entry_for(rows).kind.name.startswith("fp8")
        x = torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16)
        weight_only = rows <= 16 and "GEMV" in layer.plan.entry_for(rows).kind.name
        want = fp8_linear_ref(x, layer.qweight, layer.scales, quantize_input=not weight_only)
        torch.testing.assert_close(layer(x).float(), want.float(), atol=2e-2, rtol=2e-2)
        h, residual = torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16), None
        got, _ = normed.forward_normed(h, residual, norm)
        n = fused_add_rms_norm(h, torch.zeros_like(h), norm.weight, 1e-5)[0]
        weight_only = "GEMV" in normed.plan.entry_for(rows).kind.name
        want = fp8_linear_ref(n, normed.qweight, normed.scales, quantize_input=not weight_only)
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_fp8_kinds_are_timed_on_the_input_their_plan_forms() -> None:
    """An RMSNorm layer's kinds are timed on rms_norm(x + residual): formed by the W8A8
    kind's activation quantization, by a norm kernel before the reference; both compute
    the same product."""
    from asyncengine_kernels.fp8_linear import Fp8GemmConfig
    from models.quantization.fp8 import Fp8DequantMatmul, Fp8TritonGemm

    model = _fp8_model("cpu", torch.float32)
    layer = model["c"]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    call = tuning._declared_input(x, InputTransform.RMS_NORM)
    fused = call(Fp8TritonGemm(Fp8GemmConfig(16, 32, 32, 4, 1)), layer, None)
    unfused = call(Fp8DequantMatmul(), layer, None)
    torch.testing.assert_close(fused, unfused, atol=1e-4, rtol=1e-4)
    plain = tuning._declared_input(x, InputTransform.NONE)(Fp8DequantMatmul(), layer, None)
    assert not torch.allclose(plain, unfused)


@pytest.mark.parametrize("declared", list(InputTransform), ids=lambda t: t.value)
def test_time_cpu_kinds_times_every_kind_at_every_row_count(declared: InputTransform) -> None:
    """Real timings over two small weights: every kind this build runs, at every row count,
    with the layer's input transform (a [gate, up] input is twice as wide)."""
    kinds = [Blas(), *tuning.cpu_kinds()]
    weights = [torch.randn(40, 24), torch.randn(40, 24)]
    per_rows = tuning.time_cpu_kinds(weights, kinds, (1, 5), declared, reps=2)
    assert set(per_rows) == {1, 5}
    for times in per_rows.values():
        assert set(times) == {k.describe() for k in kinds}
        assert all(t > 0 for t in times.values())
