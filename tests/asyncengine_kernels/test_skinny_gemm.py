"""The few-row matmul (`asyncengine_kernels.skinny_gemm`) against F.linear: in the interpreter on
small shapes (odd row counts, ragged N and K, bias, K splits, the gated input and the GLU
epilogue), and on the GPU at Llama-2-7B shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncengine_kernels.skinny_gemm import (
    SKINNY_CONFIGS,
    SKINNY_MAX_ROWS,
    SkinnyConfig,
    pipeline_stages,
    skinny_counters,
    skinny_gemm,
    tune_skinny,
)
from tests.asyncengine_kernels.kernel_cases import requires_cuda

# One K range per program; four K splits of one tile each (a ragged K leaves fewer splits
# than asked); two splits of wider blocks.
CONFIGS = [
    SkinnyConfig(32, 32, 1, 4, 1),
    SkinnyConfig(32, 16, 4, 4, 2),
    SkinnyConfig(64, 32, 2, 4, 1),
]
TOLS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, device: str = "cpu",
          x_cols: int | None = None):  # fmt: skip
    gen = torch.Generator().manual_seed(m * 1000 + n * 31 + k)
    x = torch.randn(m, x_cols or k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    return x, w, b


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear in fp32 on the same (rounded) operands, rounded once to their dtype."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded once to the dtype (as `silu_and_mul` rounds)."""
    half = x.shape[-1] // 2
    return (F.silu(x[..., :half].float()) * x[..., half:].float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("n,k", [(40, 96), (64, 80)])  # ragged N; K not a multiple of 32
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_matches_f_linear(dtype: torch.dtype, m: int, n: int, k: int, config: SkinnyConfig) -> None:
    x, w, b = _case(m, n, k, dtype, bias=m != 5)
    got = skinny_gemm(x, w, b, config)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = TOLS[dtype]
    torch.testing.assert_close(got, _linear(x, w, b), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [3, 16])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_gated_input_equals_silu_and_mul_then_f_linear(
    dtype: torch.dtype, m: int, config: SkinnyConfig
) -> None:
    x, w, b = _case(m, 40, 80, dtype, bias=True, x_cols=160)
    got = skinny_gemm(x, w, b, config, gated=True)
    tol = TOLS[dtype]
    torch.testing.assert_close(got, _linear(_silu_and_mul(x), w, b), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 13])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_glu_epilogue_equals_f_linear_then_silu_and_mul(
    dtype: torch.dtype, m: int, bias: bool, config: SkinnyConfig
) -> None:
    """W is [gate; up] (2 x 40 rows): each half is rounded to the dtype before SiLU-and-mul,
    as the unfused [gate, up] output is."""
    x, w, b = _case(m, 80, 48, dtype, bias)
    got = skinny_gemm(x, w, b, config, glu=True)
    assert got.shape == (m, 40)
    tol = TOLS[dtype]
    torch.testing.assert_close(got, _silu_and_mul(_linear(x, w, b)), atol=tol, rtol=tol)


def test_split_k_is_deterministic_and_leaves_the_counters_zeroed() -> None:
    """The last split of a block adds every split's sums in split order: the same bits
    each call, and the counters are ready for the next call."""
    x, w, b = _case(7, 72, 128, torch.float32, bias=True)
    config = SkinnyConfig(32, 16, 8, 4, 1)
    counters = skinny_counters(72, "cpu")
    first = skinny_gemm(x, w, b, config, counters)
    assert torch.equal(counters, torch.zeros_like(counters))
    assert torch.equal(skinny_gemm(x, w, b, config, counters), first)
    torch.testing.assert_close(first, _linear(x, w, b), atol=1e-5, rtol=1e-5)
    # GLU through the same counters: both halves' partial sums are added up.
    got = skinny_gemm(x, w, b, config, counters, glu=True)
    torch.testing.assert_close(got, _silu_and_mul(_linear(x, w, b)), atol=1e-5, rtol=1e-5)
    assert torch.equal(counters, torch.zeros_like(counters))


def test_stages_are_capped_where_the_tiles_would_not_fit_shared_memory() -> None:
    """Stages of 36 KB (a 128 x 128 bf16 weight tile and a 16-row input tile) fit 4 and the
    peeled tile in 227 KB; with the up half's tile too, 68 KB a stage fit only 2."""
    wide = SkinnyConfig(128, 128, 1, 4, 4)
    assert pipeline_stages(wide, 2, gated=False, glu=False) == 4
    assert pipeline_stages(wide, 2, gated=False, glu=True) == 2
    assert pipeline_stages(SkinnyConfig(64, 128, 1, 4, 4), 2, gated=True, glu=True) == 4
    assert pipeline_stages(wide, 4, gated=False, glu=True) == 1


def test_rejects_what_it_cannot_compute() -> None:
    x, w, _ = _case(4, 32, 32, torch.float32, bias=False)
    with pytest.raises(ValueError, match=f"1 to {SKINNY_MAX_ROWS} rows"):
        skinny_gemm(torch.randn(SKINNY_MAX_ROWS + 1, 32), w)
    with pytest.raises(ValueError, match="needs 64"):
        skinny_gemm(x, w, gated=True)
    with pytest.raises(ValueError, match="bfloat16"):
        skinny_gemm(x, w.bfloat16())
    with pytest.raises(ValueError, match=r"\[gate; up\] weight rows"):
        skinny_gemm(x, w[:31], glu=True)
    with pytest.raises(ValueError, match="bias must be"):
        skinny_gemm(x, w, torch.randn(31))
    with pytest.raises(ValueError, match="counters"):
        skinny_gemm(x, torch.randn(96, 32), None, SkinnyConfig(32, 16, 2, 4, 1),
                    skinny_counters(32, "cpu"))  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        SkinnyConfig(48, 32, 1, 4, 1)
    with pytest.raises(ValueError, match="block_n must be at least"):
        SkinnyConfig(16, 32, 1, 4, 1)


# Llama-2-7B: qkv, o_proj, gate/up, down, the LM head.
LLAMA_SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n,k", LLAMA_SHAPES)
def test_gpu_llama_shapes_match_blas(n: int, k: int) -> None:
    counters = skinny_counters(n, "cuda")
    for m in (2, 5, 16):
        x, w, _ = _case(m, n, k, torch.bfloat16, bias=False, device="cuda")
        want = F.linear(x, w)
        for config in SKINNY_CONFIGS:
            got = skinny_gemm(x, w, None, config, counters)
            # Both accumulate in fp32 and round once; only the summation order differs.
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=str(config))
        assert torch.equal(counters, torch.zeros_like(counters))


@pytest.mark.gpu
@requires_cuda
def test_gpu_mlp_forms_match_blas() -> None:
    """The gate/up projection's GLU epilogue and the down projection's gated input at the
    7B sizes, for every config."""
    x, gate_up, _ = _case(5, 22016, 4096, torch.bfloat16, bias=False, device="cuda")
    h, down, _ = _case(5, 4096, 11008, torch.bfloat16, bias=False, device="cuda",
                       x_cols=22016)  # fmt: skip
    want_mid = _silu_and_mul(F.linear(x, gate_up))
    want_out = F.linear(_silu_and_mul(h), down)
    for config in SKINNY_CONFIGS:
        torch.testing.assert_close(skinny_gemm(x, gate_up, None, config, glu=True), want_mid,
                                   atol=2e-2, rtol=2e-2, msg=str(config))  # fmt: skip
        torch.testing.assert_close(skinny_gemm(h, down, None, config, gated=True), want_out,
                                   atol=2e-2, rtol=2e-2, msg=str(config))  # fmt: skip


@pytest.mark.gpu
@requires_cuda
def test_gpu_tuning_times_every_config_against_blas() -> None:
    weights = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(4)]  # fmt: skip
    choice = tune_skinny(weights, rows=8)
    assert "blas" in choice.timings and len(choice.timings) > 1
    name = "blas" if choice.config is None else str(choice.config)
    assert choice.ms == choice.timings[name]
    if choice.config is not None:
        assert choice.ms < choice.timings["blas"]
