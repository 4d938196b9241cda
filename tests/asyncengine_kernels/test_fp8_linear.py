"""The FP8 kernels against their torch references: per-token activation quantization (plain,
static scale, fused SiLU-and-mul, fused residual add + RMSNorm), the W8A8 Triton GEMM and
cuBLASLt `_scaled_mm`, and the weight-only GEMV; in the interpreter on small shapes, and on
the GPU at Llama-2-7B / Llama-3-8B shapes."""

from __future__ import annotations

import pytest
import torch

from asyncengine_kernels.activation import silu_and_mul_ref
from asyncengine_kernels.fp8_linear import (
    FP8_DTYPE,
    FP8_E4M3_MAX,
    FP8_GEMV_MIN_BLOCK_N,
    Fp8GemmConfig,
    Fp8GemvConfig,
    dequantize_fp8,
    fp8_gemm,
    fp8_gemm_candidates,
    fp8_gemv,
    fp8_gemv_candidates,
    fp8_linear_ref,
    fp8_scaled_mm,
    quantize_rows,
    quantize_rows_ref,
    quantize_weight_per_channel,
)
from asyncengine_kernels.gemv_split_k import gemv_counters
from asyncengine_kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# (N, K): Llama-2-7B and Llama-3-8B: qkv, o, gate_up, down.
LLAMA_SHAPES = [(12288, 4096), (6144, 4096), (4096, 4096), (22016, 4096), (28672, 4096),
                (4096, 11008), (4096, 14336)]  # fmt: skip


def _weight(n: int, k: int, device: str = "cpu", seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    q, scale = quantize_weight_per_channel(w)
    return w.to(device), q.to(device), scale.view(-1).to(device)


def test_weight_quantization_is_per_row_and_saturates_at_448() -> None:
    w, q, scale = _weight(24, 40)
    assert q.dtype == FP8_DTYPE and scale.shape == (24,)
    assert torch.equal(q.float().abs().amax(1), torch.full((24,), FP8_E4M3_MAX))
    rel = (dequantize_fp8(q, scale.view(-1, 1)) - w).abs() / w.abs().amax(1, keepdim=True)
    assert float(rel.max()) <= 2.0**-4  # half of e4m3's largest relative step


def test_rounding_matches_torch_at_ties_and_binade_carries() -> None:
    """Values just below a power of two round up into the next binade, ties go to even, and
    e4m3 subnormals round on their fixed grid, as torch's conversion does."""
    vals = torch.tensor([124.3, -126.9, 31.4, 1.0625, 17.0, 100.0, 1.1875, 0.0097, -0.004,
                         447.9, 0.0, 3.0e-4, 240.0, 0.01562])  # fmt: skip
    x = torch.cat([vals, torch.full((1,), 448.0)]).view(1, -1)  # amax 448: scale 1
    got, scale, _ = quantize_rows(x)
    want, want_scale = quantize_rows_ref(x)
    assert float(scale) == float(want_scale) == 1.0
    assert torch.equal(got.float(), want.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_token_quantization_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 96, generator=gen) * torch.rand(7, 1, generator=gen) * 5).to(dtype)
    x[3] = 0  # a row of zeros keeps a positive scale and quantizes to zeros
    q, s, res = quantize_rows(x)
    want_q, want_s = quantize_rows_ref(x)
    assert res is None and q.dtype == FP8_DTYPE and s.shape == (7, 1)
    torch.testing.assert_close(s, want_s)
    assert torch.equal(q.float(), want_q.float()) and float(s[3]) > 0
    static = torch.tensor(0.02)
    q, s, _ = quantize_rows(x, static)
    want_q, want_s = quantize_rows_ref(x, static)
    assert torch.equal(q.float(), want_q.float()) and torch.equal(s, want_s)
    assert float(q.float().abs().max()) == FP8_E4M3_MAX  # static scales saturate, never overflow


def test_fused_input_transforms_quantize_what_the_separate_kernels_produce() -> None:
    gen = torch.Generator().manual_seed(2)
    x, residual = torch.randn(5, 80, generator=gen), torch.randn(5, 80, generator=gen)
    norm_w = torch.rand(80, generator=gen) + 0.5
    gated = torch.randn(5, 160, generator=gen)
    q, s, _ = quantize_rows(gated, gated=True)
    want_q, want_s = quantize_rows_ref(silu_and_mul_ref(gated))
    torch.testing.assert_close(s, want_s)
    assert (q.float() != want_q.float()).float().mean() < 0.01  # ties of fp32 rounding only
    q, s, new_res = quantize_rows(x, norm=(norm_w, 1e-5), residual=residual)
    h, want_res = fused_add_rms_norm_ref(x, residual, norm_w, 1e-5)
    want_q, want_s = quantize_rows_ref(h)
    torch.testing.assert_close(new_res, want_res)
    torch.testing.assert_close(s, want_s)
    torch.testing.assert_close(dequantize_fp8(q, s), dequantize_fp8(want_q, want_s),
                               atol=0, rtol=2.0**-3)  # fmt: skip
    q, s, none = quantize_rows(x, norm=(norm_w, 1e-5))
    want_q, _ = quantize_rows_ref(rms_norm_ref(x, norm_w, 1e-5))
    assert none is None and (q.float() != want_q.float()).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(48, 80), (64, 128), (40, 72)])
def test_w8a8_gemm_matches_reference(dtype: torch.dtype, n: int, k: int) -> None:
    _, q, scale = _weight(n, k)
    bias = torch.randn(n).to(dtype)
    for rows in (1, 5, 33):
        x = torch.randn(rows, k).to(dtype)
        xq, xs, _ = quantize_rows(x)
        want = fp8_linear_ref(x, q, scale, bias)
        for cfg in (Fp8GemmConfig(16, 32, 32, 4, 1), Fp8GemmConfig(32, 16, 64, 4, 1, group_m=2)):
            got = fp8_gemm(xq, xs, q, scale, bias, dtype, cfg)
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_scaled_mm_matches_reference_and_refuses_unaligned_shapes() -> None:
    _, q, scale = _weight(48, 64)
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    xq, xs = quantize_rows_ref(x)
    try:
        got = fp8_scaled_mm(xq, xs, q, scale, None, torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:  # a torch build without CPU fp8 GEMM
        pytest.skip(f"torch._scaled_mm does not run on this CPU: {e}")
    want = fp8_linear_ref(x, q, scale)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    _, q, scale = _weight(40, 72)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_scaled_mm(quantize_rows_ref(torch.randn(2, 72))[0], torch.ones(2, 1), q, scale,
                      None, torch.bfloat16)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_is_the_weight_only_product(dtype: torch.dtype) -> None:
    _, q, scale = _weight(72, 200)
    bias = torch.randn(72).to(dtype)
    for rows in (1, 2, 3, 16):
        x = torch.randn(rows, 200).to(dtype)
        want = fp8_linear_ref(x, q, scale, bias, quantize_input=False)
        for cfg in (Fp8GemvConfig(8, 64), Fp8GemvConfig(16, 32, split_k=2),
                    Fp8GemvConfig(4, 128, split_k=3)):  # fmt: skip
            torch.testing.assert_close(fp8_gemv(x, q, scale, bias, cfg), want,
                                       atol=1e-3, rtol=1e-3)  # fmt: skip
    with pytest.raises(ValueError, match="at most 16 rows"):
        fp8_gemv(torch.randn(17, 200).to(dtype), q, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_forms_a_gated_input_as_silu_and_mul_rounds_it(dtype: torch.dtype) -> None:
    _, q, scale = _weight(40, 96)
    for rows in (1, 5):
        gated = torch.randn(rows, 192).to(dtype)
        want = fp8_linear_ref(silu_and_mul_ref(gated), q, scale, quantize_input=False)
        for cfg in (Fp8GemvConfig(8, 32), Fp8GemvConfig(16, 64, split_k=2)):
            got = fp8_gemv(gated, q, scale, None, cfg, gated=True)
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_row_gemv_splits_add_up_in_the_kernel_with_counters() -> None:
    """One row's K splits summed by the last split of each block (bias once, a gated input,
    a K that leaves a partial tile); the counters are left zeroed for the next call, and
    too few of them are refused."""
    _, q, scale = _weight(40, 200)
    counters = gemv_counters(1, 40, "cpu", FP8_GEMV_MIN_BLOCK_N)
    x = torch.randn(1, 200).to(torch.bfloat16)
    bias = torch.randn(40).to(torch.bfloat16)
    want = fp8_linear_ref(x, q, scale, bias, quantize_input=False).float()
    for cfg in (Fp8GemvConfig(8, 32, split_k=4), Fp8GemvConfig(4, 64, split_k=2),
                Fp8GemvConfig(16, 32, split_k=8)):  # fmt: skip
        got = fp8_gemv(x, q, scale, bias, cfg, counters=counters).float()
        _assert_bf16_close(got, want)
        assert not counters.any()
    cfg = Fp8GemvConfig(8, 32, split_k=4)
    gated = torch.randn(1, 400).to(torch.bfloat16)
    want = fp8_linear_ref(silu_and_mul_ref(gated), q, scale, quantize_input=False).float()
    got = fp8_gemv(gated, q, scale, None, cfg, gated=True, counters=counters).float()
    _assert_bf16_close(got, want)
    assert not counters.any()
    with pytest.raises(ValueError, match="split-K counters"):
        fp8_gemv(x, q, scale, None, cfg, counters=counters[:2])


def _assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """A bf16 input and output against the float32 reference."""
    torch.testing.assert_close(got, want, atol=1e-2 * float(want.abs().max()), rtol=1e-2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(("n", "k"), LLAMA_SHAPES)
def test_gpu_llama_shapes_match_reference(n: int, k: int) -> None:
    _, q, scale = _weight(n, k, "cuda")
    for rows in (1, 4, 16, 300):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        xq, xs, _ = quantize_rows(x)
        want_q, want_s = quantize_rows_ref(x)
        torch.testing.assert_close(xs, want_s)
        assert (xq.float() != want_q.float()).float().mean() < 1e-3
        # The GEMMs against the product of the activation they are given: where the kernel's
        # and the reference's e4m3 rounding of x differ (ties, checked above), a K of 11008
        # or 14336 can move an output by two bf16 steps at the 1 % bound.
        want = (dequantize_fp8(xq, xs) @ dequantize_fp8(q, scale.reshape(-1, 1)).t()).float()
        tol = 1e-2 * float(want.abs().max())
        got = fp8_scaled_mm(xq, xs, q, scale, None, torch.bfloat16)
        assert float((got.float() - want).abs().max()) <= tol
        for cfg in fp8_gemm_candidates():
            got = fp8_gemm(xq, xs, q, scale, None, torch.bfloat16, cfg)
            assert float((got.float() - want).abs().max()) <= tol, cfg
        if rows <= 16:
            want = fp8_linear_ref(x, q, scale, quantize_input=False).float()
            for gcfg in fp8_gemv_candidates(rows):
                got = fp8_gemv(x, q, scale, None, gcfg)
                assert float((got.float() - want).abs().max()) <= tol, gcfg


@pytest.mark.gpu
@requires_cuda
def test_gpu_fused_quantization_matches_reference() -> None:
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    norm_w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    q, s, new_res = quantize_rows(x, norm=(norm_w, 1e-5), residual=residual)
    h, want_res = fused_add_rms_norm_ref(x, residual, norm_w, 1e-5)
    want_q, want_s = quantize_rows_ref(h)
    torch.testing.assert_close(new_res, want_res)
    torch.testing.assert_close(s, want_s, rtol=1e-2, atol=0)
    torch.testing.assert_close(dequantize_fp8(q, s), dequantize_fp8(want_q, want_s),
                               atol=2 * float(s.max()), rtol=2.0**-3)  # fmt: skip
    gated = torch.randn(64, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    q, s, _ = quantize_rows(gated, gated=True)
    want_q, want_s = quantize_rows_ref(silu_and_mul_ref(gated))
    torch.testing.assert_close(s, want_s, rtol=1e-2, atol=0)
    torch.testing.assert_close(dequantize_fp8(q, s), dequantize_fp8(want_q, want_s),
                               atol=2 * float(s.max()), rtol=2.0**-3)  # fmt: skip
