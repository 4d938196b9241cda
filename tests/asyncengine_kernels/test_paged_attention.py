"""Paged attention: the torch reference against a naive oracle, the Triton kernel (interpreter
on CPU, real at Llama sizes on a GPU) against the reference."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

from asyncengine_kernels import paged_attention
from asyncengine_kernels.paged_attention import paged_attention_ref, paged_attention_triton
from tests.asyncengine_kernels.kernel_cases import (
    PagedBatch,
    dequantized,
    llama_paged_batch,
    make_paged_batch,
    naive_paged_attention,
    requires_cuda,
    to_fp8,
)

# The submodule, not the function `asyncengine_kernels.paged_attention` re-exported by the package.
pa = importlib.import_module("asyncengine_kernels.paged_attention")

# (q_lens, seq_lens): decode rows, a padding row (seq_len 0), a fresh prefill, a chunked
# prefill over a cached prefix, page-crossing lengths.
MIXED = ([1, 1, 9, 1, 20, 1], [7, 0, 40, 33, 20, 16])
DECODE = ([1, 1, 1, 1, 1], [5, 0, 48, 17, 33])


def _assert_close(out: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not torch.isnan(out).any()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= atol, f"max abs error {err} > {atol}"


@pytest.mark.parametrize("case", [MIXED, DECODE, ([3], [3]), ([17, 2], [50, 2])])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 2)])
def test_reference_matches_naive(case: tuple[list[int], list[int]], heads: tuple[int, int]) -> None:
    batch = make_paged_batch(*case, *heads, head_dim=16, block_size=4)
    out = paged_attention_ref(*batch.args())
    expected = naive_paged_attention(batch)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)


def test_reference_writes_into_out_and_zeros_padding() -> None:
    batch = make_paged_batch(*DECODE, 4, 2, head_dim=8, block_size=4, table_pad=0)
    out = torch.full_like(batch.q, 7.0)
    res = paged_attention_ref(*batch.args(), out=out)
    assert res is out
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # the seq_len 0 row
    torch.testing.assert_close(out.double(), naive_paged_attention(batch), atol=2e-6, rtol=0)


@pytest.mark.parametrize("max_seq_len", [None, 48, 50])
def test_reference_decode_hints_change_nothing(max_seq_len: int | None) -> None:
    # The hints the runner passes (50 rounds past the table's last block) against the
    # naive oracle. Row 0 (7 tokens in blocks of 4) holds NaN in the slot past its end: a
    # slot it gathers but must not read.
    batch = make_paged_batch(*DECODE, 6, 2, head_dim=8, block_size=4)
    last = int(batch.block_tables[0, 1])
    batch.k_cache[last, 3] = float("nan")
    batch.v_cache[last, 3] = float("nan")
    out = paged_attention_ref(*batch.args(), decode_only=True, max_seq_len=max_seq_len)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # the seq_len 0 row
    torch.testing.assert_close(out.double(), naive_paged_attention(batch), atol=2e-6, rtol=0)


def test_dispatcher_uses_reference_on_cpu() -> None:
    batch = make_paged_batch(*MIXED, 4, 2, head_dim=8, block_size=4)
    torch.testing.assert_close(paged_attention(*batch.args()), paged_attention_ref(*batch.args()))


def _triton_vs_ref(batch: PagedBatch, atol: float, **kwargs: object) -> None:
    ref = paged_attention_ref(*batch.args(), **batch.scales())
    out = paged_attention_triton(*batch.args(), **batch.scales(), **kwargs)
    _assert_close(out, ref, atol)


# ------------------------------------------------------------------ FP8 cache


@pytest.mark.parametrize("case", [MIXED, DECODE])
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_reference_attends_over_the_dequantized_cache(
    case: tuple[list[int], list[int]], per_head: bool
) -> None:
    batch = to_fp8(make_paged_batch(*case, 8, 2, head_dim=16, block_size=4), per_head)
    out = paged_attention_ref(*batch.args(), **batch.scales())
    expected = naive_paged_attention(dequantized(batch))
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)
    # And close to the unquantized cache: e4m3 keeps 3 mantissa bits.
    exact = naive_paged_attention(make_paged_batch(*case, 8, 2, head_dim=16, block_size=4))
    assert (out.double() - exact).abs().max() < 0.25


def test_fp8_cache_without_scales_is_refused() -> None:
    batch = to_fp8(make_paged_batch(*DECODE, 4, 2, head_dim=8, block_size=4), False)
    with pytest.raises(ValueError, match="fp8 KV cache needs k_scale"):
        paged_attention(*batch.args())
    with pytest.raises(ValueError, match="fp8 KV cache needs v_scale"):
        paged_attention_triton(*batch.args(), k_scale=batch.k_scale)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("per_head", [False, True])
def test_triton_fp8_mixed_batch(heads: tuple[int, int], per_head: bool) -> None:
    batch = to_fp8(make_paged_batch(*MIXED, *heads, head_dim=32, seed=4), per_head)
    _triton_vs_ref(batch, atol=2e-5)


@pytest.mark.parametrize("segments", [1, 4])
def test_triton_fp8_decode(segments: int) -> None:
    batch = to_fp8(make_paged_batch(*DECODE, 8, 2, head_dim=32, block_size=8), True)
    _triton_vs_ref(batch, atol=2e-5, num_segments=segments, decode_only=True)


@pytest.mark.parametrize("segments", [1, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_triton_head_major_decode(segments: int, fp8: bool) -> None:
    """Head-major launch order changes which program runs which (sequence, head), not the
    result; it is refused outside decode-only steps."""
    batch = make_paged_batch(*DECODE, 8, 2, head_dim=32, block_size=8, seed=6)
    batch = to_fp8(batch, True) if fp8 else batch
    _triton_vs_ref(
        batch, atol=2e-5, num_segments=segments, decode_only=True, small_tiles={"HEAD_MAJOR": 1}
    )
    mixed = make_paged_batch(*MIXED, 8, 2, head_dim=32, seed=6)
    with pytest.raises(ValueError, match="HEAD_MAJOR"):
        paged_attention_triton(*mixed.args(), small_tiles={"HEAD_MAJOR": 1})


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
def test_triton_fp8_half_precision_queries(dtype: torch.dtype, atol: float) -> None:
    batch = make_paged_batch(*MIXED, 8, 2, head_dim=32, seed=7)
    batch = to_fp8(batch, per_head=True)
    batch.q = batch.q.to(dtype)
    _triton_vs_ref(batch, atol=atol)
    _triton_vs_ref(batch, atol=atol, max_query_len=64, large_tiles={"BLOCK_M": 32})


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1), (6, 2)])
def test_triton_mixed_batch(heads: tuple[int, int]) -> None:
    batch = make_paged_batch(*MIXED, *heads, head_dim=32, block_size=16)
    _triton_vs_ref(batch, atol=2e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
def test_triton_half_precision(dtype: torch.dtype, atol: float) -> None:
    batch = make_paged_batch(*MIXED, 8, 2, head_dim=64, block_size=16, dtype=dtype, seed=1)
    _triton_vs_ref(batch, atol=atol)


def test_triton_large_prefill_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long queries take the large-tile launch, short ones the small-tile launch."""
    monkeypatch.setattr(pa, "PREFILL_TILE_MIN_QUERY_LEN", 8)
    batch = make_paged_batch([1, 40, 5, 12], [30, 70, 5, 12], 8, 2, head_dim=32, seed=2)
    _triton_vs_ref(batch, atol=2e-5)
    _triton_vs_ref(batch, atol=2e-5, max_query_len=40)


def test_triton_max_query_len_hint_skips_large_launch() -> None:
    batch = make_paged_batch([3, 1, 6], [10, 22, 6], 4, 2, head_dim=16, seed=3)
    _triton_vs_ref(batch, atol=2e-5, max_query_len=6)


@pytest.mark.parametrize("segments", [2, 8])
def test_triton_split_kv_decode(segments: int) -> None:
    """Split-KV mode, including empty segments (short rows) and the padding row."""
    batch = make_paged_batch(*DECODE, 8, 2, head_dim=32, block_size=16, seed=4)
    _triton_vs_ref(batch, atol=2e-5, num_segments=segments)


def test_decode_plan_splits_small_batches_and_halves_for_short_contexts() -> None:
    cpu = torch.device("cpu")  # one "multiprocessor": only a single program splits
    assert pa.decode_plan(1, 1, cpu) == pa.DecodePlan(4, fuse_rotary=True)
    assert pa.decode_plan(1, 1, cpu, pa.SHORT_CONTEXT_KEYS + 1) == pa.DecodePlan(4, True)
    assert pa.decode_plan(1, 1, cpu, pa.SHORT_CONTEXT_KEYS) == pa.DecodePlan(2, True)
    # No split stays no split, and keeps the separate rotary kernel.
    assert pa.decode_plan(2, 1, cpu, 10) == pa.DecodePlan(1, fuse_rotary=False)
    assert pa.decode_plan(4, 2, cpu) == pa.DecodePlan(1, fuse_rotary=False)
    assert pa.decode_plan(1, 1, cpu, fuse_rotary=False) == pa.DecodePlan(4, fuse_rotary=False)


def test_small_tiles_for_many_decode_programs() -> None:
    """Unsplit decode launches with many programs per SM: for an FP8 cache one-warp CUDA-core
    tiles of one query row over 32 keys (MHA) or one-warp MMA tiles over 32 keys (GQA),
    64-key tiles for 16-bit MHA; fewer programs, split launches and other launches keep the
    earlier tiles."""
    many = pa.MANY_PROGRAMS_PER_SM
    fp8 = pa._small_tile_config(1, 1, False, many)
    assert (fp8["VECTOR"], fp8["BLOCK_M"], fp8["BLOCK_Q"]) == (1, 1, 1)
    assert (fp8["TILE"], fp8["num_warps"]) == (32, 1)
    fp8_gqa = pa._small_tile_config(4, 1, False, many)
    assert (fp8_gqa["TILE"], fp8_gqa["num_warps"], fp8_gqa["BLOCK_M"]) == (32, 1, 16)
    assert "VECTOR" not in fp8_gqa
    assert "VECTOR" not in pa._small_tile_config(4, 1, True)
    assert "VECTOR" not in pa._small_tile_config(1, 1, False, many - 1)
    assert "VECTOR" not in pa._small_tile_config(1, 1, True, many)
    assert pa._small_tile_config(1, 2, False, many)["TILE"] == 64
    gqa = pa._small_tile_config(4, 2, False, many)
    assert (gqa["TILE"], gqa["num_warps"]) == (64, 4)
    assert pa._small_tile_config(1, 1, False, many - 1)["TILE"] == 128
    assert pa._small_tile_config(1, 2, True, many)["num_warps"] == 4
    assert pa._small_tile_config(1, 2)["TILE"] == 32


def test_overrides_can_ask_for_mma_tiles_where_the_default_is_vector() -> None:
    """`VECTOR: 0` over the FP8 MHA default gives 16-row MMA tiles (the sweep's reference);
    overrides that leave VECTOR alone keep one row."""
    default = pa._small_tile_config(1, 1, False, pa.MANY_PROGRAMS_PER_SM)
    mma = pa._with_overrides(default, {"VECTOR": 0, "TILE": 32, "num_stages": 3}, 1)
    assert "VECTOR" not in mma and (mma["BLOCK_M"], mma["BLOCK_Q"], mma["TILE"]) == (16, 16, 32)
    mma = pa._with_overrides({**default, "LATE_V": 1}, {"VECTOR": 0}, 1)
    assert "LATE_V" not in mma
    kept = pa._with_overrides(default, {"TILE": 32}, 1)
    assert (kept["VECTOR"], kept["BLOCK_M"], kept["TILE"]) == (1, 1, 32)


def test_decode_plans_lists_every_plan_of_a_batch_size() -> None:
    cpu = torch.device("cpu")
    assert pa.decode_plans(1, 1, cpu) == (pa.DecodePlan(4, True), pa.DecodePlan(2, True))
    assert pa.decode_plans(2, 1, cpu) == (pa.DecodePlan(1, False),)
    for plan in pa.decode_plans(1, 1, cpu):
        hint = pa.SHORT_CONTEXT_KEYS if plan.segments == 2 else None
        assert pa.decode_plan(1, 1, cpu, hint) == plan


@pytest.mark.parametrize("segments", [1, 2])
def test_triton_split_count_changes_the_launch_not_the_result(segments: int) -> None:
    batch = make_paged_batch([1], [48], 2, 1, head_dim=16, block_size=8, seed=7)
    _triton_vs_ref(batch, atol=2e-5, decode_only=True, num_segments=segments)


def test_dispatcher_hands_the_split_count_to_triton_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """`num_segments` reaches the Triton path; the reference gets the context hint."""
    seen: dict[str, object] = {}
    batch = make_paged_batch(*DECODE, 4, 2, head_dim=8, block_size=4)

    def fake_triton(*args: object, **kwargs: object) -> str:
        seen["triton"] = kwargs
        return "triton"

    def fake_ref(*args: object, **kwargs: object) -> str:
        seen["ref"] = kwargs
        return "ref"

    monkeypatch.setattr(pa, "paged_attention_triton", fake_triton)
    monkeypatch.setattr(pa, "paged_attention_ref", fake_ref)
    scales = {"k_scale": torch.ones(2), "v_scale": torch.ones(2)}  # both paths get them
    hints = {"decode_only": True, "max_seq_len": 48, "num_segments": 4, **scales}
    monkeypatch.setattr(pa, "use_triton", lambda _: True)
    assert paged_attention(*batch.args(), **hints) == "triton"  # type: ignore[arg-type]
    monkeypatch.setattr(pa, "use_triton", lambda _: False)
    assert paged_attention(*batch.args(), **hints) == "ref"  # type: ignore[arg-type]
    assert seen["triton"] == {
        "max_query_len": None, "decode_only": True, "num_segments": 4, **scales
    }
    assert seen["ref"] == {"max_query_len": None, "decode_only": True, "max_seq_len": 48, **scales}


def test_triton_tile_overrides_keep_the_result() -> None:
    """The tuning overrides (benchmark sweeps) change the launch configuration only."""
    batch = make_paged_batch([1, 40, 5], [30, 70, 5], 8, 2, head_dim=32, seed=2)
    _triton_vs_ref(batch, atol=2e-5, small_tiles={"TILE": 64, "num_stages": 1})
    _triton_vs_ref(batch, atol=2e-5, max_query_len=64, large_tiles={"BLOCK_M": 32, "TILE": 32})
    dec = make_paged_batch([1, 1], [30, 9], 8, 2, head_dim=32, seed=3)
    _triton_vs_ref(dec, atol=2e-5, decode_only=True, num_segments=2, small_tiles={"TILE": 16})


# The CUDA-core decode tiles for MHA: one query row a program, no 16-row MMA tile.
VECTOR_TILES = {"VECTOR": 1, "TILE": 32, "num_warps": 1}


@pytest.mark.parametrize("segments", [1, 4])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tile", [8, 32])
def test_triton_mha_decode_on_cuda_cores(segments: int, fp8: bool, tile: int) -> None:
    """VECTOR tiles compute the scores and P @ V as products and sums: the result of the MMA
    tiles, for 16-bit and e4m3 caches, split or not, head-major or not, their loop pipelined
    or not (KV_STAGES), V requested early or after the scores (LATE_V), with a padding row
    and ragged tiles; a KV head with several query heads is refused."""
    batch = make_paged_batch(*DECODE, 4, 4, head_dim=32, block_size=8, seed=8)
    batch = to_fp8(batch, per_head=True) if fp8 else batch
    for head_major, stages, late_v in ((0, None, 0), (1, 3, 0), (1, None, 1)):
        tiles = {**VECTOR_TILES, "TILE": tile, "HEAD_MAJOR": head_major, "KV_STAGES": stages,
                 "LATE_V": late_v}  # fmt: skip
        _triton_vs_ref(batch, atol=2e-5, num_segments=segments, decode_only=True,
                       small_tiles=tiles)  # fmt: skip
    gqa = make_paged_batch(*DECODE, 8, 2, head_dim=32, block_size=8, seed=8)
    with pytest.raises(ValueError, match="one query row"):
        paged_attention_triton(*gqa.args(), decode_only=True, small_tiles=VECTOR_TILES)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
def test_triton_mha_decode_on_cuda_cores_half_precision(dtype: torch.dtype, atol: float) -> None:
    """16-bit queries over a 16-bit cache and over an e4m3 cache, in float32 throughout."""
    batch = make_paged_batch(*DECODE, 4, 4, head_dim=64, block_size=16, dtype=dtype, seed=9)
    _triton_vs_ref(batch, atol=atol, decode_only=True, small_tiles=VECTOR_TILES)
    batch = make_paged_batch(*DECODE, 4, 4, head_dim=64, block_size=16, seed=9)
    batch = to_fp8(batch, per_head=True)
    batch.q = batch.q.to(dtype)
    _triton_vs_ref(batch, atol=atol, decode_only=True, small_tiles=VECTOR_TILES)


def test_triton_split_kv_with_multi_token_rows() -> None:
    """Split mode is general: a T == B batch that is not all decodes stays correct (only
    `decode_only` promises one token per sequence)."""
    batch = make_paged_batch([2, 0, 1], [9, 4, 40], 4, 1, head_dim=16, block_size=8, seed=5)
    _triton_vs_ref(batch, atol=2e-5, num_segments=4)


@pytest.mark.parametrize("segments", [1, 4])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_triton_decode_only_path(segments: int, heads: tuple[int, int]) -> None:
    """`decode_only`: programs take token b as sequence b without searching query_start_loc;
    a padding row (seq_len 0) still gives zeros."""
    batch = make_paged_batch([1, 1, 1, 1], [9, 1, 40, 0], *heads, head_dim=16, block_size=8)
    _triton_vs_ref(batch, atol=2e-5, num_segments=segments, decode_only=True)


def test_triton_odd_head_dim_and_out_views() -> None:
    """head_dim 40 (padded to 64), q as a strided view of a fused qkv, `out` given."""
    num_heads, num_kv_heads, head_dim = 6, 2, 40
    batch = make_paged_batch(*MIXED, num_heads, num_kv_heads, head_dim=head_dim, seed=6)
    qkv = torch.randn(batch.q.shape[0], (num_heads + 2 * num_kv_heads) * head_dim)
    q_view = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    q_view.copy_(batch.q)
    out = torch.full_like(batch.q, float("nan"))
    args = list(batch.args())
    args[0] = q_view
    res = paged_attention_triton(*args, out=out)
    assert res is out
    _assert_close(out, paged_attention_ref(*batch.args()), atol=2e-5)


def test_triton_padding_rows_only() -> None:
    """A batch of CUDA-graph padding rows only: zeros, no table dereference."""
    batch = make_paged_batch([1, 1], [0, 0], 4, 2, head_dim=16, table_pad=-(2**30))
    out = paged_attention_triton(*batch.args())
    assert torch.equal(out, torch.zeros_like(out))


# ------------------------------------------------------------------ GPU, at Llama sizes


def _gpu_case(
    q_lens: list[int], seq_lens: list[int], num_kv_heads: int, seed: int = 0
) -> PagedBatch:
    return llama_paged_batch(q_lens, seq_lens, 32, num_kv_heads, seed)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_kv_heads", [32, 8])
@pytest.mark.parametrize("batch_size,ctx", [(1, 4000), (7, 1000), (64, 700), (256, 300)])
def test_gpu_decode(num_kv_heads: int, batch_size: int, ctx: int) -> None:
    gen = torch.Generator().manual_seed(batch_size)
    lens = torch.randint(1, ctx + 1, (batch_size,), generator=gen).tolist()
    lens[0] = ctx
    if batch_size > 1:
        lens[-1] = 0  # a padding row
    batch = _gpu_case([1] * batch_size, lens, num_kv_heads)
    ref = paged_attention_ref(*batch.args())
    _assert_close(paged_attention_triton(*batch.args()), ref, atol=2e-2)
    for segments in (1, 16):
        out = paged_attention_triton(*batch.args(), num_segments=segments, decode_only=True)
        _assert_close(out, ref, atol=2e-2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_kv_heads", [32, 8])
def test_gpu_mixed_and_prefill(num_kv_heads: int) -> None:
    q_lens = [1, 1, 512, 1, 300, 37, 1, 2000]
    seq_lens = [900, 0, 512, 3000, 1324, 100, 5, 4000]
    batch = _gpu_case(q_lens, seq_lens, num_kv_heads, seed=1)
    ref = paged_attention_ref(*batch.args())
    _assert_close(paged_attention_triton(*batch.args()), ref, atol=2e-2)
    _assert_close(paged_attention_triton(*batch.args(), max_query_len=2000), ref, atol=2e-2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_kv_heads", [32, 8])
@pytest.mark.parametrize("per_head", [False, True])
def test_gpu_fp8_decode_and_prefill(num_kv_heads: int, per_head: bool) -> None:
    """FP8 cache at Llama sizes: split-KV decode (1 and 16 segments) up to 4k keys, and a
    mixed batch through both tile launches, against the reference on the same e4m3 cache."""
    gen = torch.Generator().manual_seed(num_kv_heads)
    lens = torch.randint(1, 4001, (7,), generator=gen).tolist()
    lens[0], lens[-1] = 4000, 0
    batch = to_fp8(_gpu_case([1] * 7, lens, num_kv_heads), per_head)
    ref = paged_attention_ref(*batch.args(), **batch.scales())
    for segments, head_major in itertools.product((1, 16), (0, 1)):
        out = paged_attention_triton(
            *batch.args(), **batch.scales(), num_segments=segments, decode_only=True,
            small_tiles={"HEAD_MAJOR": head_major},
        )  # fmt: skip
        _assert_close(out, ref, atol=2e-2)
    q_lens = [1, 1, 512, 1, 300, 37, 1, 2000]
    seq_lens = [900, 0, 512, 3000, 1324, 100, 5, 4000]
    mixed = to_fp8(_gpu_case(q_lens, seq_lens, num_kv_heads, seed=1), per_head)
    ref = paged_attention_ref(*mixed.args(), **mixed.scales())
    _assert_close(paged_attention_triton(*mixed.args(), **mixed.scales()), ref, atol=2e-2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("batch_size,ctx", [(7, 4000), (256, 640)])
def test_gpu_mha_decode_on_cuda_cores(fp8: bool, batch_size: int, ctx: int) -> None:
    """The CUDA-core MHA decode tiles at Llama-2-7B's heads, unsplit and split, at tiles,
    warps and loop stages from the range `bench_kernels.py --only kvfp8` sweeps, and the
    default tiles (VECTOR for 256 sequences over an e4m3 cache), against the reference."""
    gen = torch.Generator().manual_seed(batch_size)
    lens = torch.randint(1, ctx + 1, (batch_size,), generator=gen).tolist()
    lens[0], lens[-1] = ctx, 0
    batch = _gpu_case([1] * batch_size, lens, 32)
    batch = to_fp8(batch, per_head=True) if fp8 else batch
    ref = paged_attention_ref(*batch.args(), **batch.scales())
    default = paged_attention_triton(*batch.args(), **batch.scales(), decode_only=True)
    _assert_close(default, ref, atol=2e-2)
    swept = ((64, 1, None, 0), (32, 4, 3, 0), (64, 2, 3, 0), (128, 4, None, 0),
             (128, 1, None, 1))  # fmt: skip
    for (tile, warps, stages, late_v), segments in itertools.product(swept, (1, 16)):
        tiles = {**VECTOR_TILES, "TILE": tile, "num_warps": warps, "KV_STAGES": stages,
                 "LATE_V": late_v}  # fmt: skip
        out = paged_attention_triton(
            *batch.args(), **batch.scales(), decode_only=True, num_segments=segments,
            small_tiles=tiles,
        )  # fmt: skip
        _assert_close(out, ref, atol=2e-2)


@pytest.mark.gpu
@requires_cuda
def test_gpu_fp32_and_cuda_graph_decode() -> None:
    """fp32 (IEEE dots) matches tightly; a captured decode graph replays with new lengths."""
    batch = make_paged_batch(
        [1] * 8, [100, 0, 33, 400, 17, 250, 64, 1], 32, 8, head_dim=128,
        dtype=torch.float32, device="cuda", seed=2,
    )  # fmt: skip
    ref = paged_attention_ref(*batch.args())
    _assert_close(paged_attention_triton(*batch.args()), ref, atol=1e-4)

    out = torch.empty_like(batch.q)
    lens = batch.seq_lens.clone()
    args = list(batch.args())
    args[5] = lens
    segments = pa.decode_plan(8, 8, torch.device("cuda")).segments
    paged_attention(*args, out=out, decode_only=True, num_segments=segments)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*args, out=out, decode_only=True, num_segments=segments)
    lens.copy_(torch.tensor([50, 0, 3, 400, 1, 200, 64, 0], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(out, paged_attention_ref(*args), atol=1e-4)
