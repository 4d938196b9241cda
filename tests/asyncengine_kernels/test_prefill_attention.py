"""The sm_90 prefill kernel (`asyncengine_kernels.prefill_attention`) against the torch reference:
through
`paged_attention_triton` (which sends sequences with q_len >= PREFILL_TILE_MIN_QUERY_LEN to it)
in the CPU interpreter with small tiles, and at Llama sizes on a GPU."""

from __future__ import annotations

import importlib

import pytest
import torch

from asyncengine_kernels.paged_attention import paged_attention_ref, paged_attention_triton
from asyncengine_kernels.prefill_attention import prefill_attention_launch, prefill_tile_config
from tests.asyncengine_kernels.kernel_cases import (
    PagedBatch,
    assert_only_long_rows_written,
    llama_paged_batch,
    make_paged_batch,
    requires_cuda,
    to_fp8,
)

pa = importlib.import_module("asyncengine_kernels.paged_attention")

# Interpreter tiles: 32 rows, 16 keys, so short sequences span several full tiles and a
# diagonal of one or two.
SMALL = {"BLOCK_M": 32, "TILE": 16}
# (q_lens, seq_lens) with the prefill threshold at 8: a fresh prefill, a chunk over a cached
# prefix, a short chunk and decode rows left to the small-tile launch, a padding row.
FRESH = ([37], [37])
CHUNK = ([21], [70])
SEVERAL = ([12, 40, 9, 25], [12, 55, 9, 90])
MIXED = ([1, 30, 1, 5, 17, 1], [40, 30, 9, 20, 50, 0])


@pytest.fixture(autouse=True)
def _low_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short sequences take the prefill launch, so interpreter-sized cases exercise it."""
    monkeypatch.setattr(pa, "PREFILL_TILE_MIN_QUERY_LEN", 8)


def _check(batch: PagedBatch, atol: float, **kwargs: object) -> None:
    ref = paged_attention_ref(*batch.args(), **batch.scales())
    out = paged_attention_triton(*batch.args(), **batch.scales(), **kwargs)
    assert out.dtype == ref.dtype and not torch.isnan(out).any()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= atol, f"max abs error {err} > {atol}"


@pytest.mark.parametrize("case", [FRESH, CHUNK, SEVERAL, MIXED])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_prefill_matches_reference(
    case: tuple[list[int], list[int]], heads: tuple[int, int]
) -> None:
    batch = make_paged_batch(*case, *heads, head_dim=32, block_size=16, seed=1)
    _check(batch, atol=2e-5, large_tiles=SMALL)


@pytest.mark.parametrize("block_size", [8, 32])
def test_prefill_tiles_across_and_within_cache_blocks(block_size: int) -> None:
    """16-key tiles spanning two 8-slot blocks, and half of a 32-slot block."""
    batch = make_paged_batch(*SEVERAL, 8, 2, head_dim=32, block_size=block_size, seed=2)
    _check(batch, atol=2e-5, large_tiles=SMALL)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_head_dims(head_dim: int) -> None:
    batch = make_paged_batch(*CHUNK, 8, 2, head_dim=head_dim, seed=3)
    _check(batch, atol=2e-5, large_tiles=SMALL)


def test_prefill_padded_head_dim() -> None:
    """head_dim 40 runs in 64 lanes; the 24 padding lanes are neither read nor written."""
    batch = make_paged_batch(*MIXED, 6, 2, head_dim=40, seed=4)
    _check(batch, atol=2e-5, large_tiles=SMALL)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
def test_prefill_half_precision(dtype: torch.dtype, atol: float) -> None:
    batch = make_paged_batch(*SEVERAL, 8, 2, head_dim=64, dtype=dtype, seed=5)
    _check(batch, atol=atol, large_tiles=SMALL)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("per_head", [False, True])
def test_prefill_fp8_cache(heads: tuple[int, int], per_head: bool) -> None:
    batch = to_fp8(make_paged_batch(*MIXED, *heads, head_dim=32, seed=6), per_head)
    _check(batch, atol=2e-5, large_tiles=SMALL)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
def test_prefill_fp8_cache_half_precision_queries(dtype: torch.dtype, atol: float) -> None:
    batch = to_fp8(make_paged_batch(*CHUNK, 8, 2, head_dim=32, seed=7), per_head=True)
    batch.q = batch.q.to(dtype)
    _check(batch, atol=atol, large_tiles=SMALL)


def test_prefill_default_tiles() -> None:
    """The GPU configuration (128 rows, 64 keys) in the interpreter: one block per sequence,
    all of it on the diagonal but the prefix."""
    batch = make_paged_batch([70, 9], [150, 9], 8, 2, head_dim=32, seed=8)
    _check(batch, atol=2e-5)


@pytest.mark.parametrize(
    "cfg", [{"BLOCK_M": 16, "TILE": 32}, {"BLOCK_M": 64, "TILE": 16, "num_stages": 1}]
)
def test_prefill_tile_overrides_keep_the_result(cfg: dict[str, int]) -> None:
    batch = make_paged_batch(*SEVERAL, 8, 2, head_dim=32, seed=9)
    _check(batch, atol=2e-5, large_tiles=cfg)


def test_unified_large_tiles_still_available() -> None:
    """`prefill_kernel=False`: the same sequences on the unified kernel's large tiles."""
    batch = make_paged_batch(*MIXED, 8, 2, head_dim=32, seed=10)
    _check(batch, atol=2e-5, prefill_kernel=False, large_tiles=SMALL)


def test_launch_writes_only_long_sequences() -> None:
    """The prefill launch covers sequences with q_len >= its minimum and leaves the rows of
    the others (the small-tile launch's) as they were."""
    batch = make_paged_batch(*MIXED, 8, 2, head_dim=32, seed=11)
    out = torch.full_like(batch.q, 7.0)
    prefill_attention_launch(
        batch.q, batch.k_cache, batch.v_cache, out, batch.block_tables,
        batch.query_start_loc, batch.seq_lens, batch.scale * 1.4426950408889634, 8,
        overrides=SMALL,
    )  # fmt: skip
    ref = paged_attention_ref(*batch.args())
    assert_only_long_rows_written(out, ref, batch.query_start_loc, 8, 7.0, atol=2e-5)


@pytest.mark.parametrize("group", [1, 4, 8, 256])
@pytest.mark.parametrize("head_dim_pad,elem", [(128, 2), (128, 1), (256, 2), (64, 4)])
def test_tile_config_fits_the_heads(group: int, head_dim_pad: int, elem: int) -> None:
    """Every configuration packs whole head groups into its rows and keeps wgmma's shapes:
    rows a multiple of 64 (16 rows per warp of a warpgroup), keys a multiple of 16."""
    cfg = prefill_tile_config(group, head_dim_pad, elem)
    assert cfg["BLOCK_Q"] >= 1 and cfg["BLOCK_Q"] * group == cfg["BLOCK_M"]
    assert cfg["BLOCK_M"] % 64 == 0 and cfg["TILE"] % 16 == 0
    assert cfg["BLOCK_M"] >= 16 * cfg["num_warps"] and cfg["num_warps"] % 4 == 0


# ------------------------------------------------------------------ GPU, at Llama sizes


def _gpu_case(q_lens: list[int], seq_lens: list[int], num_kv_heads: int) -> PagedBatch:
    return llama_paged_batch(q_lens, seq_lens, 32, num_kv_heads, seed=12)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_kv_heads", [32, 8])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_prefill_long_prompts(
    num_kv_heads: int, fp8: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2048-token prompt, a 1000-token chunk over a 3000-token prefix, a 300-token prompt
    and decode rows in one step, at the engine's threshold; the unified large tiles agree."""
    monkeypatch.setattr(pa, "PREFILL_TILE_MIN_QUERY_LEN", 64)
    batch = _gpu_case([1, 2048, 1000, 1, 300, 37], [700, 2048, 4000, 0, 300, 90], num_kv_heads)
    if fp8:
        batch = to_fp8(batch, per_head=True)
    _check(batch, atol=2e-2)
    _check(batch, atol=2e-2, max_query_len=2048)
    _check(batch, atol=2e-2, prefill_kernel=False)


def test_sequence_with_no_keys_gives_zeros() -> None:
    """The start-up profile pass runs q_len tokens over seq_len 0 and a one-block table:
    every row sees no key, so the output is zeros and no tile is visited (a negative key
    count would walk the block table backwards)."""
    torch.manual_seed(12)
    q_len, heads, kv_heads, head_dim = 100, 8, 2, 32
    q = torch.randn(q_len, heads, head_dim)
    cache = torch.full((1, 16, kv_heads, head_dim), float("nan"))
    tables = torch.zeros(1, 1, dtype=torch.int32)
    qsl = torch.tensor([0, q_len], dtype=torch.int32)
    lens = torch.tensor([0], dtype=torch.int32)
    out = paged_attention_triton(
        q, cache, cache, tables, qsl, lens, head_dim**-0.5, max_query_len=q_len,
        large_tiles=SMALL,
    )  # fmt: skip
    assert torch.equal(out, torch.zeros_like(out))
