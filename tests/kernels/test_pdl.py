"""Programmatic dependent launch: the switch, and (GPU) equal results with it on and off."""

from __future__ import annotations

import pytest
import torch

from kernels._triton_utils import pdl_kwargs, use_pdl
from kernels.activation import silu_and_mul
from kernels.gemv import GemvConfig, gemv_triton
from kernels.rms_norm import fused_add_rms_norm
from tests.kernels.kernel_cases import requires_cuda


def test_off_for_cpu_tensors_and_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not use_pdl(torch.zeros(1))
    assert pdl_kwargs(False) == {}
    assert pdl_kwargs(True) == {"launch_pdl": True}
    if torch.cuda.is_available():
        monkeypatch.setenv("ASYNCENGINE_PDL", "0")
        assert not use_pdl(torch.zeros(1, device="cuda"))


def _decoder_chain(x: torch.Tensor, res: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """A batch-1 MLP block as a decode step runs it: norm, gate/up GEMV, gated down GEMV."""
    norm_w, gate_up_w, down_w = ws
    h, res = fused_add_rms_norm(x, res, norm_w, 1e-5)
    gate_up = gemv_triton(h, gate_up_w, None, GemvConfig.tiled(8, 512, 4, 4))
    y = gemv_triton(gate_up, down_w, None, GemvConfig.tiled(8, 256, 4, 4), gated=True)
    return y + silu_and_mul(gate_up)[:, : y.shape[1]] + res


@pytest.mark.gpu
@requires_cuda
def test_gpu_graph_with_pdl_equals_without(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter = 4096, 11008
    x, res = (torch.randn(1, hidden, device="cuda", generator=gen).bfloat16() for _ in range(2))
    ws = [
        torch.randn(hidden, device="cuda", generator=gen).bfloat16(),
        (torch.randn(2 * inter, hidden, device="cuda", generator=gen) / 64).bfloat16(),
        (torch.randn(hidden, inter, device="cuda", generator=gen) / 100).bfloat16(),
    ]
    results = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("ASYNCENGINE_PDL", flag)
        assert use_pdl(x) == (flag == "1" and torch.cuda.get_device_capability()[0] >= 9)
        _decoder_chain(x, res, ws)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = x
            for _ in range(8):  # chained, so every kernel reads its predecessor's output
                out = _decoder_chain(out, res, ws) / 64
        graph.replay()
        torch.cuda.synchronize()
        results[flag] = out.clone()
    assert torch.isfinite(results["1"]).all()
    assert torch.equal(results["0"], results["1"])
