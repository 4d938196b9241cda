"""Matmul plans: every kind, input transform and epilogue against F.linear on the CPU (the
Triton GEMV in the interpreter), and the checks a plan must pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncengine_kernels.activation import silu_and_mul_ref
from asyncengine_kernels.cpu_gemm import gemm_available
from asyncengine_kernels.cpu_linear import PACKED_MAX_ROWS, cpu_packing_available
from asyncengine_kernels.gemv import GemvConfig, TiledGemvConfig, WholeRowGemvConfig
from asyncengine_kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from asyncengine_kernels.skinny_gemm import SkinnyConfig
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
    MatmulKind,
    MatmulPlan,
    PlanEntry,
    TritonGemv,
    TritonSkinnyGemm,
)

NONE, NORM, GATED = InputTransform.NONE, InputTransform.RMS_NORM, InputTransform.SILU_AND_MUL
GLU = Epilogue.SILU_AND_MUL
TILED, WHOLE_ROW = TiledGemvConfig(8, 16, 4, 1), WholeRowGemvConfig(4, 4, 1, 2)
# Two K splits at K = 32: the split-K sums are exercised too.
SKINNY = TritonSkinnyGemm(SkinnyConfig(32, 16, 2, 4, 1))
needs_onednn = pytest.mark.skipif(not cpu_packing_available(), reason="no oneDNN")


def _kinds() -> list[tuple[MatmulKind, int | None]]:
    """Every kind with the most rows its entry serves in these tests."""
    kinds: list[tuple[MatmulKind, int | None]] = [
        (Blas(), None), (TritonGemv(TILED), 1), (TritonGemv(WHOLE_ROW), 1), (SKINNY, 16),
    ]  # fmt: skip
    if cpu_packing_available():
        kinds.append((CpuPacked(), PACKED_MAX_ROWS))
    if gemm_available():
        kinds.append((CpuGemm(), 64))
    return kinds


KINDS = _kinds()
KIND_IDS = [kind.describe() for kind, _ in KINDS]


def _plan(kind: MatmulKind, rows: int | None, input: InputTransform, fuse: bool = False,
          epilogue: Epilogue = Epilogue.NONE, declared: InputTransform | None = None
          ) -> MatmulPlan:  # fmt: skip
    """`kind` for up to `rows` rows, then BLAS with the declared input."""
    entry = PlanEntry(kind, rows, input, fuse, epilogue)
    if rows is None:
        return MatmulPlan((entry,))
    return MatmulPlan((entry, PlanEntry(Blas(), input=input if declared is None else declared)))


def _init(*layers: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    for layer in layers:
        for p in layer.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _fusable(kind: MatmulKind, transform: InputTransform) -> list[bool]:
    return [False, True] if transform in kind.fusable_inputs else [False]


@pytest.mark.parametrize("kind,max_rows", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("bias", [False, True])
def test_plain_input_equals_f_linear(kind: MatmulKind, max_rows: int | None, bias: bool) -> None:
    layer = ColumnParallelLinear(32, 24, bias=bias)
    _init(layer)
    layer.set_plan(_plan(kind, max_rows, NONE))
    for rows in (1, 3):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("kind,max_rows", KINDS, ids=KIND_IDS)
def test_gated_input_equals_silu_and_mul_then_f_linear(
    kind: MatmulKind, max_rows: int | None
) -> None:
    """A [gate, up] input, with the activation as its own kernel or in the prologue."""
    layer = RowParallelLinear(32, 24, input_transform=GATED)
    _init(layer)
    for fuse in _fusable(kind, GATED):
        layer.set_plan(_plan(kind, max_rows, GATED, fuse))
        for rows in (1, 3):
            gate_up = torch.randn(rows, 64)
            want = F.linear(silu_and_mul_ref(gate_up), layer.weight)
            torch.testing.assert_close(layer(gate_up), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,max_rows", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_normed_input_equals_norm_then_f_linear(
    kind: MatmulKind, max_rows: int | None, with_residual: bool
) -> None:
    layer = ColumnParallelLinear(32, 24, bias=True, input_transform=NORM)
    norm = RMSNorm(32, 1e-5)
    _init(layer, norm)
    for fuse in _fusable(kind, NORM):
        layer.set_plan(_plan(kind, max_rows, NORM, fuse))
        for rows in (1, 3):
            x = torch.randn(rows, 32)
            residual = torch.randn(rows, 32) if with_residual else None
            if residual is None:
                h, want_residual = rms_norm_ref(x, norm.weight, 1e-5), x
            else:
                h, want_residual = fused_add_rms_norm_ref(x, residual, norm.weight, 1e-5)
            y, new_residual = layer.forward_normed(x, residual, norm)
            torch.testing.assert_close(new_residual, want_residual, atol=1e-6, rtol=1e-6)
            want = F.linear(h, layer.weight, layer.bias)
            torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", [TILED, WHOLE_ROW], ids=str)
@pytest.mark.parametrize("normed", [False, True])
def test_glu_epilogue_feeds_a_plain_input_down_projection(config: GemvConfig, normed: bool) -> None:
    """The MLP pair as the tuner plans it: the gate/up GEMV applies SiLU-and-mul in its
    epilogue and the down projection's batch-1 entry takes that activated input; larger
    batches keep [gate, up] and the down projection activates it."""
    declared = NORM if normed else NONE
    gate_up = MergedColumnParallelLinear(16, [32, 32], input_transform=declared, glu_output=True)
    down = RowParallelLinear(32, 24, input_transform=GATED)
    norm = RMSNorm(16, 1e-5)
    _init(gate_up, down, norm)
    gemv = TritonGemv(config)
    gate_up.set_plan(_plan(gemv, 1, declared, fuse=normed, epilogue=GLU))
    down.set_plan(_plan(gemv, 1, NONE, declared=GATED))
    for rows in (1, 3):
        x = torch.randn(rows, 16)
        h = rms_norm_ref(x, norm.weight, 1e-5) if normed else x
        want = F.linear(silu_and_mul_ref(F.linear(h, gate_up.weight)), down.weight)
        mid = gate_up.forward_normed(x, None, norm)[0] if normed else gate_up(x)
        assert mid.shape == (rows, 32 if rows == 1 else 64)
        torch.testing.assert_close(down(mid), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("normed", [False, True])
def test_skinny_glu_epilogue_feeds_a_plain_input_down_projection(normed: bool) -> None:
    """The MLP pair for 2-16 rows: the gate/up matmul applies SiLU-and-mul in its epilogue
    and the down projection takes that activated input; one row and more than 16 rows keep
    [gate, up] and the down projection activates it."""
    declared = NORM if normed else NONE
    gate_up = MergedColumnParallelLinear(16, [32, 32], input_transform=declared, glu_output=True)
    down = RowParallelLinear(32, 24, input_transform=GATED)
    norm = RMSNorm(16, 1e-5)
    _init(gate_up, down, norm)
    gate_up.set_plan(MatmulPlan((
        PlanEntry(Blas(), 1, declared), PlanEntry(SKINNY, 16, declared, epilogue=GLU),
        PlanEntry(Blas(), input=declared),
    )))  # fmt: skip
    down.set_plan(MatmulPlan((
        PlanEntry(Blas(), 1, GATED), PlanEntry(SKINNY, 16, NONE), PlanEntry(Blas(), input=GATED),
    )))  # fmt: skip
    for rows in (1, 2, 16, 17):
        x = torch.randn(rows, 16)
        h = rms_norm_ref(x, norm.weight, 1e-5) if normed else x
        want = F.linear(silu_and_mul_ref(F.linear(h, gate_up.weight)), down.weight)
        mid = gate_up.forward_normed(x, None, norm)[0] if normed else gate_up(x)
        assert mid.shape == (rows, 32 if 2 <= rows <= 16 else 64)
        torch.testing.assert_close(down(mid), want, atol=1e-5, rtol=1e-5)


def test_skinny_kind_keeps_its_counters_on_the_layer_while_planned() -> None:
    layer = RowParallelLinear(64, 96)
    _init(layer)
    layer.set_plan(_plan(SKINNY, 16, NONE))
    counters = layer.skinny_counters
    assert counters is not None and not counters.any()
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
    assert layer.skinny_counters is counters and not counters.any()
    layer.set_plan(MatmulPlan.default())
    assert layer.skinny_counters is None


@needs_onednn
def test_lm_head_takes_a_packed_plan_and_drops_the_copy_after() -> None:
    head = ParallelLMHead(300, 48)
    _init(head)
    head.set_plan(_plan(CpuPacked(), PACKED_MAX_ROWS, NONE))
    assert head.packed_weight is not None
    for rows in (1, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1):  # packed, packed, BLAS
        x = torch.randn(rows, 48)
        torch.testing.assert_close(head.compute_logits(x), F.linear(x, head.weight)[:, :300],
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
    head.set_plan(MatmulPlan.default())
    assert head.packed_weight is None


def test_the_row_count_picks_the_entry() -> None:
    plan = MatmulPlan((
        PlanEntry(TritonGemv(TILED), 1), PlanEntry(CpuPacked(), 64), PlanEntry(Blas()),
    ))  # fmt: skip
    assert [type(plan.entry_for(r).kind) for r in (1, 2, 64, 65)] == [
        TritonGemv, CpuPacked, CpuPacked, Blas
    ]  # fmt: skip
    assert plan.describe() == (
        "1 row: Triton GEMV tiled[8, 16, 4, 1]; 2-64 rows: oneDNN-packed; 65+ rows: BLAS"
    )
    assert MatmulPlan.default(GATED).describe() == "1+ rows: BLAS, silu_and_mul before it"
    few = MatmulPlan((PlanEntry(Blas(), 1, GATED), PlanEntry(SKINNY, 16, GATED, True),
                      PlanEntry(Blas(), input=GATED)))  # fmt: skip
    assert few.describe() == (
        "1 row: BLAS, silu_and_mul before it; 2-16 rows: Triton skinny GEMM "
        "skinny[32, 16, 2, 4, 1], silu_and_mul in its prologue; 17+ rows: BLAS, silu_and_mul "
        "before it"
    )


def test_entries_check_what_their_kind_can_do() -> None:
    with pytest.raises(ValueError, match="at most 1 rows"):
        PlanEntry(TritonGemv(TILED), 2)
    with pytest.raises(ValueError, match="at most 1 rows"):
        PlanEntry(TritonGemv(TILED))
    with pytest.raises(ValueError, match="cannot apply rms_norm"):
        PlanEntry(Blas(), input=NORM, fuse_input=True)
    with pytest.raises(ValueError, match="at most 16 rows"):
        PlanEntry(SKINNY, 17)
    with pytest.raises(ValueError, match="cannot apply rms_norm"):  # the norm kernel first
        PlanEntry(SKINNY, 16, input=NORM, fuse_input=True)
    with pytest.raises(ValueError, match="cannot apply rms_norm"):
        PlanEntry(CpuPacked(), 16, input=NORM, fuse_input=True)
    with pytest.raises(ValueError, match="no silu_and_mul epilogue"):
        PlanEntry(CpuPacked(), 64, epilogue=GLU)
    with pytest.raises(ValueError, match="any number of rows"):
        MatmulPlan((PlanEntry(CpuPacked(), 64),))
    with pytest.raises(ValueError, match="increasing max_rows"):
        MatmulPlan((
            PlanEntry(CpuPacked(), 64), PlanEntry(TritonGemv(TILED), 1), PlanEntry(Blas()),
        ))  # fmt: skip


def test_a_layer_refuses_a_plan_for_another_input_or_output() -> None:
    plain = ColumnParallelLinear(16, 8)
    with pytest.raises(ValueError, match="rms_norm input"):
        plain.set_plan(MatmulPlan.default(NORM))
    with pytest.raises(ValueError, match=r"\[gate; up\] output"):
        plain.set_plan(_plan(TritonGemv(TILED), 1, NONE, epilogue=GLU))
    normed = ColumnParallelLinear(16, 8, input_transform=NORM)
    with pytest.raises(ValueError, match="normed input runs through apply_normed"):
        normed(torch.randn(1, 16))
    gated = RowParallelLinear(16, 8, input_transform=GATED)
    gated.set_plan(_plan(Blas(), 1, NONE, declared=GATED))  # activated by its producer
    with pytest.raises(ValueError, match="layer's input is silu_and_mul"):
        gated.set_plan(MatmulPlan.default(NORM))


def test_a_held_kind_is_not_processed_again_when_the_plan_changes() -> None:
    """Tuning sets plans in turn: a kind both plans hold keeps what it built (no repacking),
    a kind new to the layer builds, a kind dropped releases."""
    from dataclasses import dataclass
    from typing import ClassVar

    calls: list[tuple[str, str]] = []

    class Recording(Blas):
        label: ClassVar[str]

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            calls.append(("process", self.label))

        def release(self, layer: torch.nn.Module) -> None:
            calls.append(("release", self.label))

    @dataclass(frozen=True)
    class A(Recording):
        label: ClassVar[str] = "a"

    @dataclass(frozen=True)
    class B(Recording):
        label: ClassVar[str] = "b"

    layer = ColumnParallelLinear(8, 8, bias=False)
    a, b = A(), B()
    layer.set_plan(MatmulPlan((PlanEntry(a, 4), PlanEntry(Blas()))))
    layer.set_plan(MatmulPlan((PlanEntry(a, 2), PlanEntry(b, 4), PlanEntry(Blas()))))
    layer.set_plan(MatmulPlan((PlanEntry(b, 4), PlanEntry(Blas()))))
    assert calls == [("process", "a"), ("process", "b"), ("release", "a")]
