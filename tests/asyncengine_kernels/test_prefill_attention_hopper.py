"""The warp-specialized Gluon prefill kernel (`asyncengine_kernels.prefill_attention_hopper`)
against the torch reference at Llama sizes on an sm_90 GPU (Gluon kernels have no CPU interpreter),
and which launches it accepts."""

from __future__ import annotations

import importlib

import pytest
import torch

from asyncengine_kernels import prefill_attention_hopper as hopper
from asyncengine_kernels.paged_attention import paged_attention_ref, paged_attention_triton
from asyncengine_kernels.prefill_attention import prefill_attention_launch
from tests.asyncengine_kernels.kernel_cases import (
    PagedBatch,
    assert_only_long_rows_written,
    llama_paged_batch,
    to_fp8,
)

pa = importlib.import_module("asyncengine_kernels.paged_attention")
pf = importlib.import_module("asyncengine_kernels.prefill_attention")

requires_sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 GPU",
)


def _batch(
    q_lens: list[int],
    seq_lens: list[int],
    heads: tuple[int, int],
    seed: int = 21,
    block_size: int = 16,
) -> PagedBatch:
    return llama_paged_batch(q_lens, seq_lens, *heads, seed=seed, block_size=block_size)


def test_cpu_tensors_are_not_supported() -> None:
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 128, dtype=torch.bfloat16)
    assert not hopper.supported(q, cache, cache)


def test_a_kernel_that_does_not_build_falls_back_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With a Triton whose Gluon the kernel does not compile on, the first launch reports
    it, returns False (the caller runs the Triton kernel), and no later launch tries again."""
    monkeypatch.setattr(hopper, "_BUILD_FAILURE", [])
    monkeypatch.setattr(hopper, "_BUILT", set())
    monkeypatch.setattr(hopper, "_GLUON", True)
    monkeypatch.setattr(hopper, "supported", lambda *a: hopper.available())
    calls = []

    def broken(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise RuntimeError("async_copy_global_to_shared has been removed")

    monkeypatch.setattr(hopper, "hopper_prefill_launch", broken)
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 128, dtype=torch.bfloat16)
    args = (q, cache, cache, q, None, None, None, 0.1, 64)
    with caplog.at_level("WARNING", logger=hopper.__name__):
        assert hopper.try_hopper_prefill(*args) is False
        assert hopper.try_hopper_prefill(*args) is False
    assert len(calls) == 1 and not hopper.available()
    assert "does not build" in caplog.text and "has been removed" in caplog.text


@pytest.mark.gpu
@requires_sm90
def test_gpu_supported_shapes() -> None:
    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(2, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    assert hopper.supported(q, cache, cache)
    assert not hopper.supported(q.float(), cache.float(), cache.float())  # 32-bit
    assert not hopper.supported(q, cache.to(torch.float8_e4m3fn), cache)  # FP8 cache
    assert not hopper.supported(q[..., :64].contiguous(), cache[..., :64].contiguous(),
                                cache[..., :64].contiguous())  # head_dim 64  # fmt: skip
    odd = torch.zeros(2, 16, 5, 128, dtype=torch.bfloat16, device="cuda")
    assert not hopper.supported(torch.zeros(4, 15, 128, dtype=torch.bfloat16, device="cuda"),
                                odd, odd)  # group 3 does not divide 64 rows  # fmt: skip


# (q_lens, seq_lens): long prompts, a chunk over a cached prefix, decode rows and short
# chunks beside them (left to the small-tile launch), a partial last block, a padding row.
CASES = {
    "fresh": ([2048], [2048]),
    "chunk_over_prefix": ([1000], [4000]),
    "mixed": ([1, 2048, 1000, 1, 300, 37, 77], [700, 2048, 4000, 0, 300, 90, 77]),
    "short_tail": ([130, 65], [130, 65]),
}


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (64, 8)])
def test_gpu_hopper_matches_reference(
    case: str, heads: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pa, "PREFILL_TILE_MIN_QUERY_LEN", 64)
    monkeypatch.setattr(pf, "HOPPER_PREFILL", True)
    batch = _batch(*CASES[case], heads)
    assert hopper.supported(batch.q, batch.k_cache, batch.v_cache)
    ref = paged_attention_ref(*batch.args())
    out = paged_attention_triton(*batch.args())
    assert not torch.isnan(out).any()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2e-2, f"max abs error {err}"


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize(
    "cfg",
    [
        {"TILE": 64, "NUM_STAGES": 2, "PIPELINE": 0, "PINGPONG": 0},
        {"TILE": 128, "NUM_STAGES": 2, "PIPELINE": 0, "PINGPONG": 1},
        {"TILE": 64, "NUM_STAGES": 2, "PIPELINE": 1, "PINGPONG": 0},
        {"TILE": 64, "NUM_STAGES": 4, "PIPELINE": 1, "PINGPONG": 1},
        {"TILE": 128, "NUM_STAGES": 2, "PIPELINE": 1, "PINGPONG": 0},
        {"TILE": 128, "NUM_STAGES": 2, "PIPELINE": 1, "PINGPONG": 1},
    ],
)
def test_gpu_hopper_tile_shapes(cfg: dict[str, int]) -> None:
    batch = _batch(*CASES["mixed"], (32, 8))
    out = torch.full_like(batch.q, 7.0)
    hopper.hopper_prefill_launch(
        batch.q, batch.k_cache, batch.v_cache, out, batch.block_tables,
        batch.query_start_loc, batch.seq_lens, batch.scale * 1.4426950408889634, 64,
        overrides=cfg,
    )  # fmt: skip
    ref = paged_attention_ref(*batch.args())
    assert_only_long_rows_written(out, ref, batch.query_start_loc, 64, 7.0, atol=2e-2)


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("block_size", [8, 32])
def test_gpu_hopper_other_cache_block_sizes(
    block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight 8-slot blocks or two 32-slot blocks per 64-key tile (one TMA copy per block)."""
    monkeypatch.setattr(pa, "PREFILL_TILE_MIN_QUERY_LEN", 64)
    batch = _batch(*CASES["mixed"], (32, 8), seed=22, block_size=block_size)
    assert hopper.supported(batch.q, batch.k_cache, batch.v_cache)
    ref = paged_attention_ref(*batch.args())
    out = paged_attention_triton(*batch.args())
    assert (out.float() - ref.float()).abs().max().item() <= 2e-2


@pytest.mark.gpu
@requires_sm90
def test_gpu_hopper_agrees_with_the_triton_prefill_kernel() -> None:
    """Same sums in a different order: the two kernels agree to bf16 rounding."""
    batch = _batch([4096, 512], [4096, 2560], (32, 8))
    args = (batch.block_tables, batch.query_start_loc, batch.seq_lens,
            batch.scale * 1.4426950408889634, 64)  # fmt: skip
    ours = torch.zeros_like(batch.q)
    hopper.hopper_prefill_launch(batch.q, batch.k_cache, batch.v_cache, ours, *args)
    theirs = torch.zeros_like(batch.q)
    prefill_attention_launch(
        batch.q, batch.k_cache, batch.v_cache, theirs, *args, overrides={"TILE": 64}
    )
    torch.testing.assert_close(ours.float(), theirs.float(), atol=1.6e-2, rtol=0)


@pytest.mark.gpu
@requires_sm90
def test_gpu_hopper_no_keys_gives_zeros() -> None:
    """The start-up profile pass: q_len tokens over seq_len 0 and NaN everywhere."""
    q = torch.randn(300, 32, 128, dtype=torch.bfloat16, device="cuda")
    cache = torch.full((1, 16, 8, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = torch.full_like(q, 7.0)
    hopper.hopper_prefill_launch(
        q, cache, cache, out, torch.zeros(1, 1, dtype=torch.int32, device="cuda"),
        torch.tensor([0, 300], dtype=torch.int32, device="cuda"),
        torch.tensor([0], dtype=torch.int32, device="cuda"), 0.1, 64,
    )  # fmt: skip
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.gpu
@requires_sm90
def test_gpu_fp8_cache_keeps_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pa, "PREFILL_TILE_MIN_QUERY_LEN", 64)
    batch = to_fp8(_batch(*CASES["mixed"], (32, 8)), per_head=True)
    assert not hopper.supported(batch.q, batch.k_cache, batch.v_cache)
    ref = paged_attention_ref(*batch.args(), **batch.scales())
    out = paged_attention_triton(*batch.args(), **batch.scales())
    assert (out.float() - ref.float()).abs().max().item() <= 2e-2
