"""The int4 wgmma matmul (`asyncengine_kernels.int4_wgmma`): its weight packing and launch rules on
the CPU, the kernel against `quant_matmul_ref` on an H100/H200 (GPU-marked). Its build for sm_90
is checked with the other kernels (`test_compile_for_gpu`)."""

from __future__ import annotations

import itertools

import pytest
import torch

from asyncengine_kernels.int4_wgmma import (
    ITER_K,
    MAX_ROWS,
    X_SLICE_BYTES,
    int4_wgmma_config,
    int4_wgmma_matmul,
    pack_int4_wgmma,
    supported,
    unpack_int4_wgmma,
)
from asyncengine_kernels.quant_linear import pack_int_weight, quant_matmul_ref

requires_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU (wgmma)",
)


def _codes(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int64)


def test_packing_round_trips() -> None:
    q = _codes(128, 256)
    words = pack_int4_wgmma(pack_int_weight(q, 4))
    assert words.dtype == torch.int32 and words.numel() == 128 * 256 // 8
    assert torch.equal(unpack_int4_wgmma(words, 128, 256), q)


def test_each_code_sits_in_its_threads_fragment_slot() -> None:
    """The documented mapping, element by element: thread 32 w + 4 g + q's word j of chunk c
    holds at nibble 4 e + hr + 2 hc the code of row 16 w + 8 hr + g, column 64 c + 16 j +
    8 hc + 2 q + e (of its 64-row tile)."""
    n, k = 128, 128
    q = _codes(n, k, seed=1)
    words = pack_int4_wgmma(pack_int_weight(q, 4)).view(n // 64, k // 64, 4, 8, 4, 4)
    checked = 0
    for tile, c, w, g, lane_q, j in itertools.product(range(2), range(2), range(4), range(8),
                                                      range(4), range(4)):  # fmt: skip
        word = int(words[tile, c, w, g, lane_q, j]) & 0xFFFFFFFF
        for e, hr, hc in itertools.product(range(2), repeat=3):
            row = tile * 64 + 16 * w + 8 * hr + g
            col = 64 * c + 16 * j + 8 * hc + 2 * lane_q + e
            assert (word >> (4 * (4 * e + hr + 2 * hc))) & 0xF == int(q[row, col])
            checked += 1
    assert checked == n * k


def test_packing_refuses_shapes_off_the_tiles() -> None:
    with pytest.raises(ValueError, match="multiples of 64"):
        pack_int4_wgmma(pack_int_weight(_codes(96, 128), 4))


@pytest.mark.parametrize(
    ("m", "n", "k", "group"),
    [(1, 4096, 4096, 128), (1, 4096, 11008, 128), (1, 22016, 4096, 128), (8, 12288, 4096, 128),
     (16, 4096, 11008, 128), (33, 4096, 4096, 128), (64, 4096, 11008, 128),
     (1, 4096, 4096, 4096), (4, 4096, 4096, 256)],
)  # fmt: skip
def test_config_splits_k_in_whole_groups_within_shared_memory(m: int, n: int, k: int,
                                                               group: int) -> None:  # fmt: skip
    cfg = int4_wgmma_config(m, n, k, group)
    assert cfg.rows >= max(8, m) and cfg.rows & (cfg.rows - 1) == 0
    assert cfg.k_split % ITER_K == 0
    if group < k:
        assert cfg.k_split % group == 0  # a group's products never straddle two splits
    assert cfg.k_split * cfg.rows * 2 <= max(X_SLICE_BYTES, group * cfg.rows * 2)
    splits = -(-k // cfg.k_split)
    assert (splits - 1) * cfg.k_split < k  # no split is empty
    assert cfg.scale_on_acc == (cfg.rows <= 16)


def test_config_fills_the_gpu_at_one_row() -> None:
    cfg = int4_wgmma_config(1, 4096, 4096, 128)
    assert (4096 // 64) * (4096 // cfg.k_split) >= 132 * 4


def test_config_refuses_more_rows_than_it_serves() -> None:
    with pytest.raises(ValueError, match="up to 64 rows"):
        int4_wgmma_config(MAX_ROWS + 1, 4096, 4096, 128)


def test_supported_only_on_sm90_bf16_whole_groups() -> None:
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    assert not supported(x, 4096, 4096, 4, 128)  # on the CPU
    assert not supported(x, 4096, 4096, 8, 128)


def test_matmul_refuses_bad_operands_before_launching() -> None:
    q = pack_int4_wgmma(pack_int_weight(_codes(64, 256), 4))
    s = torch.ones(2, 64, dtype=torch.bfloat16)
    z = torch.full((2, 64), 8.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16"):
        int4_wgmma_matmul(torch.zeros(1, 256, dtype=torch.float16), q, s, z, 128)
    with pytest.raises(ValueError, match="whole"):
        int4_wgmma_matmul(torch.zeros(1, 256, dtype=torch.bfloat16), q,
                          torch.ones(4, 64, dtype=torch.bfloat16), z, 64)  # fmt: skip
    with pytest.raises(ValueError, match="codes"):
        int4_wgmma_matmul(torch.zeros(1, 128, dtype=torch.bfloat16), q, s, z, 128)


def _operands(n: int, k: int, group: int, symmetric: bool, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    if symmetric:
        zeros = torch.full((groups, n), 8.0)
    else:
        zeros = torch.randint(0, 16, (groups, n), generator=gen).float()
    return pack_int_weight(q, 4).cuda(), scales.cuda(), zeros.to(torch.bfloat16).cuda()


@requires_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17, 33, 64])
@pytest.mark.parametrize(("n", "k", "group", "symmetric"),
                         [(4096, 4096, 128, True), (1024, 11008, 128, False),
                          (512, 4096, 4096, False), (768, 2048, 256, True)])  # fmt: skip
@pytest.mark.parametrize("scale_on_acc", [True, False])
def test_gpu_matches_reference(m: int, n: int, k: int, group: int, symmetric: bool,
                               scale_on_acc: bool) -> None:  # fmt: skip
    qweight, scales, zeros = _operands(n, k, group, symmetric, seed=m + n)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    words = pack_int4_wgmma(qweight)
    cfg = int4_wgmma_config(m, n, k, group, scale_on_acc=scale_on_acc)
    ref = quant_matmul_ref(x, qweight, scales, zeros, 4, group).float()
    got = int4_wgmma_matmul(x, words, scales, zeros, group, config=cfg).float()
    err = (got - ref).abs().max().item()
    assert err <= 0.01 * ref.abs().max().item(), (cfg, err)


@requires_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("k_split", [128, 512, 4096])
def test_gpu_split_k_counters_are_left_zeroed_with_bias(k_split: int) -> None:
    n, k, group = 2048, 4096, 128
    qweight, scales, zeros = _operands(n, k, group, symmetric=False, seed=7)
    words = pack_int4_wgmma(qweight)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(n // 64, device="cuda", dtype=torch.int32)
    cfg = int4_wgmma_config(2, n, k, group)
    cfg = type(cfg)(rows=cfg.rows, k_split=k_split, scale_on_acc=True)
    for seed in range(3):  # the counters of one call serve the next
        torch.manual_seed(seed)
        x = torch.randn(2, k, device="cuda", dtype=torch.bfloat16)
        ref = quant_matmul_ref(x, qweight, scales, zeros, 4, group, bias).float()
        got = int4_wgmma_matmul(x, words, scales, zeros, group, bias, cfg, counters).float()
        assert (got - ref).abs().max().item() <= 0.01 * ref.abs().max().item()
    assert int(counters.abs().sum()) == 0


@requires_hopper
@pytest.mark.gpu
def test_gpu_strided_rows_of_a_wider_input() -> None:
    """x may be a view with a row stride wider than K (a slice of a fused output)."""
    n, k, group = 1024, 4096, 128
    qweight, scales, zeros = _operands(n, k, group, symmetric=True, seed=3)
    wide = torch.randn(5, 2 * k, device="cuda", dtype=torch.bfloat16)
    x = wide[:, k:]
    ref = quant_matmul_ref(x.contiguous(), qweight, scales, zeros, 4, group).float()
    got = int4_wgmma_matmul(x, pack_int4_wgmma(qweight), scales, zeros, group).float()
    assert (got - ref).abs().max().item() <= 0.01 * ref.abs().max().item()
