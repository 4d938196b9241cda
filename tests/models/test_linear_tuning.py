"""Start-up choice of the matmul behind each linear layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models.linear_tuning as tuning
from kernels.cpu_linear import PACKED_MAX_ROWS, cpu_packing_available
from models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from models.matmul_plan import Blas, CpuPacked, InputTransform, MatmulPlan


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


@pytest.mark.skipif(not cpu_packing_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("packed_wins", [True, False])
def test_cpu_layers_take_the_faster_path_and_stay_exact(
    monkeypatch: pytest.MonkeyPatch, packed_wins: bool
) -> None:
    fake = (100.0, 50.0) if packed_wins else (100.0, 95.0)  # 95: inside the noise margin
    monkeypatch.setattr(tuning, "time_packed_against_blas", lambda w, packed: fake)
    model = _model()
    plans, timings = tuning.plan_cpu_linears(model)
    assert set(timings) == {(96, 48), (48, 96), (48, 48), (300, 48)}
    assert set(plans) == set(model.values())
    assert all(m.plan == MatmulPlan.default(m.input_transform) for m in model.values())
    assert tuning.tune_cpu_linears(model) == timings  # the fake timings: the same plans
    for name, m in model.items():
        assert m.plan == plans[m], name
        small, large = m.plan.entry_for(PACKED_MAX_ROWS), m.plan.entry_for(PACKED_MAX_ROWS + 1)
        assert small.kind == (CpuPacked() if packed_wins else Blas()) and large.kind == Blas()
        assert small.input is large.input is m.input_transform
        assert (getattr(m, "packed_weight", None) is not None) == packed_wins
    for rows in (1, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1):  # packed, packed, BLAS
        x = torch.randn(rows, 48)
        up = model["up"]
        torch.testing.assert_close(up(x), F.linear(x, up.weight, up.bias), atol=1e-5, rtol=1e-5)
        head = model["head"]
        torch.testing.assert_close(
            head.compute_logits(x), F.linear(x, head.weight)[:, :300], atol=1e-5, rtol=1e-5
        )
        h = torch.randn(rows, 96)
        torch.testing.assert_close(model["down"](h), F.linear(h, model["down"].weight),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
        gated = model["gated"]
        torch.testing.assert_close(gated(h), F.linear(F.silu(h[:, :48]) * h[:, 48:],
                                   gated.weight), atol=1e-5, rtol=1e-5)  # fmt: skip


def test_large_or_non_float32_weights_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "time_packed_against_blas", lambda w, packed: (100.0, 1.0))
    monkeypatch.setattr(tuning, "CPU_PACKED_MAX_BYTES", 48 * 96 * 4 - 1)
    model = _model()
    model["head"].to(torch.float16)
    model["gated"].to(torch.float16)
    plans, _ = tuning.plan_cpu_linears(model)
    assert set(plans) == set()
    tuning.tune_cpu_linears(model)
    assert all(m.plan == MatmulPlan.default(m.input_transform) for m in model.values())


def test_gpu_tuning_ignores_cpu_layers() -> None:
    model = _model()
    assert tuning.plan_decode_gemvs(model) == ({}, {})
    assert tuning.tune_decode_gemvs(model) == {}
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
