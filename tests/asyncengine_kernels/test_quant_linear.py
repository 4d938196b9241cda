"""The weight-only quantized GEMM and GEMV against their torch reference (dequantize, then
matmul): in the interpreter on small shapes, and on the GPU at Llama-2-7B's shapes."""

from __future__ import annotations

import pytest
import torch

from asyncengine_kernels._triton_utils import tl, triton
from asyncengine_kernels.activation import silu_and_mul_ref
from asyncengine_kernels.gemv_split_k import gemv_counters
from asyncengine_kernels.quant_linear import (
    QUANT_GEMM_SHAPES,
    QuantAtOnceGemvConfig,
    QuantGemmConfig,
    at_once_gemv_config,
    dequantize_weight,
    dequantize_weight_triton,
    pack_int_weight,
    quant_gemm,
    quant_gemm_candidates,
    quant_gemv,
    quant_gemv_candidates,
    quant_matmul_ref,
    unpack_int_weight,
)
from asyncengine_kernels.quant_linear import _dequant_tile as dequant_tile

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(n: int, k: int, bits: int, group: int, dtype: torch.dtype, device: str = "cpu",
          seed: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    g = k // group
    scales = (torch.rand(g, n, generator=gen) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 1 << bits, (g, n), generator=gen).to(dtype)
    return tuple(t.to(device) for t in (q, pack_int_weight(q, bits), scales, zeros))


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_round_trips_and_dequantizes_per_group(bits: int) -> None:
    q, qweight, scales, zeros = _case(24, 64, bits, 32, torch.float32)
    assert qweight.shape == (64 * bits // 32, 24) and qweight.dtype == torch.int32
    assert torch.equal(unpack_int_weight(qweight, bits).t(), q.int())
    w_t = dequantize_weight(qweight, scales, zeros, bits, 32)
    k, n = 40, 5  # column 5, input row 40: group 1
    assert w_t[k, n] == (q[n, k].float() - zeros[1, n]) * scales[1, n]


CASES = [  # (n, k, bits, group, rows)
    (48, 128, 4, 32, 1), (48, 128, 4, 64, 3), (40, 128, 8, 32, 2), (64, 256, 4, 128, 5),
    (48, 96, 8, 96, 1), (72, 64, 4, 64, 17),
]  # fmt: skip


@pytest.mark.parametrize(("n", "k", "bits", "group", "rows"), CASES)
def test_gemm_matches_reference(n: int, k: int, bits: int, group: int, rows: int) -> None:
    _, qweight, scales, zeros = _case(n, k, bits, group, torch.float32)
    x, bias = torch.randn(rows, k), torch.randn(n)
    want = quant_matmul_ref(x, qweight, scales, zeros, bits, group, bias)
    # The default tile's BLOCK_K of 64 narrows to a group of 96 (32) and spans groups of 32.
    for cfg in (QuantGemmConfig(16, 32, 32, 4, 1), QuantGemmConfig(16, 16, 16, 4, 1),
                QuantGemmConfig()):  # fmt: skip
        got = quant_gemm(x, qweight, scales, zeros, bits, group, bias, cfg)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@triton.jit
def _dequant_tile_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, GROUP_SIZE: tl.constexpr,
                         BITS: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_N: tl.constexpr):  # fmt: skip
    """Stores the GEMM's dequantized weight tiles: W^T [K, N] in w_ptr's dtype."""
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w = dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_mask, N, GROUP_SIZE, BITS, BLOCK_K,
                     w_ptr.dtype.element_ty)  # fmt: skip
    rows = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + rows[:, None] * N + offs_n[None, :], w, mask=n_mask[None, :])


def _gemm_tiles(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                group: int, block_k: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    w_t = torch.empty((k, n), dtype=dtype, device=qweight.device)
    grid = (k // block_k, triton.cdiv(n, 32))
    _dequant_tile_kernel[grid](qweight, scales, zeros, w_t, n, GROUP_SIZE=group, BITS=bits,
                               BLOCK_K=block_k, BLOCK_N=32)  # fmt: skip
    return w_t


# (bits, group, BLOCK_K): tiles inside a group, spanning 2 and 4 groups, a whole row.
TILE_CASES = [(4, 128, 64), (8, 128, 128), (4, 32, 64), (8, 32, 128), (4, 64, 128),
              (8, 256, 128), (4, 256, 256)]  # fmt: skip


@pytest.mark.parametrize(("bits", "group", "block_k"), TILE_CASES)
def test_gemm_weight_tiles_are_the_reference_dequantization(bits: int, group: int,
                                                            block_k: int) -> None:  # fmt: skip
    """The 16-bit tile the GEMM multiplies is `dequantize_weight`'s, bit for bit: (q - zero)
    * scale is exact in fp32 and rounded once. The interpreter rounds fp32 to fp16 as the
    GPU does; to bf16 it truncates (within one step here, bit-exact in the GPU test)."""
    for dtype in (torch.float16, torch.float32):
        _, qweight, scales, zeros = _case(48, 256, bits, group, dtype, seed=group + bits)
        want = dequantize_weight(qweight, scales, zeros, bits, group)
        got = _gemm_tiles(qweight, scales, zeros, bits, group, block_k, dtype)
        assert torch.equal(got, want), dtype
    _, qweight, scales, zeros = _case(48, 256, bits, group, torch.bfloat16)
    want = dequantize_weight(qweight, scales, zeros, bits, group)
    got = _gemm_tiles(qweight, scales, zeros, bits, group, block_k, torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "group", "block_k"), TILE_CASES)
def test_gpu_gemm_weight_tiles_are_bit_exact_in_bf16(bits: int, group: int,
                                                     block_k: int) -> None:  # fmt: skip
    _, qweight, scales, zeros = _case(4096, 1024, bits, group, torch.bfloat16, "cuda")
    want = dequantize_weight(qweight, scales, zeros, bits, group)
    got = _gemm_tiles(qweight, scales, zeros, bits, group, block_k, torch.bfloat16)
    assert torch.equal(got, want)


def _gemm_case(n: int, k: int, bits: int, group: int, sym: bool,
               seed: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """fp16 scales and zeros (bf16: `test_gemm_in_bf16_matches_reference`): symmetric ones
    have the zero 2^(bits - 1) everywhere."""
    _, qweight, scales, zeros = _case(n, k, bits, group, torch.float16, seed=seed)
    if sym:
        zeros = torch.full_like(zeros, 1 << (bits - 1))
    return qweight, scales, zeros


def _assert_gemm_matches(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                         zeros: torch.Tensor, bits: int, group: int, bias: torch.Tensor | None,
                         cfg: QuantGemmConfig) -> None:  # fmt: skip
    """Against `quant_matmul_ref` in fp16: the same 16-bit weights, so only the fp32
    summation order and the output's rounding differ."""
    want = quant_matmul_ref(x, qweight, scales, zeros, bits, group, bias).float()
    got = quant_gemm(x, qweight, scales, zeros, bits, group, bias, cfg).float()
    tol = 2e-3 * float(want.abs().max())
    assert got.shape == want.shape and float((got - want).abs().max()) <= tol, cfg


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group", [32, 64, 128, -1], ids=["g32", "g64", "g128", "channel"])
@pytest.mark.parametrize("bits", [4, 8])
def test_gemm_in_16_bits_matches_reference(bits: int, group: int, sym: bool) -> None:
    """Rows 1, 5, 16 and 33 (a partial row tile, and past one), with and without bias,
    BLOCK_K inside a group, spanning groups, and split in two along K."""
    n, k = 96, 256
    gs = k if group == -1 else group
    qweight, scales, zeros = _gemm_case(n, k, bits, gs, sym, seed=bits + gs)
    gen = torch.Generator().manual_seed(gs)
    bias = torch.randn(n, generator=gen).half()
    configs = [QuantGemmConfig(16, 32, 64, 4, 1), QuantGemmConfig(32, 64, 128, 4, 1),
               QuantGemmConfig(16, 64, 64, 4, 1, split_k=2)]  # fmt: skip
    for i, rows in enumerate((1, 5, 16, 33)):
        x = torch.randn(rows, k, generator=gen).half()
        _assert_gemm_matches(x, qweight, scales, zeros, bits, gs, bias if i % 2 else None,
                             configs[i % len(configs)])  # fmt: skip


@pytest.mark.parametrize("bits", [4, 8])
def test_gemm_in_bf16_matches_reference(bits: int) -> None:
    """bf16 activations (the engine's default), split along K and not: the interpreter's
    dot multiplies bf16 bit patterns unless the kernel upcasts its operands there."""
    n, k, group = 96, 256, 64
    qweight, scales, zeros = _gemm_case(n, k, bits, group, sym=False, seed=bits)
    scales, zeros = scales.bfloat16(), zeros.bfloat16()
    gen = torch.Generator().manual_seed(bits)
    for rows, cfg in ((4, QuantGemmConfig(16, 64, 128, 4, 4, split_k=2)),
                      (33, QuantGemmConfig(32, 64, 128, 4, 1))):  # fmt: skip
        x = torch.randn(rows, k, generator=gen).bfloat16()
        want = quant_matmul_ref(x.float(), qweight, scales.float(), zeros.float(), bits,
                                group).float()  # fmt: skip
        got = quant_gemm(x, qweight, scales, zeros, bits, group, None, cfg).float()
        assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max()), cfg


@pytest.mark.parametrize("bits", [4, 8])
def test_every_gemm_candidate_matches_reference(bits: int) -> None:
    """Each tile of `QUANT_GEMM_SHAPES` as the tuner builds it, at a K that takes every
    split (group 128, bias)."""
    n, k, group = 128, 512, 128
    configs = quant_gemm_candidates(group, k)
    assert [(c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.split_k)
            for c in configs] == list(QUANT_GEMM_SHAPES)  # fmt: skip
    qweight, scales, zeros = _gemm_case(n, k, bits, group, sym=False, seed=bits)
    gen = torch.Generator().manual_seed(bits)
    x, bias = torch.randn(33, k, generator=gen).half(), torch.randn(n, generator=gen).half()
    for cfg in configs:
        _assert_gemm_matches(x, qweight, scales, zeros, bits, group, bias, cfg)


def test_split_k_gemm_adds_the_splits_in_order_and_leaves_the_counters_zeroed() -> None:
    """The split GEMM gives the unsplit one's result up to the fp32 summation order, the
    same bits on every call (the partial sums added in split order), uneven splits too
    (K = 320 in 64-row tiles: 3 splits of 2, 2 and 1), and hands its counters back zeroed."""
    n, k, bits, group = 64, 320, 4, 64
    qweight, scales, zeros = _gemm_case(n, k, bits, group, sym=True)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(3)).half()
    counters = gemv_counters(16, n, "cpu")
    whole = quant_gemm(x, qweight, scales, zeros, bits, group, None, QuantGemmConfig(16, 32, 64))
    split = QuantGemmConfig(16, 32, 64, split_k=4)
    first = quant_gemm(x, qweight, scales, zeros, bits, group, None, split, counters)
    assert not counters.any()
    again = quant_gemm(x, qweight, scales, zeros, bits, group, None, split, counters)
    assert torch.equal(first, again)
    tol = 2e-3 * float(whole.float().abs().max())
    assert float((first.float() - whole.float()).abs().max()) <= tol


@pytest.mark.parametrize(("n", "k", "bits", "group", "rows"), CASES[:5])
def test_gemv_with_tiles_at_once_matches_reference(n: int, k: int, bits: int, group: int,
                                                   rows: int) -> None:  # fmt: skip
    """Every tile of a program loaded at once, including splits whose last tiles lie past
    K (masked to nothing) and bias."""
    _, qweight, scales, zeros = _case(n, k, bits, group, torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    want = quant_matmul_ref(x.float(), qweight, scales.float(), zeros.float(), bits, group)
    want += bias.float()
    tol = 1e-2 * float(want.abs().max())
    block_k = min(32, group)
    tiles_past_k = 1 << (k // block_k).bit_length()  # one program, tiles beyond K masked
    for cfg in (QuantAtOnceGemvConfig(32, block_k, tiles=1),
                QuantAtOnceGemvConfig(16, block_k, tiles=2),
                QuantAtOnceGemvConfig(16, block_k, tiles=tiles_past_k)):  # fmt: skip
        got = quant_gemv(x, qweight, scales, zeros, bits, group, bias, cfg).float()
        assert float((got - want).abs().max()) <= tol, cfg
    # The at-once form's products are always in pairs: it refuses a float32 input.
    with pytest.raises(ValueError, match="16-bit activations"):
        quant_gemv(x.float(), qweight, scales.float(), zeros.float(), bits, group, None,
                   QuantAtOnceGemvConfig(32, block_k, tiles=2))  # fmt: skip


@pytest.mark.parametrize(("n", "k", "bits", "group", "rows"), CASES[:4])
def test_gemv_at_once_forms_a_gated_input(n: int, k: int, bits: int, group: int,
                                          rows: int) -> None:  # fmt: skip
    """x as [gate, up]: the product with silu(gate) * up, as the separate kernel forms it:
    the unfused GEMV's result on the activated input, and within the pairs' bound of the
    float reference."""
    _, qweight, scales, zeros = _case(n, k, bits, group, torch.bfloat16)
    pair = torch.randn(rows, 2 * k, generator=torch.Generator().manual_seed(k + rows))
    pair = pair.to(torch.bfloat16)
    x = silu_and_mul_ref(pair.float()).to(torch.bfloat16)
    want = quant_matmul_ref(x.float(), qweight, scales.float(), zeros.float(), bits, group)
    cfg = QuantAtOnceGemvConfig(16, min(32, group), tiles=2)
    got = quant_gemv(pair, qweight, scales, zeros, bits, group, None, cfg, gated=True).float()
    unfused = quant_gemv(x, qweight, scales, zeros, bits, group, None, cfg).float()
    scale = float(want.abs().max())
    # The activated values round to bf16 on the GPU; the interpreter keeps bf16 in float32,
    # so there they differ slightly: the outputs stay within one bf16 rounding step.
    one_step = torch.finfo(torch.bfloat16).eps * 2 * scale
    assert float((got - unfused).abs().max()) <= one_step
    assert float((got - want).abs().max()) <= 2e-2 * scale


@pytest.mark.parametrize(("n", "k", "bits", "group"), [(48, 128, 4, 32), (40, 128, 8, 64),
                                                       (200, 96, 4, 96), (24, 256, 8, 256)])
def test_triton_dequantize_equals_reference(n: int, k: int, bits: int, group: int) -> None:
    _, qweight, scales, zeros = _case(n, k, bits, group, torch.float32)
    want = dequantize_weight(qweight, scales, zeros, bits, group)
    assert torch.equal(dequantize_weight_triton(qweight, scales, zeros, bits, group), want)
    # The interpreter truncates float32 to bfloat16 where the GPU rounds to nearest: within
    # one bf16 step here, bit-exact in the GPU test below.
    got = dequantize_weight_triton(qweight, scales, zeros, bits, group, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=0)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_triton_dequantize_is_bit_exact(bits: int) -> None:
    _, qweight, scales, zeros = _case(11008, 4096, bits, 128, torch.bfloat16, "cuda")
    want = dequantize_weight(qweight, scales, zeros, bits, 128)
    assert torch.equal(dequantize_weight_triton(qweight, scales, zeros, bits, 128), want)


def test_tiles_never_span_two_groups() -> None:
    _, qweight, scales, zeros = _case(32, 96, 4, 96, torch.float32)  # one group per row
    x = torch.randn(1, 96)
    with pytest.raises(ValueError, match="BLOCK_K=64 must divide the group size 96"):
        quant_gemv(x, qweight, scales, zeros, 4, 96, None, QuantAtOnceGemvConfig(32, 64, 1))
    with pytest.raises(ValueError, match="BLOCK_K=48 must be a power of two"):
        quant_gemm(x, qweight, scales, zeros, 4, 96, None, QuantGemmConfig(16, 16, 48))
    with pytest.raises(ValueError, match="x has 64 columns"):
        quant_gemm(x[:, :64].contiguous(), qweight, scales, zeros, 4, 96)


def test_candidates_fit_the_group_and_the_split() -> None:
    for group, k in [(32, 4096), (128, 4096), (128, 11008), (4096, 4096), (11008, 11008)]:
        gemm, gemv = quant_gemm_candidates(group, k), quant_gemv_candidates(group, k)
        assert gemm and all(k % c.block_k == 0 and k // c.block_k >= c.split_k for c in gemm)
        # A GEMM tile lies inside one group or spans whole groups.
        assert all(group % c.block_k == 0 or c.block_k % group == 0 for c in gemm)
        # A GEMV tile lies inside one group, and a program's tiles fit in K.
        assert gemv and all(group % c.block_k == 0 for c in gemv)
        assert all(k >= c.tiles * c.block_k for c in gemv)
    assert quant_gemv_candidates(128, 4096)


def test_gemv_config_name_stays() -> None:
    """A GEMV config's `str` is how timing tables, plan caches and logs key it, so it must
    not change; its tiles are a power of two."""
    at_once = at_once_gemv_config(128, 4096, 32, 256, 1)
    assert at_once == QuantAtOnceGemvConfig(32, 128, tiles=2, num_warps=1)
    assert str(at_once) == "gemv n32 k128x2 at once w1 pairs"
    with pytest.raises(ValueError, match="power-of-two tile count"):
        QuantAtOnceGemvConfig(32, 128, tiles=3)


# The tiny test model's quantized shapes (N, K): qkv, o, gate/up and down projections.
TINY_SHAPES = [(128, 64), (64, 128)]


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group", [32, -1])
@pytest.mark.parametrize(("n", "k"), TINY_SHAPES)
def test_every_candidate_config_matches_reference_for_8_bits(
    n: int, k: int, group: int, sym: bool
) -> None:
    """Every config the start-up tuner may plan, for 8-bit weights at the tiny model's
    shapes, at a partial row tile (7 rows, as a 7-token prefill) and past one (17)."""
    gs = k if group == -1 else group
    _, qweight, scales, zeros = _case(n, k, 8, gs, torch.float16, seed=1)
    if sym:
        zeros = torch.full_like(zeros, 128)
    for rows in (1, 7, 17):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).half()
        want = quant_matmul_ref(x.float(), qweight, scales.float(), zeros.float(), 8, gs)
        tol = 1e-2 * float(want.abs().max())
        for cfg in quant_gemm_candidates(gs, k):
            got = quant_gemm(x, qweight, scales, zeros, 8, gs, None, cfg).float()
            assert torch.isfinite(got).all() and float((got - want).abs().max()) <= tol, cfg
        for gcfg in quant_gemv_candidates(gs, k) if rows <= 16 else []:
            got = quant_gemv(x, qweight, scales, zeros, 8, gs, None, gcfg).float()
            assert torch.isfinite(got).all() and float((got - want).abs().max()) <= tol, gcfg


LLAMA_SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k"), LLAMA_SHAPES)
def test_gpu_llama_shapes_match_reference(n: int, k: int, bits: int) -> None:
    _, qweight, scales, zeros = _case(n, k, bits, 128, torch.bfloat16, "cuda")
    scales = scales / 4  # outputs of order one
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    for rows in (1, 4, 16, 64, 300):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) / 8
        want = quant_matmul_ref(x.float(), qweight, scales.float(), zeros.float(), bits, 128)
        tol = 2e-2 * float(want.abs().max())
        for cfg in quant_gemm_candidates(128, k):
            got = quant_gemm(x, qweight, scales, zeros, bits, 128, None, cfg, counters)
            assert float((got.float() - want).abs().max()) <= tol, cfg
            if cfg.split_k > 1:  # the splits added in a fixed order; the counters reset
                again = quant_gemm(x, qweight, scales, zeros, bits, 128, None, cfg, counters)
                assert torch.equal(got, again) and not counters.any(), cfg
        if rows <= 16:
            for gcfg in quant_gemv_candidates(128, k):
                got = quant_gemv(x, qweight, scales, zeros, bits, 128, None, gcfg)
                assert float((got.float() - want).abs().max()) <= tol, gcfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_gated_gemv_at_once_equals_silu_and_mul_then_gemv(bits: int) -> None:
    """Llama-2-7B's down projection: SiLU-and-mul formed while loading x gives what the
    activation kernel followed by the same GEMV gives (both round the activation to bf16)."""
    from asyncengine_kernels.activation import silu_and_mul

    n, k = 4096, 11008
    _, qweight, scales, zeros = _case(n, k, bits, 128, torch.bfloat16, "cuda")
    scales = scales / 4
    pair = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16) / 2
    x = silu_and_mul(pair)
    for cfg in quant_gemv_candidates(128, k):
        got = quant_gemv(pair, qweight, scales, zeros, bits, 128, None, cfg, gated=True)
        unfused = quant_gemv(x, qweight, scales, zeros, bits, 128, None, cfg)
        scale = float(unfused.float().abs().max())
        step = torch.finfo(torch.bfloat16).eps * 2 * scale
        assert float((got.float() - unfused.float()).abs().max()) <= step, cfg
        assert float((got != unfused).float().mean()) <= 0.01, cfg
