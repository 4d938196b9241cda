"""oneDNN-packed CPU linear against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncengine_kernels.cpu_linear import cpu_packing_available, pack_weight, packed_linear

pytestmark = pytest.mark.skipif(not cpu_packing_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 7, 32])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(200, 96, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    got = packed_linear(x, pack_weight(w), b)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert got.layout == torch.strided and got.shape == (rows, 200)


def test_non_contiguous_input() -> None:
    x = torch.randn(16, 64).t()  # [64, 16] view with strides (1, 64)
    w = torch.randn(8, 16)
    torch.testing.assert_close(packed_linear(x, pack_weight(w)), F.linear(x, w))


@pytest.mark.parametrize("rows", [1, 8, 40])
def test_dense_io_path_equals_the_converting_one(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dense-in, dense-out oneDNN op is the same product as converting the activations."""
    import asyncengine_kernels.cpu_linear as cpu_linear

    if not cpu_linear._has_dense_io_linear():
        pytest.skip("this torch build has no dense-IO oneDNN linear")
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(300, 96, generator=gen)
    b = torch.randn(300, generator=gen)
    packed = pack_weight(w)
    outs = []
    for dense_io in (True, False):
        monkeypatch.setattr(cpu_linear, "_DENSE_IO", dense_io)
        outs.append(packed_linear(x, packed, b))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
