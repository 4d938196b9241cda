"""Prefill attention over the paged KV cache, shaped for Hopper's tensor cores (sm_90).

The launch `paged_attention_triton` uses for sequences with at least
`PREFILL_TILE_MIN_QUERY_LEN` query tokens (fresh prompts and long prefill chunks); decode
rows and short chunks of the same step stay on the unified kernel's small-tile launch.
Same contract as `asyncengine_kernels.paged_attention.paged_attention_ref` for those sequences.

A program owns one KV head and `BLOCK_Q` query tokens of one sequence, with the G query heads
of that KV head packed into the `BLOCK_M = BLOCK_Q * G` rows of the MMA tile, as in the unified
kernel. Differences that matter on sm_90:
- Large tiles (128 rows, 8 warps = two warpgroups) so that `tl.dot` lowers to `wgmma`, which
  needs at least 64 rows per warpgroup; the Q tile is loaded once and reused by every key tile.
- The key loop is split: tiles every row of the block sees in full (the cached prefix and the
  keys before the block's first query) run without masks or bounds checks and are software
  pipelined (`num_stages`); only the one to three tiles on the causal diagonal are masked.
- The softmax scale is folded into exp2's argument: one FMA per score, no separate scaling.

Why pack GQA heads rather than give each query head its own program: per KV head the two
read the same K/V bytes per query row (a 128-row tile serves 32 tokens x 4 heads, or 128
tokens x 1 head), but a packed block spans 32 query positions instead of 128, so its causal
diagonal covers fewer masked tiles and wastes fewer MMA lanes.

Why every key comes from the paged cache, the step's own tokens included, rather than
the fresh K/V from contiguous tensors (which would allow TMA descriptors): the rotary kernel
writes K/V to the cache before attention anyway, so reading them back costs no extra
kernel; with an FP8 cache the fresh keys must be attended to as stored (e4m3) to match the
reference and every later step, so a contiguous copy would have to be quantized as well;
and one address path keeps prefix-cached and chunked prefill identical. A 128-key tile then
gathers 8 cache blocks of 16 rows: each row is one contiguous head_dim run, which Triton
loads with asynchronous 16-byte copies (`cp.async`) into shared memory, pipelined across
tiles; TMA cannot gather rows on sm_90.

FP8 cache: K and V tiles load as e4m3 and convert to the query dtype (exact); the KV head's
K scale joins the softmax scale and its V scale multiplies the output, once per program.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from asyncengine_kernels._triton_utils import next_power_of_2, pdl_kwargs, pdl_wait, tl, triton
from asyncengine_kernels.kv_cache_write import check_kv_scales, is_fp8_kv
from asyncengine_kernels.paged_attention import _causal_keys, _query_block, _query_rows

__all__ = ["HOPPER_PREFILL", "prefill_attention_launch", "prefill_tile_config"]

# The warp-specialized Gluon kernel (`asyncengine_kernels.prefill_attention_hopper`) serves what it
# supports on sm_90. Only benchmarks turn it off, to compare (`bench_kernels --only prefill`,
# `bench_throughput --no-hopper-prefill`); a Triton that cannot build it falls back by itself.
HOPPER_PREFILL = True


def prefill_tile_config(group: int, head_dim_pad: int, elem_size: int) -> dict[str, int]:
    """Launch configuration of the prefill kernel: tile shape, warps and pipeline depth.

    Chosen on Hopper's constraints, to be confirmed by `scripts/bench_kernels.py --only
    prefill` (which sweeps BLOCK_M, TILE, warps and stages on an H200): `wgmma` takes 64 rows
    per warpgroup, so 128 rows run on 8 warps (two warpgroups); 64-key tiles keep the fp32
    scores (128 x 64) and the accumulator (128 x head_dim) in registers without spilling at
    head_dim 128 (about 200 registers a thread, so one program per multiprocessor); at
    that occupancy three stages are what lets the K/V copies run two tiles ahead (with two,
    sm_90 lowering waits for every copy at the top of each iteration), and three stages of
    K and V plus Q take 128 KB of shared memory. head_dim 256 or fp32 queries halve the
    tiles, and an FP8 cache keeps the 16-bit shape (its tiles are converted before the MMA).
    `group` > 128 query heads per KV head widens BLOCK_M to hold them.
    """
    big = head_dim_pad <= 128 and elem_size <= 2
    block_m = max(128 if big else 64, next_power_of_2(group))
    return {
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // group,
        "TILE": 64 if big else 32,
        "num_warps": 8 if big else 4,
        "num_stages": 3 if big else 1,
    }


@triton.jit
def _mma(a, b, acc, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b. DOT_FP32: the interpreter multiplies bf16 bit patterns, so upcast there."""
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _block_ids(bt_row_ptr, start, num_keys, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Cache block of each key start .. start + TILE - 1 (0 past `num_keys`: never read)."""
    offs_t = start + tl.arange(0, TILE)
    return tl.load(bt_row_ptr + offs_t // BLOCK_SIZE, mask=offs_t < num_keys, other=0)


@triton.jit
def _kv_tile_ptrs(
    k_base, v_base, blk, start, num_keys, offs_d,
    stride_kb, stride_ks, stride_vb, stride_vs,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """Pointers to keys start .. start + TILE - 1 of one KV head, in cache blocks `blk`, and
    their load mask; MASKED: keys past `num_keys` are not loaded (unwritten slots may hold
    NaN, and 0 * NaN would poison P @ V)."""
    offs_t = start + tl.arange(0, TILE)
    if MASKED:
        mask = (offs_t < num_keys)[:, None] & (offs_d < HEAD_DIM)[None, :]
    else:
        mask = (offs_d < HEAD_DIM)[None, :]
    blk = blk.to(tl.int64)
    slot = (offs_t % BLOCK_SIZE).to(tl.int64)
    k_ptrs = k_base + (blk * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :]
    v_ptrs = v_base + (blk * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :]
    return k_ptrs, v_ptrs, mask


@triton.jit
def _load(ptrs, mask, dt, MASKED: tl.constexpr, D_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A K or V tile in the dot dtype `dt` (an e4m3 tile converts exactly)."""
    if MASKED or D_PAD != HEAD_DIM:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        x = tl.load(ptrs)
    return x.to(dt)


# The block-table width and the batch change from step to step; specializing on them
# (== 1, divisible by 16) would compile new variants mid-serving.
@triton.jit(do_not_specialize=["num_seqs", "q_len_lo", "stride_bt"])
def _prefill_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    num_seqs,
    q_len_lo,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
    KV_FP8: tl.constexpr = False,
    KV_DOT_F16: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    kv_head = tl.program_id(1)
    # Sequences below q_len_lo are the small-tile launch's; no upper bound.
    seq_idx, q_start, q_len, q_block_start, mine = _query_block(
        query_start_loc_ptr, num_seqs, q_len_lo, 2147483647, BLOCK_Q=BLOCK_Q
    )
    if not mine:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    ctx_len = seq_len - q_len  # cached keys before this step's first query

    # KV_DOT_F16: e4m3 tiles widen to fp16 in one instruction per two values (to bf16 they
    # go through fp16 and three), so a 16-bit query joins them in fp16 (fp32 accumulation).
    dt = tl.float16 if KV_DOT_F16 else q_ptr.dtype.element_ty
    scale = scale_log2
    if KV_FP8:
        # Scores are q . (k_scale * code) = k_scale * (q . code): the K scale joins the
        # softmax scale.
        scale = scale * tl.load(k_scale_ptr + kv_head)

    offs_d, q_pos, head, _, tok, q_offs, q_mask = _query_rows(
        q_start, q_block_start, q_len, kv_head, stride_qt, stride_qh,
        BLOCK_M=BLOCK_M, BLOCK_Q=BLOCK_Q, GROUP=GROUP, D_PAD=D_PAD, HEAD_DIM=HEAD_DIM,
    )  # fmt: skip
    Q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(dt)
    q_abs = ctx_len + q_pos
    num_keys, num_tiles, num_full = _causal_keys(
        ctx_len, q_block_start, q_len, BLOCK_Q=BLOCK_Q, TILE=TILE
    )

    bt_row_ptr = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    L = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    # Off the diagonal: no masks, every row sees every key, so the running max is finite
    # after the first tile and needs no -inf guard.
    # The block ids of the next tile are read one iteration ahead: a K/V address that
    # waits on a table load issued in the same iteration would serialize the pipeline.
    blk = _block_ids(bt_row_ptr, 0, num_keys, TILE=TILE, BLOCK_SIZE=BLOCK_SIZE)
    for tile in range(0, num_full):
        k_ptrs, v_ptrs, kv_mask = _kv_tile_ptrs(
            k_base, v_base, blk, tile * TILE, num_keys, offs_d,
            stride_kb, stride_ks, stride_vb, stride_vs,
            HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK_SIZE=BLOCK_SIZE, TILE=TILE, MASKED=False,
        )  # fmt: skip
        K = _load(k_ptrs, kv_mask, dt, MASKED=False, D_PAD=D_PAD, HEAD_DIM=HEAD_DIM)
        S = _mma(Q, tl.trans(K), tl.zeros([BLOCK_M, TILE], tl.float32), DOT_FP32, IEEE)
        m_new = tl.maximum(M, tl.max(S, axis=1) * scale)
        P = tl.exp2(S * scale - m_new[:, None])
        alpha = tl.exp2(M - m_new)
        L = L * alpha + tl.sum(P, axis=1)
        V = _load(v_ptrs, kv_mask, dt, MASKED=False, D_PAD=D_PAD, HEAD_DIM=HEAD_DIM)
        acc = _mma(P.to(dt), V, acc * alpha[:, None], DOT_FP32, IEEE)
        M = m_new
        blk = _block_ids(bt_row_ptr, (tile + 1) * TILE, num_keys, TILE=TILE, BLOCK_SIZE=BLOCK_SIZE)
    # The diagonal: causal mask and bounds. A row may see no key of a tile (or none at all
    # when it is past the sequence's end): keep its max at -inf and exp2's argument finite.
    for tile in range(num_full, num_tiles):
        blk = _block_ids(bt_row_ptr, tile * TILE, num_keys, TILE=TILE, BLOCK_SIZE=BLOCK_SIZE)
        k_ptrs, v_ptrs, kv_mask = _kv_tile_ptrs(
            k_base, v_base, blk, tile * TILE, num_keys, offs_d,
            stride_kb, stride_ks, stride_vb, stride_vs,
            HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK_SIZE=BLOCK_SIZE, TILE=TILE, MASKED=True,
        )  # fmt: skip
        K = _load(k_ptrs, kv_mask, dt, MASKED=True, D_PAD=D_PAD, HEAD_DIM=HEAD_DIM)
        S = _mma(Q, tl.trans(K), tl.zeros([BLOCK_M, TILE], tl.float32), DOT_FP32, IEEE)
        offs_t = tile * TILE + tl.arange(0, TILE)
        visible = (offs_t[None, :] <= q_abs[:, None]) & (offs_t < num_keys)[None, :]
        S = tl.where(visible, S * scale, float("-inf"))
        m_new = tl.maximum(M, tl.max(S, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        P = tl.exp2(S - m_safe[:, None])
        alpha = tl.exp2(M - m_safe)
        L = L * alpha + tl.sum(P, axis=1)
        V = _load(v_ptrs, kv_mask, dt, MASKED=True, D_PAD=D_PAD, HEAD_DIM=HEAD_DIM)
        acc = _mma(P.to(dt), V, acc * alpha[:, None], DOT_FP32, IEEE)
        M = m_new

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)  # P @ (v_scale * code) = v_scale * (P @ code)
    out = acc / tl.where(L == 0.0, 1.0, L)[:, None]  # rows with no keys give zeros
    o_offs = tok[:, None] * stride_ot + (head * stride_oh)[:, None] + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_attention_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale_log2: float,
    min_query_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    dot_fp32: bool = False,
    pdl: bool = False,
    overrides: Mapping[str, int] | None = None,
) -> None:
    """Attention of every sequence with at least `min_query_len` query tokens into `out`
    (the rows of the other sequences are left as they are). `scale_log2` is the softmax
    scale times log2(e); an FP8 cache comes with `k_scale` / `v_scale` (float32 [Hkv]).
    `overrides` replaces entries of `prefill_tile_config` (BLOCK_Q follows BLOCK_M); with
    none, a launch the Hopper kernel supports runs there (`HOPPER_PREFILL`)."""
    if HOPPER_PREFILL and not overrides and not dot_fp32:
        from asyncengine_kernels.prefill_attention_hopper import try_hopper_prefill

        if try_hopper_prefill(
            q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, scale_log2,
            min_query_len,
        ):  # fmt: skip
            return
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    d_pad = max(16, next_power_of_2(head_dim))
    cfg = {**prefill_tile_config(group, d_pad, k_cache.element_size()), **(overrides or {})}
    cfg["BLOCK_Q"] = cfg["BLOCK_M"] // group
    if cfg["BLOCK_Q"] < 1:
        raise ValueError(f"BLOCK_M {cfg['BLOCK_M']} holds fewer rows than the {group} heads")
    kv_fp8 = is_fp8_kv(k_cache)
    check_kv_scales(k_cache, k_scale, v_scale)
    scales = (k_scale, v_scale) if kv_fp8 else (q, q)  # unused unless KV_FP8
    grid = (num_tokens // cfg["BLOCK_Q"] + num_seqs, num_kv_heads)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, *scales,
        scale_log2, num_seqs, min_query_len,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, GROUP=group,
        DOT_FP32=dot_fp32, IEEE=q.dtype == torch.float32 or dot_fp32, USE_PDL=pdl,
        KV_FP8=kv_fp8, KV_DOT_F16=kv_fp8 and q.dtype != torch.float32, **cfg,
        **pdl_kwargs(pdl),
    )  # fmt: skip
