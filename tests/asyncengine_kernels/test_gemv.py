"""Batch-1 GEMV: the Triton kernel against F.linear, and the per-shape choice on the GPU."""

from __future__ import annotations

import pytest
import torch

from asyncengine_kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from asyncengine_kernels.gemv import (
    GEMV_CONFIGS,
    PERSISTENT_GEMV_CONFIGS,
    GemvConfig,
    TiledGemvConfig,
    WholeRowGemvConfig,
    gemv_candidates,
    gemv_ref,
    gemv_triton,
    rms_norm_gemv,
    tune_gemv,
    whole_row_max_k,
)
from asyncengine_kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from models.layers import MergedColumnParallelLinear, RowParallelLinear
from models.linear_tuning import tune_gpu_linears
from models.matmul_plan import Epilogue, InputTransform, TritonGemv
from tests.asyncengine_kernels.kernel_cases import requires_cuda

TILED = [TiledGemvConfig(8, 32, 4, 2), TiledGemvConfig(16, 16, 4, 1)]


def _case(n: int, k: int, dtype: torch.dtype, bias: bool, device: str = "cpu"):
    gen = torch.Generator().manual_seed(n * 31 + k)
    x = torch.randn(1, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    return x, w, b


# Whole-row (persistent) configs: with one "multiprocessor" on the CPU the grid is 2 or 3
# programs, so each loops over several row blocks.
WHOLE_ROW = [WholeRowGemvConfig(2, 4, 1, 2), WholeRowGemvConfig(1, 4, 1, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", [(24, 64), (40, 96), (7, 48)])  # even and ragged K and N
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [GEMV_CONFIGS[0], *TILED, *WHOLE_ROW])
def test_triton_matches_reference(
    dtype: torch.dtype, n: int, k: int, bias: bool, config: GemvConfig
) -> None:
    x, w, b = _case(n, k, dtype, bias)
    got = gemv_triton(x, w, b, config)
    want = gemv_ref(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert got.shape == (1, n) and got.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", [(24, 64), (7, 48)])
@pytest.mark.parametrize("config", [*TILED, *WHOLE_ROW])
def test_gated_equals_silu_and_mul_then_gemv(
    dtype: torch.dtype, n: int, k: int, config: GemvConfig
) -> None:
    """gated=True takes [gate, up] and multiplies silu(gate) * up, rounded to the input
    dtype as the activation kernel rounds it."""
    x, w, _ = _case(n, k, dtype, False)
    gate_up = torch.cat([x, 2 * x.flip(-1)], dim=-1)
    want = gemv_triton(silu_and_mul_triton(gate_up), w, None, config)
    got = gemv_triton(gate_up, w, None, config, gated=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    ref = gemv_ref(silu_and_mul_ref(gate_up.float()), w.float()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", [(24, 64), (7, 48)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("config", [*TILED, *WHOLE_ROW])
def test_rms_norm_gemv_equals_norm_then_gemv(
    dtype: torch.dtype, n: int, k: int, with_residual: bool, config: GemvConfig
) -> None:
    x, w, b = _case(n, k, dtype, True)
    gen = torch.Generator().manual_seed(k)
    residual = torch.randn(1, k, generator=gen).to(dtype) if with_residual else None
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    y, new_residual = rms_norm_gemv(x, residual, norm_w, 1e-5, w, b, config)
    if residual is None:
        normed, want_residual = rms_norm_ref(x, norm_w, 1e-5), x
    else:
        normed, want_residual = fused_add_rms_norm_ref(x, residual, norm_w, 1e-5)
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)
    want = gemv_ref(normed.float(), w.float(), b.float()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(y, want, atol=tol, rtol=tol)
    assert y.shape == (1, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", [(24, 64), (7, 48)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [*TILED, *WHOLE_ROW])
def test_glu_equals_gemv_then_silu_and_mul(
    dtype: torch.dtype, n: int, k: int, bias: bool, config: GemvConfig
) -> None:
    """glu=True over a [gate; up] weight (2n rows) gives silu(gate) * up, rounded as the
    plain GEMV then the activation kernel round it."""
    x, w, b = _case(2 * n, k, dtype, bias)
    want = silu_and_mul_triton(gemv_triton(x, w, b, config))
    got = gemv_triton(x, w, b, config, glu=True)
    assert got.shape == (1, n)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    ref = silu_and_mul_ref(gemv_ref(x.float(), w.float(), None if b is None else b.float()))
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got, ref.to(dtype), atol=tol, rtol=tol)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gemv_with_glu_equals_the_separate_kernels(with_residual: bool) -> None:
    x, w, _ = _case(2 * 24, 64, torch.float16, False)
    gen = torch.Generator().manual_seed(1)
    residual = torch.randn(1, 64, generator=gen).half() if with_residual else None
    norm_w = (1 + 0.1 * torch.randn(64, generator=gen)).half()
    config = TILED[0]
    y, new_residual = rms_norm_gemv(x, residual, norm_w, 1e-5, w, None, config, glu=True)
    gate_up, want_residual = rms_norm_gemv(x, residual, norm_w, 1e-5, w, None, config)
    torch.testing.assert_close(y, silu_and_mul_triton(gate_up), atol=0, rtol=0)
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)


@pytest.mark.parametrize("with_residual", [False, True])
def test_whole_row_rms_norm_gemv_with_glu_equals_the_tiled_kernel(with_residual: bool) -> None:
    """The persistent form with everything fused (norm, residual, GLU) gives the tiled
    kernel's result bit for bit when the tile spans the row: the same products, sums and
    roundings."""
    x, w, b = _case(2 * 24, 64, torch.float16, True)
    gen = torch.Generator().manual_seed(2)
    residual = torch.randn(1, 64, generator=gen).half() if with_residual else None
    norm_w = (1 + 0.1 * torch.randn(64, generator=gen)).half()
    tiled_cfg, whole_cfg = TiledGemvConfig(4, 64, 4, 1), WholeRowGemvConfig(4, 4, 1, 2)
    tiled = rms_norm_gemv(x, residual, norm_w, 1e-5, w, b, tiled_cfg, glu=True)
    whole = rms_norm_gemv(x, residual, norm_w, 1e-5, w, b, whole_cfg, glu=True)
    torch.testing.assert_close(whole[0], tiled[0], atol=0, rtol=0)
    torch.testing.assert_close(whole[1], tiled[1], atol=0, rtol=0)


def _e4m3_case(n: int, k: int, dtype: torch.dtype):
    """An e4m3 weight with float32 row scales (`asyncengine_kernels.fp8_linear`'s layout), its dense
    float32 equivalent, and an input in `dtype`."""
    from asyncengine_kernels.fp8_linear import quantize_weight_per_channel

    x, w, b = _case(n, k, torch.float32, True)
    q, scale = quantize_weight_per_channel(w)
    return x.to(dtype), q, scale.reshape(-1), q.float() * scale, b.to(dtype)


# float16 rather than bfloat16: the interpreter rounds bfloat16 casts differently. Pairs
# take 16-bit activations only (their refusal of float32 is tested below). Only the
# whole-row form reads e4m3 rows (the tiled one's refusal is tested below).
# (dtype, config, K): K = 48 leaves the padded row's last words past K.
E4M3_CASES = [
    *((dtype, config, 64) for dtype in (torch.float32, torch.float16) for config in WHOLE_ROW),
    (torch.float16, WholeRowGemvConfig(2, 4, 1, 2, pairs=True), 64),
    (torch.float16, WholeRowGemvConfig(4, 4, 1, 2, pairs=True), 48),
    # Longer than a float32 row may be (the pairs hold up to PERSISTENT_PAIRS_GEMV_MAX_K).
    (torch.float16, WholeRowGemvConfig(1, 4, 1, 2, pairs=True), 8192 + 96),
]  # fmt: skip


@pytest.mark.parametrize("dtype,config,k", E4M3_CASES)
def test_e4m3_weight_with_row_scales_matches_its_dense_equivalent(
    dtype: torch.dtype, config: WholeRowGemvConfig, k: int
) -> None:
    """An FP8 layer's one-row product: e4m3 rows, each row's sum times its scale, then the
    bias; plain, gated, with a fused norm, and with a GLU output (whose up half has its own
    scales)."""
    n = 24
    x, q, scale, dense, b = _e4m3_case(2 * n, k, dtype)
    # Pairs round x to fp16 and sum each word's four products in fp16.
    tol = 1e-4 if dtype == torch.float32 else (8e-3 if config.pairs else 4e-3)
    got = gemv_triton(x, q, b, config, scale=scale)
    torch.testing.assert_close(got.float(), gemv_ref(x.float(), dense, b.float()),
                               atol=tol, rtol=tol)  # fmt: skip
    glu = gemv_triton(x, q, b, config, glu=True, scale=scale)
    want_glu = silu_and_mul_ref(gemv_ref(x.float(), dense, b.float()))
    torch.testing.assert_close(glu.float(), want_glu, atol=tol, rtol=tol)
    gate_up = torch.cat([x, 2 * x.flip(-1)], dim=-1)
    gated = gemv_triton(gate_up, q, None, config, gated=True, scale=scale)
    want_gated = gemv_ref(silu_and_mul_ref(gate_up.float()).to(dtype).float(), dense)
    torch.testing.assert_close(gated.float(), want_gated, atol=tol, rtol=tol)
    norm_w = torch.linspace(0.5, 1.5, k).to(dtype)
    residual = x.flip(-1)
    y, new_residual = rms_norm_gemv(x, residual, norm_w, 1e-5, q, b, config, scale=scale)
    normed, want_residual = fused_add_rms_norm_ref(x, residual, norm_w, 1e-5)
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(y.float(), gemv_ref(normed.float(), dense, b.float()),
                               atol=tol, rtol=tol)  # fmt: skip


def test_pairs_are_a_whole_row_option_for_e4m3_rows_and_16_bit_inputs() -> None:
    pairs = WholeRowGemvConfig(2, 4, 1, 2, pairs=True)
    assert str(pairs) == "whole_row[2, 2, 4, 1] pairs"
    with pytest.raises(TypeError, match="pairs"):
        TiledGemvConfig(8, 32, 4, 1, pairs=True)  # type: ignore[call-arg]
    x, q, scale, _, _ = _e4m3_case(8, 16, torch.float16)
    with pytest.raises(ValueError, match="16-bit activations"):
        gemv_triton(x.float(), q, scale=scale, config=pairs)
    with pytest.raises(ValueError, match="read e4m3 weights"):
        gemv_triton(x, q.half(), config=pairs)
    with pytest.raises(ValueError, match="whole 4-byte words"):
        gemv_triton(x[:, :14], q[:, :14].contiguous(), scale=scale, config=pairs)


def test_whole_row_rows_may_be_longer_in_pairs_than_in_float32() -> None:
    """The pairs hold the input row in half the registers, so they take rows up to twice as
    long; a float32 whole-row config refuses such a row rather than spill."""
    floats, pairs = WholeRowGemvConfig(1, 4, 1, 2), WholeRowGemvConfig(1, 4, 1, 2, pairs=True)
    assert whole_row_max_k(pairs) == 2 * whole_row_max_k(floats) == 16384
    k = whole_row_max_k(floats) + 96
    x, q, scale, _, _ = _e4m3_case(4, k, torch.float16)
    with pytest.raises(ValueError, match="rows up to 8192 long"):
        gemv_triton(x, q, scale=scale, config=floats)


def test_e4m3_weight_needs_float32_row_scales() -> None:
    x, q, scale, _, _ = _e4m3_case(8, 16, torch.float32)
    whole = WHOLE_ROW[0]
    with pytest.raises(ValueError, match="needs its row scales"):
        gemv_triton(x, q, config=whole)
    with pytest.raises(ValueError, match=r"float32 \[8\]"):
        gemv_triton(x, q, scale=scale[:4], config=whole)
    with pytest.raises(ValueError, match=r"float32 \[8\]"):
        gemv_triton(x, q, scale=scale.double(), config=whole)


def test_tiled_form_reads_16_bit_weights_only() -> None:
    """No kind runs the tiled form on e4m3 rows: it refuses their scales (and an e4m3
    weight without them), plain or with a fused norm."""
    x, q, scale, _, _ = _e4m3_case(8, 16, torch.float16)
    with pytest.raises(ValueError, match=r"tiled GEMV .* 16-bit weights only"):
        gemv_triton(x, q, config=TILED[0], scale=scale)
    with pytest.raises(ValueError, match=r"tiled GEMV .* 16-bit weights only"):
        rms_norm_gemv(x, None, torch.ones(16, dtype=x.dtype), 1e-5, q, None, TILED[0],
                      scale=scale)  # fmt: skip
    with pytest.raises(ValueError, match="needs its row scales"):
        gemv_triton(x, q, config=TILED[0])


def test_config_names_its_form() -> None:
    tiled, whole = TiledGemvConfig(8, 512, 4, 4), WholeRowGemvConfig(2, 4, 3, 4)
    assert (tiled.block_k, whole.programs_per_sm) == (512, 4)
    assert str(tiled) == "tiled[8, 512, 4, 4]" and str(whole) == "whole_row[2, 4, 4, 3]"
    # A config holds only the fields its form reads.
    assert not hasattr(tiled, "programs_per_sm") and not hasattr(tiled, "pairs")
    assert not hasattr(whole, "block_k")
    with pytest.raises(ValueError, match="block_k"):
        TiledGemvConfig(8, 0, 4, 4)
    with pytest.raises(ValueError, match="programs_per_sm"):
        WholeRowGemvConfig(8, 4, 4, 0)


def test_config_names_stay_as_plans_and_timing_tables_key_them() -> None:
    """Timing tables, plan caches and logs name configs by `str`: these must not change."""
    assert [str(c) for c in GEMV_CONFIGS] == [
        "tiled[4, 512, 4, 4]", "tiled[4, 1024, 4, 3]", "tiled[8, 512, 4, 4]",
        "tiled[8, 256, 4, 4]", "tiled[16, 256, 4, 3]", "tiled[16, 512, 8, 3]",
        "tiled[32, 128, 4, 4]",
    ]  # fmt: skip
    assert [str(c) for c in PERSISTENT_GEMV_CONFIGS] == [
        "whole_row[1, 8, 4, 4]", "whole_row[2, 4, 4, 3]", "whole_row[2, 4, 8, 3]",
        "whole_row[4, 2, 8, 2]",
    ]  # fmt: skip
    assert str(WholeRowGemvConfig(8, 8, 3, programs_per_sm=2, pairs=True)) == (
        "whole_row[8, 2, 8, 3] pairs"
    )


def test_candidates_hold_the_whole_row_configs_where_the_row_fits() -> None:
    assert gemv_candidates(4096) == GEMV_CONFIGS + PERSISTENT_GEMV_CONFIGS
    assert gemv_candidates(11008) == GEMV_CONFIGS
    assert all(isinstance(c, WholeRowGemvConfig) for c in PERSISTENT_GEMV_CONFIGS)
    assert all(isinstance(c, TiledGemvConfig) for c in GEMV_CONFIGS)


def test_whole_row_form_refuses_rows_longer_than_it_holds() -> None:
    x, w, _ = _case(4, 8192 + 16, torch.float32, False)
    with pytest.raises(ValueError, match="whole-row GEMV"):
        gemv_triton(x, w, None, WHOLE_ROW[0])


def test_glu_rejects_an_odd_number_of_rows() -> None:
    x, w, _ = _case(7, 16, torch.float32, False)
    with pytest.raises(ValueError, match="GLU output"):
        gemv_triton(x, w, glu=True)


def test_rms_norm_gemv_validates_its_inputs() -> None:
    x, w, _ = _case(8, 16, torch.float32, False)
    with pytest.raises(ValueError, match="norm weight"):
        rms_norm_gemv(x, None, torch.ones(8), 1e-5, w)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_gemv(x, torch.zeros(1, 16, dtype=torch.float16), torch.ones(16), 1e-5, w)


def test_gated_rejects_an_ungated_width() -> None:
    x, w, _ = _case(8, 16, torch.float32, False)
    with pytest.raises(ValueError, match=r"gemv needs x \[1, 2 \* 16\]"):
        gemv_triton(x, w, gated=True)


def test_rejects_a_batch_of_two() -> None:
    x, w, _ = _case(8, 16, torch.float32, False)
    with pytest.raises(ValueError, match="gemv needs"):
        gemv_triton(torch.cat([x, x]), w)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)])
def test_gpu_llama_shapes_match_blas(n: int, k: int) -> None:
    x, w, _ = _case(n, k, torch.bfloat16, False, device="cuda")
    want = gemv_ref(x, w)
    for config in gemv_candidates(k):
        got = gemv_triton(x, w, None, config)
        # Both accumulate in fp32 and round once; only the summation order differs.
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@requires_cuda
def test_gpu_tuned_layer_uses_the_faster_kernel_and_stays_correct() -> None:
    layer = RowParallelLinear(11008, 4096).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.01)
    best, fuses, ms, timings = tune_gemv([layer.weight])
    assert not fuses  # a plain input has nothing to fuse
    assert ms == timings["blas" if best is None else str(best)]
    assert "blas" in timings and len(timings) > 1
    if best is not None:
        assert timings[str(best)] < timings["blas"]
    tune_gpu_linears(layer)  # times again: noise may pick another config, or the library
    batch1 = layer.plan.entry_for(1).kind
    assert not isinstance(batch1, TritonGemv) or batch1.config in GEMV_CONFIGS  # K = 11008
    # 2-16 rows: the few-row matmul where it won, else the library; beyond, the library.
    assert layer.plan.entry_for(2).kind.name in ("BLAS", "Triton skinny GEMM")
    assert layer.plan.entry_for(17).kind.name == "BLAS"
    x = torch.randn(1, 11008, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), gemv_ref(x, layer.weight), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@requires_cuda
def test_gpu_gated_layer_is_tuned_in_its_gated_form() -> None:
    gated = InputTransform.SILU_AND_MUL
    layer = RowParallelLinear(11008, 4096, input_transform=gated).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.01)
    timings = tune_gpu_linears(layer)[(4096, 11008)]
    assert "blas" in timings and len(timings) > 1
    assert all(e.input is gated for e in layer.plan.entries)
    gate_up = torch.randn(1, 2 * 11008, device="cuda", dtype=torch.bfloat16)
    want = gemv_ref(silu_and_mul_ref(gate_up), layer.weight)
    torch.testing.assert_close(layer(gate_up), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n", [12288, 22016])
def test_gpu_rms_norm_gemv_at_llama_sizes(n: int) -> None:
    x, w, _ = _case(n, 4096, torch.bfloat16, False, device="cuda")
    residual = torch.randn_like(x)
    norm_w = (1 + 0.1 * torch.randn(4096, device="cuda")).bfloat16()
    normed, want_residual = fused_add_rms_norm_ref(x, residual, norm_w, 1e-5)
    want = gemv_ref(normed, w)
    timings = tune_gemv([w], normed=True).timings
    assert "blas" in timings and any(name.startswith("unfused") for name in timings)
    for config in GEMV_CONFIGS + PERSISTENT_GEMV_CONFIGS:
        y, new_residual = rms_norm_gemv(x, residual, norm_w, 1e-5, w, None, config)
        assert torch.equal(new_residual, want_residual)
        torch.testing.assert_close(y, want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n", [12288, 22016])
def test_gpu_e4m3_whole_row_gemv_at_llama_sizes(n: int) -> None:
    """The FP8 layers' one-row whole-row GEMV (norm fused) at the q/k/v and gate/up shapes,
    every config the tuner times, against the dense product of the same e4m3 rows."""
    from asyncengine_kernels.fp8_linear import FP8_WHOLE_ROW_CONFIGS, quantize_weight_per_channel

    x, w, _ = _case(n, 4096, torch.bfloat16, False, device="cuda")
    q, scale = quantize_weight_per_channel(w)
    residual = torch.randn_like(x)
    norm_w = (1 + 0.1 * torch.randn(4096, device="cuda")).bfloat16()
    normed, want_residual = fused_add_rms_norm_ref(x, residual, norm_w, 1e-5)
    want = gemv_ref(normed.float(), q.float() * scale)
    for config in FP8_WHOLE_ROW_CONFIGS:
        y, new_residual = rms_norm_gemv(x, residual, norm_w, 1e-5, q, None, config,
                                        scale=scale.reshape(-1))  # fmt: skip
        assert torch.equal(new_residual, want_residual)
        torch.testing.assert_close(y.float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@requires_cuda
def test_gpu_e4m3_whole_row_pairs_gemv_at_the_down_projection() -> None:
    """The down projection's 11,008-long rows (Llama-2-7B) in the pairs whole-row configs,
    with SiLU-and-mul formed in the kernel, against the dense product of the same rows."""
    from asyncengine_kernels.fp8_linear import FP8_WHOLE_ROW_CONFIGS, quantize_weight_per_channel

    k = 11008
    x, w, _ = _case(4096, k, torch.bfloat16, False, device="cuda")
    q, scale = quantize_weight_per_channel(w)
    gate_up = torch.cat([x, x.flip(-1)], dim=-1)
    want = gemv_ref(silu_and_mul_ref(gate_up.float()).bfloat16().float(), q.float() * scale)
    configs = [c for c in FP8_WHOLE_ROW_CONFIGS if k <= whole_row_max_k(c)]
    assert configs and all(c.pairs for c in configs)
    for config in configs:
        y = gemv_triton(gate_up, q, None, config, gated=True, scale=scale.reshape(-1))
        torch.testing.assert_close(y.float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@requires_cuda
def test_gpu_glu_gemv_at_llama_sizes_and_the_mlp_pair_choice() -> None:
    """The GLU epilogue at Llama-2-7B's gate/up size, and the tuner's choice for an MLP:
    whichever pair it plans, a batch-1 MLP step still equals the reference."""
    x, w, _ = _case(22016, 4096, torch.bfloat16, False, device="cuda")
    want = silu_and_mul_ref(gemv_ref(x, w))
    for config in GEMV_CONFIGS + PERSISTENT_GEMV_CONFIGS:
        torch.testing.assert_close(gemv_triton(x, w, None, config, glu=True), want,
                                   atol=3e-2, rtol=3e-2)  # fmt: skip

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = MergedColumnParallelLinear(4096, [11008, 11008], glu_output=True)
            self.down_proj = RowParallelLinear(
                11008, 4096, input_transform=InputTransform.SILU_AND_MUL
            )

    mlp = MLP().cuda().to(torch.bfloat16)
    torch.nn.init.normal_(mlp.gate_up_proj.weight, std=0.02)
    torch.nn.init.normal_(mlp.down_proj.weight, std=0.02)
    timings = tune_gpu_linears(mlp)
    assert any(name.startswith("glu ") for name in timings[(22016, 4096)])
    assert any(name.startswith("plain input ") for name in timings[(4096, 11008)])
    producer, consumer = mlp.gate_up_proj.plan.entry_for(1), mlp.down_proj.plan.entry_for(1)
    # The pair is planned together: an activated output meets a plain input.
    assert (producer.epilogue is Epilogue.SILU_AND_MUL) == (consumer.input is InputTransform.NONE)
    h = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    ref = gemv_ref(silu_and_mul_ref(gemv_ref(h, mlp.gate_up_proj.weight)), mlp.down_proj.weight)
    got = mlp.down_proj(mlp.gate_up_proj(h))
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@requires_cuda
def test_gpu_tuner_times_whole_row_configs_unless_told_not_to() -> None:
    _, w, _ = _case(12288, 4096, torch.bfloat16, False, device="cuda")
    timings = tune_gemv([w], normed=True).timings
    assert any(name.startswith(str(PERSISTENT_GEMV_CONFIGS[0])) for name in timings)
    tiled_only = tune_gemv([w], normed=True, configs=GEMV_CONFIGS).timings
    assert not any("whole_row" in name for name in tiled_only)
    assert any(name.startswith(str(GEMV_CONFIGS[0])) for name in tiled_only)


@pytest.mark.gpu
@requires_cuda
def test_gpu_tuner_skips_a_config_that_disagrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """A config whose result is wrong is never timed, so never chosen."""
    from asyncengine_kernels import gemv as gemv_module

    real = gemv_module.gemv_triton

    def broken(
        x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
        config: GemvConfig = GEMV_CONFIGS[0], **kw: bool,
    ) -> torch.Tensor:  # fmt: skip
        y = real(x, w, b, config, **kw)
        return y + 1.0 if config == GEMV_CONFIGS[0] else y

    monkeypatch.setattr(gemv_module, "gemv_triton", broken)
    _, w, _ = _case(4096, 4096, torch.bfloat16, False, device="cuda")
    timings = tune_gemv([w]).timings
    assert str(GEMV_CONFIGS[0]) not in timings
    assert str(GEMV_CONFIGS[1]) in timings


@pytest.mark.gpu
@requires_cuda
def test_gpu_whole_row_grid_stays_resident() -> None:
    """The whole-row kernel's grid is capped at the programs that fit on the GPU at once,
    read from the compiled kernel's register and shared-memory use."""
    from asyncengine_kernels import gemv as gemv_module

    x, w, _ = _case(12288, 4096, torch.bfloat16, False, device="cuda")
    for config in PERSISTENT_GEMV_CONFIGS:
        torch.testing.assert_close(gemv_triton(x, w, None, config), gemv_ref(x, w),
                                   atol=2e-2, rtol=2e-2)  # fmt: skip
    assert gemv_module._resident and all(1 <= v <= 32 for v in gemv_module._resident.values())


def test_compile_only_runs_each_call_once_and_picks_the_library() -> None:
    """Under `compile_only` (the start-up tuner's compile pass) the library and every
    candidate run once, untimed, a failing candidate is skipped, and the library is chosen;
    outside it, on other threads, timing is as before."""
    import threading

    from asyncengine_kernels import gemv as gemv_module
    from asyncengine_kernels.gemv import compile_only, fastest_against_library

    ran: list[str] = []

    def call(name: str, fail: bool = False):  # type: ignore[no-untyped-def]
        def run(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            ran.append(name)
            if fail:
                raise RuntimeError("out of resources")
            return w

        return run

    candidates = [("a", "config a", False, call("a")), ("b", "config b", True, call("b", True))]
    pairs = [(torch.ones(2, 2), None)]
    with compile_only():
        assert fastest_against_library(call("blas"), candidates, pairs, 3) == (None, False,
                                                                              0.0, {})
        other: list[bool] = []
        thread = threading.Thread(target=lambda: other.append(
            getattr(gemv_module._compiling, "on", False)))  # fmt: skip
        thread.start()
        thread.join()
    assert ran == ["blas", "a", "b"] and other == [False]
    assert not getattr(gemv_module._compiling, "on", False)
