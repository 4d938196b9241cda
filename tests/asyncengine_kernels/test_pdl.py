"""Programmatic dependent launch: where it applies, and (GPU) equal results with it on and off."""

from __future__ import annotations

import pytest
import torch

from asyncengine_kernels._triton_utils import pdl_kwargs, use_pdl
from asyncengine_kernels.paged_attention import paged_attention_triton
from asyncengine_kernels.rms_norm import fused_add_rms_norm
from tests.asyncengine_kernels.kernel_cases import PagedBatch, make_paged_batch, requires_cuda


def test_off_for_cpu_tensors() -> None:
    assert not use_pdl(torch.zeros(1))
    assert pdl_kwargs(False) == {}
    assert pdl_kwargs(True) == {"launch_pdl": True}


@pytest.mark.gpu
@requires_cuda
def test_gpu_on_from_hopper() -> None:
    x = torch.zeros(1, device="cuda")
    assert use_pdl(x) == (torch.cuda.get_device_capability()[0] >= 9)


@pytest.mark.gpu
@requires_cuda
def test_gpu_off_when_the_environment_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCENGINE_NO_PDL", "1")
    assert not use_pdl(torch.zeros(1, device="cuda"))


def _decode_chain(
    x: torch.Tensor, res: torch.Tensor, norm_w: torch.Tensor, batch: PagedBatch, pdl: bool
) -> torch.Tensor:
    """A decode step's attention block: norm, then split-KV attention (and its reduce) on the
    normed rows as queries, the attention output feeding the next norm."""
    h, res = fused_add_rms_norm(x, res, norm_w, 1e-5)
    q = h.view(batch.q.shape)
    out = paged_attention_triton(q, *batch.args()[1:], decode_only=True, num_segments=4, pdl=pdl)
    return out.view(x.shape) + res


@pytest.mark.gpu
@requires_cuda
def test_gpu_graph_with_pdl_equals_without() -> None:
    """Chained kernels, each reading its predecessor's output, captured in one graph: the
    attention kernels launched with PDL give the same bits as launched without."""
    batch = make_paged_batch(
        [1] * 4, [700, 33, 1, 300], 32, 8, head_dim=128, block_size=16,
        dtype=torch.bfloat16, device="cuda", seed=5,
    )  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (batch.q.shape[0], batch.q.shape[1] * batch.q.shape[2])
    x, res = (torch.randn(shape, device="cuda", generator=gen).bfloat16() for _ in range(2))
    norm_w = torch.randn(shape[1], device="cuda", generator=gen).bfloat16()
    results = {}
    for pdl in (False, True):
        _decode_chain(x, res.clone(), norm_w, batch, pdl)  # compile outside the capture
        res_step = res.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = x
            for _ in range(8):
                out = _decode_chain(out, res_step, norm_w, batch, pdl) / 64
        graph.replay()
        torch.cuda.synchronize()
        results[pdl] = out.clone()
    assert torch.isfinite(results[True]).all()
    assert torch.equal(results[False], results[True])
