"""The small-batch CPU GEMM (asyncengine_kernels/cpu_gemm.py) against F.linear and the torch
references of the input transforms it forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncengine_kernels.activation import silu_and_mul_ref
from asyncengine_kernels.cpu_gemm import (
    gemm_available,
    gemm_linear,
    gemm_linear_gated,
    gemm_linear_normed,
    load_cpu_gemm,
    pack_gemm_weight,
)
from asyncengine_kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref

pytestmark = pytest.mark.skipif(not gemm_available(), reason="no C compiler to build it")

# Row counts across the kernel's row tiles and their remainders; shapes with a partial last
# panel and odd K.
ROWS = [1, 2, 5, 6, 7, 13, 32, 64]
SHAPES = [(200, 96), (64, 64), (5, 17), (1000, 33)]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = gemm_linear(x, pack_gemm_weight(w), n, b)
    assert got.shape == (rows, n) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_packed_layout_is_panels_of_the_weight() -> None:
    lib = load_cpu_gemm()
    assert lib is not None
    nr = lib.panel_width
    w = torch.randn(nr + 3, 10)
    packed = pack_gemm_weight(w)
    assert packed.shape == (2, 10, nr)
    torch.testing.assert_close(packed[0], w[:nr].t(), atol=0, rtol=0)
    torch.testing.assert_close(packed[1, :, :3], w[nr:].t(), atol=0, rtol=0)
    assert not packed[1, :, 3:].any()  # zero past N


def test_strided_and_non_contiguous_inputs() -> None:
    w = torch.randn(70, 48)
    packed = pack_gemm_weight(w)
    wide = torch.randn(9, 80)
    rows_view = wide[:, 16:64]  # row stride 80, unit stride within a row: read in place
    torch.testing.assert_close(gemm_linear(rows_view, packed, 70), F.linear(rows_view, w),
                               atol=1e-4, rtol=1e-5)  # fmt: skip
    transposed = torch.randn(48, 9).t()
    torch.testing.assert_close(gemm_linear(transposed, packed, 70), F.linear(transposed, w),
                               atol=1e-4, rtol=1e-5)  # fmt: skip


def test_strided_bias_and_norm_weight() -> None:
    """A bias or norm weight that is a strided view is copied, and the copy outlives the C
    call (a temporary made in the argument list would be freed before the kernel reads it)."""
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(30, 40, generator=gen), torch.randn(3, 40, generator=gen)
    packed = pack_gemm_weight(w)
    bias = torch.randn(60, generator=gen)[::2]
    norm_w = torch.randn(80, generator=gen)[::2]
    assert not bias.is_contiguous() and not norm_w.is_contiguous()
    torch.testing.assert_close(gemm_linear(x, packed, 30, bias), F.linear(x, w, bias),
                               atol=1e-4, rtol=1e-5)  # fmt: skip
    y, _ = gemm_linear_normed(x, None, norm_w, 1e-5, packed, 30, bias)
    torch.testing.assert_close(y, F.linear(rms_norm_ref(x, norm_w, 1e-5), w, bias), atol=1e-4,
                               rtol=1e-5)  # fmt: skip


def test_rejects_other_dtypes() -> None:
    packed = pack_gemm_weight(torch.randn(8, 8))
    with pytest.raises(TypeError):
        gemm_linear(torch.randn(2, 8, dtype=torch.float64), packed, 8)


@pytest.mark.parametrize("rows", [1, 7, 32])
@pytest.mark.parametrize("k", [48, 37])  # a multiple of the vector width, and a tail
def test_gated_input_equals_silu_and_mul_then_linear(rows: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows + k)
    gate_up = torch.randn(rows, 2 * k, generator=gen) * 4  # past the exp's easy range
    gate_up[0, 0], gate_up[0, 1] = -100.0, 100.0  # exp under- and overflow
    w = torch.randn(50, k, generator=gen)
    b = torch.randn(50, generator=gen)
    got = gemm_linear_gated(gate_up, pack_gemm_weight(w), 50, b)
    torch.testing.assert_close(got, F.linear(silu_and_mul_ref(gate_up), w, b),
                               atol=1e-4, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("rows", [1, 7, 32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_normed_input_equals_rms_norm_then_linear(rows: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    k, n = 40, 30
    x = torch.randn(rows, k, generator=gen)
    residual = torch.randn(rows, k, generator=gen) if with_residual else None
    norm_w = torch.randn(k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    y, new_residual = gemm_linear_normed(x, residual, norm_w, 1e-5, pack_gemm_weight(w), n)
    if residual is None:
        h, want_residual = rms_norm_ref(x, norm_w, 1e-5), x
    else:
        h, want_residual = fused_add_rms_norm_ref(x, residual, norm_w, 1e-5)
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(y, F.linear(h, w), atol=1e-4, rtol=1e-5)
