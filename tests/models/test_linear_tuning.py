"""Start-up choice of the matmul behind each linear layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models.linear_tuning as tuning
from kernels.cpu_linear import PACKED_MAX_ROWS, cpu_packing_available
from models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear


def _model() -> nn.Module:
    model = nn.ModuleDict({
        "up": ColumnParallelLinear(48, 96, bias=True),
        "down": RowParallelLinear(96, 48),
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
    timings = tuning.tune_cpu_linears(model)
    assert set(timings) == {(96, 48), (48, 96), (300, 48)}
    for name in ("up", "down", "head"):
        assert (model[name].cpu_packed is not None) == packed_wins
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
                                   atol=1e-5, rtol=1e-5)


def test_large_or_non_float32_weights_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "time_packed_against_blas", lambda w, packed: (100.0, 1.0))
    monkeypatch.setattr(tuning, "CPU_PACKED_MAX_BYTES", 48 * 96 * 4 - 1)
    model = _model()
    model["head"].to(torch.float16)
    tuning.tune_cpu_linears(model)
    assert model["up"].cpu_packed is None and model["down"].cpu_packed is None
    assert model["head"].cpu_packed is None


def test_gpu_tuning_ignores_cpu_layers() -> None:
    model = _model()
    assert tuning.tune_decode_gemvs(model) == {}
    assert all(m.gemv_config is None for m in (model["up"], model["down"]))
