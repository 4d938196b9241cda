"""Pinned upload buffers: what arrives on the device is what was staged, whatever the reuse."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncengine.host_staging import MIN_STAGING_BYTES, PinnedStaging


def test_off_the_gpu_the_host_array_serves() -> None:
    staging = PinnedStaging(torch.device("cpu"))
    flat = np.arange(10, dtype=np.uint8)
    out = staging.to_device(flat)
    assert out.device.type == "cpu" and out.tolist() == list(range(10))
    dst = torch.zeros(10, dtype=torch.uint8)
    assert staging.to_device(flat, dst) is dst and dst.tolist() == list(range(10))


def test_turns_must_be_positive() -> None:
    with pytest.raises(ValueError, match="turns"):
        PinnedStaging(torch.device("cpu"), turns=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("turns", [1, 2, 4])
def test_gpu_every_upload_arrives_intact_while_buffers_are_reused(turns: int) -> None:
    """More uploads than buffers, queued behind device work and never waited for by the
    caller: each one's contents arrive as staged, a larger one re-pins its buffer."""
    device = torch.device("cuda")
    staging = PinnedStaging(device, turns=turns)
    busy = torch.randn(2048, 2048, device=device)
    sizes = [64, 4096, MIN_STAGING_BYTES + 1000, 128, 64, 4096, 777, 4096]
    sent, got = [], []
    rng = np.random.default_rng(0)
    for i, n in enumerate(sizes):
        busy = busy @ busy.T / 2048  # keeps the stream busy ahead of the copies
        flat = rng.integers(0, 256, n, dtype=np.uint8)
        sent.append(flat.copy())
        if i % 2:
            dst = torch.empty(n, dtype=torch.uint8, device=device)
            got.append(staging.to_device(flat, dst))
        else:
            got.append(staging.to_device(flat))
        flat[:] = 0  # the caller may reuse its array at once
    torch.cuda.synchronize()
    for want, out in zip(sent, got, strict=True):
        assert np.array_equal(out.cpu().numpy(), want)
    staging.release()
