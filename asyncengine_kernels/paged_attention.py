"""Paged attention over a block-table KV cache for mixed prefill/decode batches.

One op covers decode (q_len 1), fresh prefill, chunked prefill over a cached prefix and any
mix of them in one flattened step. Query j of sequence b sits at absolute position
`seq_lens[b] - q_len_b + j` and attends causally to key positions 0..that position; key
position p lives in block `block_tables[b, p // block_size]` at offset `p % block_size`.

Three implementations share the signature:
- `paged_attention_ref`: plain torch, the CPU path and the test oracle. Decode rows are
  batched (one gather + two batched matmuls); only sequences with q_len > 1 are looped.
- `paged_attention_triton`: one unified Triton kernel. A program owns one KV head and a
  block of `BLOCK_Q` query tokens of one sequence; the `G = Hq // Hkv` query heads of that KV
  head are packed with the tokens into the `BLOCK_M = BLOCK_Q * G` rows of the `tl.dot` tile,
  so each K/V tile is read once per KV head. The kernel also runs in split-KV mode
  (flash-decoding: several programs per row block, each over a segment of the keys, merged by
  a reduce kernel) for decode batches too small to fill the GPU. Grids depend on T, B and
  constants only, so the decode path can be captured in a CUDA graph. Sequences with at
  least `PREFILL_TILE_MIN_QUERY_LEN` query tokens go to the sm_90-shaped prefill kernel
  (`asyncengine_kernels.prefill_attention`) instead, in a second launch of the same step.
- `paged_attention`: the dispatcher (Triton for CUDA tensors, the reference otherwise).

An FP8 cache (e4m3, `asyncengine_kernels.kv_cache_write`) comes with K and V scales per KV head. The
reference dequantizes what it gathers and computes in float32. The kernel loads the e4m3
tiles and converts them to the query dtype (exact: every e4m3 value is a bf16/fp16 value);
since a program owns one KV head, its K scale folds into the softmax scale and its V scale
into the output, so the scales cost two scalar loads per program and nothing per key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncengine_kernels._triton_utils import (
    INLINE_PTX,
    interpreter_enabled,
    next_power_of_2,
    num_sms,
    pdl_kwargs,
    pdl_wait,
    tl,
    triton,
    use_pdl,
    use_triton,
)
from asyncengine_kernels.kv_cache_write import (
    check_kv_scales,
    dequantize_kv,
    is_fp8_kv,
    quantize_fp8,
)

__all__ = [
    "DecodePlan",
    "DecodeRotary",
    "decode_gather_index",
    "decode_plan",
    "decode_plans",
    "decode_rows_attention",
    "paged_attention",
    "paged_attention_ref",
    "paged_attention_triton",
]


@dataclass(frozen=True)
class DecodePlan:
    """How a decode-only step runs attention, decided once per step by the model runner
    (`decode_plan`) and read by the CUDA-graph key, the attention layer and the kernel.

    segments: split-KV segments per row block (1 = no split); fuse_rotary: rotary and the
    K/V cache write run inside the attention kernel (`paged_decode_attention_with_rotary`)."""

    segments: int = 1
    fuse_rotary: bool = False


@dataclass(frozen=True)
class DecodeRotary:
    """What a decode step's attention needs to apply rotary and write this step's K/V
    itself: k and v are [B, Hkv, D] views (unrotated), cos_sin_cache is
    `asyncengine_kernels.rotary`'s."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor

_LOG2E = 1.4426950408889634  # log2(e): the kernels use exp2 with the scale folded in

# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    decode_only: bool = False,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged causal attention in plain torch (fp32 math); returns [T, Hq, D] in q.dtype.
    An FP8 cache is dequantized with `k_scale` / `v_scale` (float32 [Hkv]) as it is read.

    `decode_only` and `max_seq_len` are host hints, as on the Triton path: a caller passing
    `decode_only=True` vouches that every sequence has one query token, and `max_seq_len`
    that no context is longer; they spare this path reading the metadata back in every
    layer. Without them it finds both itself. `max_query_len` is accepted and ignored.
    """
    del max_query_len
    check_kv_scales(k_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    device = q.device
    lens = seq_lens.to(torch.int64)
    num_seqs = lens.numel()
    if num_tokens == num_seqs and (decode_only or bool((query_start_loc.diff() == 1).all())):
        if max_seq_len is not None:
            max_len = max_seq_len
        else:
            max_len = int(lens.max()) if num_tokens else 0
        if max_len > 0:
            o = _decode_rows_ref(
                q, k_cache, v_cache, block_tables, lens, max_len, scale, k_scale, v_scale
            )
        else:
            o = torch.zeros(num_tokens, num_heads, head_dim, device=device)
        if out is None:
            return o.to(q.dtype)
        out.copy_(o)
        return out
    result = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=device)
    qsl = query_start_loc.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]

    decode_idx = torch.nonzero(q_lens == 1).flatten()
    if decode_idx.numel() > 0:
        tok = qsl[decode_idx]
        d_lens = lens[decode_idx]
        max_len = int(d_lens.max())
        if max_len > 0:
            result[tok] = _decode_rows_ref(
                q[tok], k_cache, v_cache, block_tables[decode_idx], d_lens, max_len, scale,
                k_scale, v_scale,
            )  # fmt: skip

    # Sequences with several query tokens (prefill chunks): one SDPA call each. The
    # metadata is read back once, not element by element.
    starts, seq_lens_host = qsl.tolist(), lens.tolist()
    for b in range(num_seqs):
        start, q_len, seq_len = starts[b], starts[b + 1] - starts[b], seq_lens_host[b]
        if q_len <= 1 or seq_len <= 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[b, :num_blocks].to(torch.int64)
        k = k_cache.flatten(1).index_select(0, blocks).view(-1, num_kv_heads, head_dim)
        v = v_cache.flatten(1).index_select(0, blocks).view(-1, num_kv_heads, head_dim)
        k, v = dequantize_kv(k[:seq_len], k_scale), dequantize_kv(v[:seq_len], v_scale)
        qs = q[start : start + q_len].float()
        key_pos = torch.arange(seq_len, device=device)
        query_pos = seq_len - q_len + torch.arange(q_len, device=device)
        mask = key_pos[None, :] <= query_pos[:, None]
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=group > 1,
        )
        result[start : start + q_len] = o.transpose(0, 1)

    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out


def _masked_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per row, q [n, Hq, D], over gathered k, v [n, L, Hkv, D] where
    `valid` [n, L] is True; returns [n, Hq, D].

    Query heads h * G .. h * G + G - 1 share KV head h (G = Hq // Hkv), and a lone query
    token attends to every valid key: so the G heads of a KV head go in as G query rows of
    one non-causal attention over that head's keys. The CPU kernel then reads each K/V row
    once for G queries instead of once per query head, and no repeated K/V is formed.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    qg = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None, :],
        scale=scale,
    )
    return o.reshape(n, num_heads, head_dim)


def decode_gather_index(
    block_tables: torch.Tensor, lens: torch.Tensor, max_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For single-token rows with contexts `lens` [n] (int64): the cache blocks to gather
    (flat [n * num_blocks]), the valid keys [n, padded] and the live rows [n]. The same for
    every layer of a step (the CPU path derives it once)."""
    # A `max_seq_len` hint may round past the table; the contexts themselves fit in it.
    num_blocks = min(-(-max_len // block_size), block_tables.shape[1])
    padded = num_blocks * block_size
    device = block_tables.device
    # Table entries past a sequence's last block may hold anything: point them at block 0.
    block_start = torch.arange(num_blocks, device=device) * block_size
    tables = block_tables[:, :num_blocks].to(torch.int64)
    tables = torch.where(block_start[None, :] < lens[:, None], tables, torch.zeros_like(tables))
    valid = torch.arange(padded, device=device)[None, :] < lens[:, None]  # [n, padded]
    return tables.flatten(), valid, lens > 0


def decode_rows_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    flat_ids: torch.Tensor,
    valid: torch.Tensor,
    live: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """All single-token rows at once (`decode_gather_index`'s index): gather their blocks,
    one masked attention call; returns [n, Hq, D] float32. An FP8 cache is dequantized with
    its scales."""
    n, head_dim = q.shape[0], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    padded = valid.shape[1]
    # index_select on a [blocks, block_size * heads * dim] view: one contiguous row per block,
    # markedly cheaper on the CPU than advanced indexing of the 4-d cache.
    k = k_cache.flatten(1).index_select(0, flat_ids).view(n, padded, num_kv_heads, head_dim)
    v = v_cache.flatten(1).index_select(0, flat_ids).view(n, padded, num_kv_heads, head_dim)
    k, v = dequantize_kv(k, k_scale), dequantize_kv(v, v_scale)
    qf = q.float()
    o = _masked_sdpa(qf, k, v, valid, scale)
    # Masked slots only matter when they hold NaN or inf (0 * NaN in P @ V): the engine's
    # zero-filled cache never does, so zero them only for rows that came out non-finite.
    # One check for the whole batch first (a sum is finite when every term is, and far
    # cheaper than an elementwise test): rows that need either fix below are rare.
    if math.isfinite(float(o.sum())):
        return o
    bad = live & ~torch.isfinite(o).flatten(1).all(dim=1)
    if bad.any():
        rows = torch.nonzero(bad).flatten()
        invalid = ~valid[rows][:, :, None, None]
        k_rows = k[rows].masked_fill_(invalid, 0.0)
        v_rows = v[rows].masked_fill_(invalid, 0.0)
        o[rows] = _masked_sdpa(qf[rows], k_rows, v_rows, valid[rows], scale)
    # Rows of length 0 (padding) are fully masked: SDPA gives NaN there, we give zeros.
    return torch.where(live[:, None, None], o, torch.zeros((), device=q.device))


def _decode_rows_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """All single-token rows at once: gather their blocks, one masked attention call."""
    index = decode_gather_index(block_tables, lens, max_len, k_cache.shape[1])
    return decode_rows_attention(q, k_cache, v_cache, *index, scale, k_scale, v_scale)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _find_seq_idx(query_start_loc_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with qsl[b] // BLOCK_Q + b <= target (the sequence owning a query block)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        val = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if val <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _query_block(query_start_loc_ptr, num_seqs, q_len_lo, q_len_hi, BLOCK_Q: tl.constexpr):
    """This program's block of BLOCK_Q query tokens in a prefill or mixed launch: (sequence,
    its first token, its query length, the block's first query position, whether the block
    is this launch's). The grid holds T // BLOCK_Q + B blocks (a host-known bound), taken in
    reverse so the last blocks of long prompts (the most keys) start first and short ones
    fill the tail; surplus blocks, and sequences whose query length is outside
    [q_len_lo, q_len_hi] (the other launch's), are not this launch's."""
    q_block_id = tl.num_programs(0) - 1 - tl.program_id(0)
    seq_idx = _find_seq_idx(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q=BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_block_start = (q_block_id - (q_start // BLOCK_Q + seq_idx)) * BLOCK_Q
    mine = (q_len >= q_len_lo) & (q_len <= q_len_hi) & (q_block_start < q_len)
    return seq_idx, q_start, q_len, q_block_start, mine


@triton.jit
def _query_rows(
    q_start, q_block_start, q_len, kv_head, stride_qt, stride_qh,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP: tl.constexpr, D_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The block's MMA rows, the G query heads of the program's KV head for each of its
    tokens: (head_dim offsets, query positions, heads, valid rows, token ids, q offsets and
    load mask)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    q_pos = q_block_start + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_pos < q_len)
    tok = (q_start + q_pos).to(tl.int64)
    q_offs = tok[:, None] * stride_qt + (head * stride_qh)[:, None] + offs_d[None, :]
    q_mask = row_valid[:, None]
    if D_PAD != HEAD_DIM:
        q_mask = q_mask & (offs_d < HEAD_DIM)[None, :]
    return offs_d, q_pos, head, row_valid, tok, q_offs, q_mask


@triton.jit
def _causal_keys(ctx_len, q_block_start, q_len, BLOCK_Q: tl.constexpr, TILE: tl.constexpr):
    """Causal pruning: the block sees keys 0 .. ctx_len + its last query position, in
    `num_tiles` tiles, the first `num_full` of which every row sees (neither causal mask nor
    bounds checks). Clamped at 0: a sequence with fewer keys than queries (padding, the
    start-up profile pass) sees none. Returns (num_keys, num_tiles, num_full)."""
    last_q = tl.minimum(q_block_start + BLOCK_Q, q_len) - 1
    num_keys = tl.maximum(ctx_len + last_q + 1, 0)
    num_tiles = tl.cdiv(num_keys, TILE)
    num_full = tl.maximum(ctx_len + q_block_start + 1, 0) // TILE
    return num_keys, num_tiles, num_full


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    # DOT_FP32: the interpreter multiplies bf16 bit patterns in tl.dot, so upcast there.
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _decode_cos_sin(
    positions_ptr, cos_sin_ptr, seq_idx, stride_cs, offs_d, dt,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """cos and sin of sequence `seq_idx`'s (one) token for every lane d of a head, as
    cos[d % HALF], cast to the model dtype first like HF; in fp32."""
    pos = tl.load(positions_ptr + seq_idx).to(tl.int64)
    d = offs_d % HALF
    d_mask = offs_d < HEAD_DIM
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=d_mask, other=0.0)
    return cos.to(dt).to(tl.float32), sin.to(dt).to(tl.float32)


@triton.jit
def _rotate_row(x, row_ptr, offs_d, mask, cos, sin, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """Rotate-half rotary of x (rows of heads loaded from row_ptr + offs_d), rounded like
    `asyncengine_kernels.rotary`: out = x * cos -/+ partner * sin, each product and the sum rounded
    to x's dtype. The partner lane of d is d + HALF in the first half, d - HALF in the second."""
    partner = tl.load(row_ptr + (offs_d + HALF) % HEAD_DIM, mask=mask, other=0.0)
    dt = x.dtype
    a = (x.to(tl.float32) * cos).to(dt).to(tl.float32)
    b = (partner.to(tl.float32) * sin).to(dt).to(tl.float32)
    return tl.where(offs_d < HALF, a - b, a + b).to(dt)


@triton.jit
def _kv_tile(
    tile, num_keys, bt_row_ptr, stride_kb, stride_ks, stride_vb, stride_vs,
    offs_d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Offsets of one KV tile's keys and values in the paged cache (from k_base / v_base),
    and the mask for their loads (MASKED: keys past `num_keys` are not loaded)."""
    offs_t = tile * TILE + tl.arange(0, TILE)
    if MASKED:
        kv_valid = offs_t < num_keys
        blk = tl.load(bt_row_ptr + offs_t // BLOCK_SIZE, mask=kv_valid, other=0)
    else:
        blk = tl.load(bt_row_ptr + offs_t // BLOCK_SIZE)
    blk = blk.to(tl.int64)
    in_block = (offs_t % BLOCK_SIZE).to(tl.int64)
    k_offs = (blk * stride_kb + in_block * stride_ks)[:, None] + offs_d[None, :]
    v_offs = (blk * stride_vb + in_block * stride_vs)[:, None] + offs_d[None, :]
    if MASKED:
        if D_PAD == HEAD_DIM:
            kv_mask = kv_valid[:, None]
        else:
            kv_mask = kv_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    else:
        kv_mask = (offs_d < HEAD_DIM)[None, :]
    return k_offs, v_offs, kv_mask


@triton.jit
def _load_kv(
    base, offs, kv_mask, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr
):
    # Masked loads: unwritten slots may hold NaN, and 0 * NaN would poison P @ V.
    if MASKED or D_PAD != HEAD_DIM:
        return tl.load(base + offs, mask=kv_mask, other=0.0)
    return tl.load(base + offs)


@triton.jit
def _widen_e4m3_before_dot(x):
    """e4m3 codes to fp16 (exact), two per instruction, as inline PTX the compiler does not
    move: the tile is widened before the shared-memory round trip of its dot operand, where
    16-bit values transpose with ldmatrix, instead of after it, where a transposed 8-bit
    operand is read byte by byte. V needs it (P @ V reduces over keys, the slow axis of the
    cache); K does not (Q @ K^T reduces over head_dim, its contiguous axis, so its e4m3
    bytes are read vectorized and widened after the load, half the shared-memory traffic)."""
    if INLINE_PTX:  # the interpreter widens with a cast (the same values)
        # Not pure: a pure op would be hoisted past the shared-memory load like a cast.
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi;
            mov.b32 {lo, hi}, $2;
            cvt.rn.f16x2.e4m3x2 $0, lo;
            cvt.rn.f16x2.e4m3x2 $1, hi;
            }""",
            constraints="=r,=r,r",
            args=[x],
            dtype=tl.float16,
            is_pure=False,
            pack=4,
        )
    else:
        return x.to(tl.float16)


@triton.jit
def _scores_on_cores(Q, K):
    """Q @ K^T for one query row [1, D] in float32 as products and sums (no MMA): a dot
    over head_dim per key, [1, TILE]."""
    return tl.sum(Q * K, axis=1)[None, :]


@triton.jit
def _values_on_cores(P, V):
    """P @ V for one query row [1, TILE] in float32 as products and sums (no MMA), [1, D]."""
    return tl.sum(tl.trans(P) * V, axis=0)[None, :]


@triton.jit
def _attend_tile(
    Q,
    M,
    L,
    acc,
    tile,
    num_keys,
    q_abs,
    k_base,
    v_base,
    bt_row_ptr,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    scale_log2,
    offs_d,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
    new_pos,
    k_new,
    v_new,
    HAS_NEW: tl.constexpr,
    EARLY_V: tl.constexpr,
    K_pre,
    V_pre,
    PRELOADED: tl.constexpr,
    KV_FP8: tl.constexpr = False,
    KV_DOT_F16: tl.constexpr = False,
    VECTOR: tl.constexpr = False,
):
    """One KV tile of online softmax. MASKED=False: every key of the tile is visible to every
    row of the block (no causal mask, no bounds checks). HAS_NEW: key position `new_pos`
    takes `k_new`/`v_new` from registers instead of the cache (this step's own token).
    PRELOADED: the tile's K and V are `K_pre`/`V_pre`, loaded (masked) by the caller.
    KV_FP8: K and V arrive as e4m3 and are converted to Q's dtype; they stay in units of
    their scales, which the caller folded into `scale_log2` and applies to the output.
    VECTOR: one query row (MHA decode), whose scores and P @ V are products and sums in
    float32 on the CUDA cores rather than a 16-row MMA tile with 15 rows of padding (Q
    arrives in float32; K and V are widened to it)."""
    offs_t = tile * TILE + tl.arange(0, TILE)
    if PRELOADED:
        K = K_pre
        V = V_pre
    else:
        k_offs, v_offs, kv_mask = _kv_tile(
            tile, num_keys, bt_row_ptr, stride_kb, stride_ks, stride_vb, stride_vs, offs_d,
            HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK_SIZE=BLOCK_SIZE, TILE=TILE, MASKED=MASKED,
        )  # fmt: skip
        K = _load_kv(k_base, k_offs, kv_mask, HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, MASKED=MASKED)
        # EARLY_V: V is requested with K rather than after the scores. A split-KV decode
        # program runs a tile or two and is latency-bound, so the two loads then share one
        # round trip; so is a VECTOR program, whose loads feed no MMA and are not pipelined
        # through shared memory, and whose tiles take few registers. Large prefill tiles
        # keep V late, where it costs no registers during the scores.
        if EARLY_V:
            V = _load_kv(v_base, v_offs, kv_mask, HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, MASKED=MASKED)
    if KV_FP8 or VECTOR:
        K = K.to(Q.dtype)
    if HAS_NEW:
        if VECTOR:
            k_new = k_new.to(K.dtype)
        K = tl.where((offs_t == new_pos)[:, None], k_new[None, :], K)
    if VECTOR:
        S = _scores_on_cores(Q, K) * scale_log2
    else:
        S = _dot(Q, tl.trans(K), DOT_FP32=DOT_FP32, IEEE=IEEE) * scale_log2
    if MASKED:
        visible = (offs_t[None, :] <= q_abs[:, None]) & (offs_t < num_keys)[None, :]
        S = tl.where(visible, S, float("-inf"))
    m_new = tl.maximum(M, tl.max(S, axis=1))
    # A row with no visible key yet keeps m = -inf; exp2(-inf - -inf) would be NaN.
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    P = tl.exp2(S - m_safe[:, None])
    alpha = tl.exp2(M - m_safe)
    L = L * alpha + tl.sum(P, axis=1)

    if not PRELOADED and not EARLY_V:
        V = _load_kv(v_base, v_offs, kv_mask, HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, MASKED=MASKED)
    if VECTOR:
        V = V.to(tl.float32)
    elif KV_DOT_F16:
        V = _widen_e4m3_before_dot(V)
    elif KV_FP8:
        V = V.to(Q.dtype)
    if HAS_NEW:
        if VECTOR:
            v_new = v_new.to(V.dtype)
        V = tl.where((offs_t == new_pos)[:, None], v_new[None, :], V)
    if VECTOR:
        acc = acc * alpha[:, None] + _values_on_cores(P, V)
    else:
        acc = acc * alpha[:, None] + _dot(P.to(V.dtype), V, DOT_FP32=DOT_FP32, IEEE=IEEE)
    return m_new, L, acc


# The block-table width changes from step to step; specializing on it (== 1, divisible by 16)
# would compile new variants mid-serving, after the warm-up.
@triton.jit(do_not_specialize=["num_seqs", "q_len_lo", "q_len_hi", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    seg_acc_ptr,
    seg_max_ptr,
    seg_sum_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    num_seqs,
    q_len_lo,
    q_len_hi,
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
    positions_ptr,
    cos_sin_ptr,
    k_new_ptr,
    v_new_ptr,
    slot_mapping_ptr,
    stride_cs,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
    DECODE: tl.constexpr,
    USE_PDL: tl.constexpr,
    ROTARY: tl.constexpr = False,
    HALF: tl.constexpr = 1,
    KV_FP8: tl.constexpr = False,
    KV_DOT_F16: tl.constexpr = False,
    HEAD_MAJOR: tl.constexpr = False,
    VECTOR: tl.constexpr = False,
    KV_STAGES: tl.constexpr = None,
    LATE_V: tl.constexpr = False,
):
    if not ROTARY:
        pdl_wait(USE_PDL)
    # KV_DOT_F16: an e4m3 tile widens to fp16 in one instruction per two values (to bf16 it
    # takes three), so a 16-bit query joins it in fp16 (scores and P @ V accumulate in fp32).
    dot_dtype = tl.float16 if KV_DOT_F16 else q_ptr.dtype.element_ty
    if VECTOR:
        # No MMA (`_attend_tile`): the query and the widened tiles meet in float32.
        dot_dtype = tl.float32
    # HEAD_MAJOR (decode only): the KV heads of one sequence are neighbours in launch order,
    # so programs running together read neighbouring bytes of the same cache blocks.
    kv_head = tl.program_id(0) if HEAD_MAJOR else tl.program_id(1)
    segment = tl.program_id(2)
    if KV_FP8:
        # Scores are q . (k_scale * code) = k_scale * (q . code): the K scale joins the
        # softmax scale. The scales are step inputs, not written by the previous kernel.
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
    if DECODE:
        # Every sequence has one query token, token b of sequence b: no search, and the
        # loads below do not wait on query_start_loc (a decode step is latency-bound).
        seq_idx = tl.program_id(1) if HEAD_MAJOR else tl.program_id(0)
        q_start = seq_idx
        q_len = 1
        q_block_start = 0
    else:
        seq_idx, q_start, q_len, q_block_start, mine = _query_block(
            query_start_loc_ptr, num_seqs, q_len_lo, q_len_hi, BLOCK_Q=BLOCK_Q
        )
        if not mine:
            return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    ctx_len = seq_len - q_len  # keys before this step's first query (-1 for padding rows)

    offs_d, q_pos, head, row_valid, tok, q_offs, q_mask = _query_rows(
        q_start, q_block_start, q_len, kv_head, stride_qt, stride_qh,
        BLOCK_M=BLOCK_M, BLOCK_Q=BLOCK_Q, GROUP=GROUP, D_PAD=D_PAD, HEAD_DIM=HEAD_DIM,
    )  # fmt: skip
    if not ROTARY:
        Q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(dot_dtype)
    q_abs = ctx_len + q_pos
    num_keys, num_tiles, num_full = _causal_keys(
        ctx_len, q_block_start, q_len, BLOCK_Q=BLOCK_Q, TILE=TILE
    )
    if NUM_SEGMENTS > 1:
        tiles_per_seg = tl.cdiv(num_tiles, NUM_SEGMENTS)
        tile_lo = segment * tiles_per_seg
        tile_hi = tl.minimum(tile_lo + tiles_per_seg, num_tiles)
    else:
        tile_lo = 0
        tile_hi = num_tiles

    bt_row_ptr = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    new_pos = seq_len - 1  # this step's token, when ROTARY: taken from registers
    k_new = tl.zeros([D_PAD], dtype=dot_dtype)
    v_new = tl.zeros([D_PAD], dtype=dot_dtype)
    if ROTARY:
        # A decode step with rotary fused in. Nothing read so far, nor the rotary table, the
        # slot nor this segment's first KV tile, is written by the previous kernel (the QKV
        # projection): they are the step's inputs and earlier steps' cache. So they are read
        # before waiting for that kernel, and their latency hides behind its tail. The new
        # token's own slot may be stale in that tile; it is taken from registers below.
        cos, sin = _decode_cos_sin(
            positions_ptr, cos_sin_ptr, seq_idx, stride_cs, offs_d, q_ptr.dtype.element_ty,
            HEAD_DIM=HEAD_DIM, HALF=HALF,
        )  # fmt: skip
        slot = tl.load(slot_mapping_ptr + seq_idx).to(tl.int64)
        k_offs, v_offs, kv_mask = _kv_tile(
            tile_lo, num_keys, bt_row_ptr, stride_kb, stride_ks, stride_vb, stride_vs, offs_d,
            HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK_SIZE=BLOCK_SIZE, TILE=TILE, MASKED=True,
        )  # fmt: skip
        K_first = _load_kv(k_base, k_offs, kv_mask, HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, MASKED=True)
        V_first = _load_kv(v_base, v_offs, kv_mask, HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, MASKED=True)
        pdl_wait(USE_PDL)
        # q and this step's k arrive unrotated.
        Q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
        q_row = tok[:, None] * stride_qt + (head * stride_qh)[:, None]
        Q = _rotate_row(Q, q_ptr + q_row, offs_d, q_mask, cos, sin, HEAD_DIM=HEAD_DIM, HALF=HALF)
        Q = Q.to(dot_dtype)
        # Only the program whose segment holds the new key reads it, so that program alone
        # rotates it, writes k and v to their cache slot and uses them from registers.
        last_tile = new_pos // TILE
        if (seq_len > 0) & (last_tile >= tile_lo) & (last_tile < tile_hi):
            d_mask = offs_d < HEAD_DIM
            k_row = k_new_ptr + seq_idx.to(tl.int64) * stride_knt + kv_head * stride_knh
            k_raw = tl.load(k_row + offs_d, mask=d_mask, other=0.0)
            k_new = _rotate_row(
                k_raw, k_row, offs_d, d_mask, cos, sin, HEAD_DIM=HEAD_DIM, HALF=HALF
            )
            v_row = v_new_ptr + seq_idx.to(tl.int64) * stride_vnt + kv_head * stride_vnh
            v_new = tl.load(v_row + offs_d, mask=d_mask, other=0.0)
            if KV_FP8:
                # Stored quantized, and used as stored (in units of the scales), so this
                # token is attended to exactly as the later steps that read it back will.
                k_code = quantize_fp8(k_new, tl.load(k_scale_ptr + kv_head))
                v_code = quantize_fp8(v_new, tl.load(v_scale_ptr + kv_head))
                k_new = k_code.to(dot_dtype)
                v_new = v_code.to(dot_dtype)
                if slot >= 0:
                    blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
                    k_dst = k_base + blk * stride_kb + off * stride_ks + offs_d
                    tl.store(k_dst, k_code, mask=d_mask)
                    tl.store(v_base + blk * stride_vb + off * stride_vs + offs_d, v_code,
                             mask=d_mask)  # fmt: skip
            elif slot >= 0:
                blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
                tl.store(k_base + blk * stride_kb + off * stride_ks + offs_d, k_new, mask=d_mask)
                tl.store(v_base + blk * stride_vb + off * stride_vs + offs_d, v_new, mask=d_mask)

    M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    L = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    first = tile_lo
    if ROTARY:
        # The prefetched tile, masked: an empty segment's tile is all past num_keys and
        # leaves M, L and acc as they are.
        M, L, acc = _attend_tile(
            Q, M, L, acc, tile_lo, num_keys, q_abs, k_base, v_base, bt_row_ptr,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, offs_d,
            new_pos=new_pos, k_new=k_new, v_new=v_new, K_pre=K_first, V_pre=V_first,
            MASKED=True, HAS_NEW=True, EARLY_V=True, PRELOADED=True,
            HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK_SIZE=BLOCK_SIZE, TILE=TILE, DOT_FP32=DOT_FP32,
            IEEE=IEEE, KV_FP8=KV_FP8, KV_DOT_F16=KV_DOT_F16, VECTOR=VECTOR,
        )  # fmt: skip
        first = tile_lo + 1
    # KV_STAGES: the full tiles' loop pipelined that deep whatever the launch's num_stages
    # does (None: as it does). The compiler pipelines loads that feed an MMA by itself; a
    # VECTOR program's loads it pipelines only when asked here. LATE_V: a VECTOR program
    # requests V after the scores, as large tiles do: one more round trip a tile, but a
    # one-warp program over 32 / 64 / 128 keys then builds to 128 / 190 / 255 registers on
    # sm_90 (11 spills at 128) against 166 / 250 / 255 (48 spills), so more fit a
    # multiprocessor.
    for tile in tl.range(first, tl.minimum(tile_hi, num_full), num_stages=KV_STAGES):
        M, L, acc = _attend_tile(
            Q, M, L, acc, tile, num_keys, q_abs, k_base, v_base, bt_row_ptr,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, offs_d,
            new_pos=new_pos, k_new=k_new, v_new=v_new, K_pre=Q, V_pre=Q,
            MASKED=False, HAS_NEW=ROTARY, EARLY_V=(NUM_SEGMENTS > 1) or (VECTOR and not LATE_V),
            PRELOADED=False,
            HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK_SIZE=BLOCK_SIZE, TILE=TILE, DOT_FP32=DOT_FP32,
            IEEE=IEEE, KV_FP8=KV_FP8, KV_DOT_F16=KV_DOT_F16, VECTOR=VECTOR,
        )  # fmt: skip
    for tile in range(tl.maximum(first, num_full), tile_hi):
        M, L, acc = _attend_tile(
            Q, M, L, acc, tile, num_keys, q_abs, k_base, v_base, bt_row_ptr,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, offs_d,
            new_pos=new_pos, k_new=k_new, v_new=v_new, K_pre=Q, V_pre=Q,
            MASKED=True, HAS_NEW=ROTARY, EARLY_V=(NUM_SEGMENTS > 1) or (VECTOR and not LATE_V),
            PRELOADED=False,
            HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK_SIZE=BLOCK_SIZE, TILE=TILE, DOT_FP32=DOT_FP32,
            IEEE=IEEE, KV_FP8=KV_FP8, KV_DOT_F16=KV_DOT_F16, VECTOR=VECTOR,
        )  # fmt: skip

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)  # P @ (v_scale * code) = v_scale * (P @ code)
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(L == 0.0, 1.0, L)[:, None]  # rows with no keys give zeros
        o_offs = tok[:, None] * stride_ot + (head * stride_oh)[:, None] + offs_d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Unnormalized partials; every (token, head, segment) is written, empty ones as
        # (acc 0, max -inf, sum 0), so the reducer never reads garbage.
        row = tok * NUM_HEADS + head
        stat_offs = row * NUM_SEGMENTS + segment
        tl.store(seg_max_ptr + stat_offs, M, mask=row_valid)
        tl.store(seg_sum_ptr + stat_offs, L, mask=row_valid)
        acc_offs = stat_offs[:, None] * D_PAD + offs_d[None, :]
        tl.store(seg_acc_ptr + acc_offs, acc, mask=row_valid[:, None])


@triton.jit
def _reduce_segments_kernel(
    out_ptr,
    seg_acc_ptr,
    seg_max_ptr,
    seg_sum_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = tok * NUM_HEADS + head
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, D_PAD)
    m = tl.load(seg_max_ptr + row * NUM_SEGMENTS + offs_s)
    l_seg = tl.load(seg_sum_ptr + row * NUM_SEGMENTS + offs_s)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
    w = tl.exp2(m - m_max)  # empty segments (m = -inf) weigh 0
    denom = tl.sum(w * l_seg, axis=0)
    acc = tl.load(seg_acc_ptr + (row * NUM_SEGMENTS + offs_s)[:, None] * D_PAD + offs_d[None, :])
    num = tl.sum(acc * w[:, None], axis=0)
    out = num / tl.where(denom == 0.0, 1.0, denom)
    o_ptr = out_ptr + tok * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

# Sequences with at least this many query tokens go to the large-tile (prefill) launch
# (`asyncengine_kernels.prefill_attention`).
PREFILL_TILE_MIN_QUERY_LEN = 64
# Split-KV decode aims at this many programs per multiprocessor after the split.
SPLIT_KV_PROGRAMS_PER_SM = 4
MAX_SPLIT_SEGMENTS = 16
# Steps whose longest context is at most this many keys use half as many segments, which
# measured faster there on an H200 (MHA, batch 1); where the crossover lies is not measured.
SHORT_CONTEXT_KEYS = 1024


# Unsplit decode launches of at least this many (sequence, KV head) programs per
# multiprocessor take the many-program tiles of `_small_tile_config`.
MANY_PROGRAMS_PER_SM = 8
# The short-query launch of a mixed step (its decode rows and short chunks) keeps the earlier
# tiles: on an H200, W2 with FP8 weights and KV (1000 requests, 1024 sequences) spent 19.35 s
# in mixed steps with the many-program tiles there and 19.46 s without, within noise.


def _small_tile_rows(group: int) -> int:
    """BLOCK_M of the small MMA tiles: the G heads of one KV head, at least the MMA's 16."""
    return max(16, next_power_of_2(group))


def _small_tile_config(
    group: int, elem_size: int, split: bool = False, programs_per_sm: float = 0.0
) -> dict[str, int]:
    """Decode / short-query tiles: the G heads of one KV head packed into >= 16 MMA rows.

    Measured on an H200 (bf16, D 128): 2 stages beat 3-4; 32-key tiles are best for MHA,
    64-key tiles once several heads share each K/V tile. An FP8 cache moves half the bytes
    per key: an unsplit launch takes 128-key tiles (measured at 256 sequences, MHA x 640
    keys and GQA x 1500, against 32 and 64 keys and 3 stages); split-KV launches (`split`,
    small batches) keep the 16-bit tiles, whose segments are short already.

    Unsplit decode launches with at least `MANY_PROGRAMS_PER_SM` programs per multiprocessor
    (`programs_per_sm`; 0 for other launches), measured head-major at 256 sequences (W1:
    MHA x 640 keys, 62 programs per SM; W2: GQA 4 x 1500 keys, 15.5): an FP8 cache runs one
    warp a program over 32-key tiles, many programs per SM instead of 3 (W1 0.852 of the copy
    rate against 0.767 for 4 warps x 128 keys, W2 0.845 against 0.721), and a 16-bit MHA
    cache 64-key tiles (W1 1.074 against 0.989). Fewer programs than that were not
    measured and keep the earlier tiles: one-warp programs need many to a multiprocessor.

    An FP8 MHA cache there takes the CUDA-core tiles (`VECTOR`, one query row a program, one
    warp): the MMA form holds a 16-row accumulator and fp16-widened K/V for its one real
    row, 255 registers a thread. Measured on an H200 (2026-12-05, three calls): at W1, 32-key
    VECTOR tiles read at 0.880-0.888 of the copy rate against 0.871-0.876 for the MMA tiles
    they replace (32 keys, 3 stages, capped at 168 registers); 64- and 128-key ones held
    within a call but swung between calls (0.84-0.95; 128 keys, which spill, 0.59-0.92);
    W1 in the engine over an FP8 cache rose from 8,293 to 8,624 tokens/s. Split launches
    keep the MMA tiles: alone, batch 1 over 4,000 keys in 16 segments took 0.017 ms with
    64-key VECTOR tiles against 0.0193, but L1 over an FP8 cache fell from 275.8 to 231.5
    tokens/s with them. Seven sequences unsplit (few programs): 0.1175 ms for the MMA tiles
    against 0.127 for the best VECTOR tiles."""
    block_m = _small_tile_rows(group)
    tile = 64 if group > 1 and elem_size <= 2 else 32
    warps = 4
    if elem_size == 1 and not split:
        tile = 128
    cfg = {"BLOCK_M": block_m, "BLOCK_Q": block_m // group, "num_stages": 2}
    many = not split and programs_per_sm >= MANY_PROGRAMS_PER_SM
    if elem_size == 1 and group == 1 and many:
        return {**cfg, "VECTOR": 1, "BLOCK_M": 1, "BLOCK_Q": 1, "TILE": 32, "num_warps": 1}
    if many:
        if elem_size == 1:
            tile, warps = 32, 1
        elif group == 1:
            tile = 64
    return {**cfg, "TILE": tile, "num_warps": warps}


def _large_tile_config(group: int, head_dim_pad: int, elem_size: int) -> dict[str, int]:
    """Prefill tiles of the unified kernel (`prefill_kernel=False`). Measured on an H200
    (bf16, D 128, causal 8x512 and 1x4096): 64 rows x 64 keys, 4 warps,
    2 stages was best or within 3 % of the best of 72 configs."""
    block_m = max(64, next_power_of_2(group))
    big = head_dim_pad <= 128 and elem_size <= 2
    return {
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // group,
        "TILE": 64 if big else 32,
        "num_warps": 4,
        "num_stages": 2 if big else 1,
    }


def _with_overrides(
    cfg: dict[str, int], overrides: Mapping[str, int] | None, group: int
) -> dict[str, int]:
    """A launch configuration with tuning overrides; BLOCK_Q follows an overridden BLOCK_M,
    and VECTOR tiles hold one row (they are for MHA decode: `_attend_tile`). `VECTOR: 0`
    asks for MMA tiles where the default is VECTOR, with their 16 rows."""
    if not overrides:
        return cfg
    merged = {**cfg, **overrides}
    if merged.get("VECTOR"):
        if group != 1:
            raise ValueError(f"VECTOR tiles hold one query row; this launch has {group} query "
                             "heads a KV head")  # fmt: skip
        merged["BLOCK_M"] = 1
    elif cfg.get("VECTOR"):
        # Back to the MMA tiles: their rows, and none of the VECTOR-only options.
        for name in ("VECTOR", "KV_STAGES", "LATE_V"):
            merged.pop(name, None)
        merged["BLOCK_M"] = overrides.get("BLOCK_M", _small_tile_rows(group))
    elif "BLOCK_M" not in overrides:
        return merged
    merged["BLOCK_Q"] = merged["BLOCK_M"] // group
    return merged


def _split_segments(
    num_seqs: int, num_kv_heads: int, device: torch.device, max_seq_len: int | None
) -> int:
    """Segments per row block for split-KV decode (1 = no split). Measured on an H200:
    splitting pays while the 2D grid has at most one program per multiprocessor; ~4 programs
    per SM after the split is the sweet spot for long contexts, half as many for short ones
    (`SHORT_CONTEXT_KEYS`)."""
    programs = num_seqs * num_kv_heads
    sms = num_sms(device.index or 0) if device.type == "cuda" else 1
    if programs > sms:
        return 1
    target = SPLIT_KV_PROGRAMS_PER_SM * sms // programs
    segments = max(2, min(MAX_SPLIT_SEGMENTS, 1 << (target.bit_length() - 1)))
    if max_seq_len is not None and max_seq_len <= SHORT_CONTEXT_KEYS:
        segments = max(2, segments // 2)
    return segments


def decode_plan(
    num_seqs: int,
    num_kv_heads: int,
    device: torch.device,
    max_seq_len: int | None = None,
    *,
    fuse_rotary: bool = True,
) -> DecodePlan:
    """The plan of a decode step of `num_seqs` sequences whose longest context is
    `max_seq_len` (None counts as long), from host facts only. Rotary is fused where the
    keys are split (`fuse_rotary=False` never fuses: tests compare the two paths); larger
    batches keep the separate rotary kernel, where that measured faster."""
    segments = _split_segments(num_seqs, num_kv_heads, device, max_seq_len)
    return DecodePlan(segments, fuse_rotary and segments > 1)


def decode_plans(
    num_seqs: int, num_kv_heads: int, device: torch.device, *, fuse_rotary: bool = True
) -> tuple[DecodePlan, ...]:
    """Every plan `decode_plan` can give a batch of `num_seqs` (one CUDA graph each)."""
    found: dict[DecodePlan, None] = {}
    for hint in (None, SHORT_CONTEXT_KEYS):
        plan = decode_plan(num_seqs, num_kv_heads, device, hint, fuse_rotary=fuse_rotary)
        found.setdefault(plan)
    return tuple(found)


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    decode_only: bool = False,
    num_segments: int = 1,
    rotary: DecodeRotary | None = None,
    pdl: bool = True,
    small_tiles: Mapping[str, int] | None = None,
    large_tiles: Mapping[str, int] | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    prefill_kernel: bool = True,
) -> torch.Tensor:
    """Triton paged attention; same contract as `paged_attention_ref` (an FP8 cache takes
    `k_scale` / `v_scale`, float32 [Hkv] device tensors read by the kernel).

    Host hints (never read from device memory): `max_query_len` lets a batch of short queries
    skip the large-tile launch; T == B selects the decode path. `decode_only` promises one
    query token per sequence (token b belongs to sequence b), so programs skip the search for
    their sequence. `num_segments` is the decode path's split-KV count (the step's
    `DecodePlan.segments`; 1 = no split). `rotary` (with `decode_only`): q, and this step's
    k and v, arrive unrotated and unwritten; the kernel rotates them and writes k and v to
    the cache itself (see `paged_decode_attention_with_rotary`).

    For tests and tuning: `pdl=False` launches without programmatic dependent launch where
    the device would use it; `small_tiles` / `large_tiles` override entries of the decode /
    short-query and the prefill launch configurations. Sequences with at least
    `PREFILL_TILE_MIN_QUERY_LEN` query tokens run the sm_90-shaped prefill kernel
    (`asyncengine_kernels.prefill_attention`); `prefill_kernel=False` runs them on this module's
    unified kernel with large tiles instead (kept for comparison in benchmarks).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) dimension")
    check_kv_scales(k_cache, k_scale, v_scale)
    kv_fp8 = is_fp8_kv(k_cache)
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    d_pad = max(16, next_power_of_2(head_dim))
    # Tile shapes follow the bytes a K/V element takes (1 for an FP8 cache).
    elem = k_cache.element_size()
    dot_fp32 = interpreter_enabled() and q.dtype == torch.bfloat16
    common = {
        "NUM_HEADS": num_heads,
        "HEAD_DIM": head_dim,
        "D_PAD": d_pad,
        "BLOCK_SIZE": block_size,
        "GROUP": group,
        "DOT_FP32": dot_fp32,
        "IEEE": q.dtype == torch.float32 or dot_fp32,
        "KV_FP8": kv_fp8,
        "KV_DOT_F16": kv_fp8 and q.dtype != torch.float32,
    }
    scales = (k_scale, v_scale) if kv_fp8 else (q, q)  # unused unless KV_FP8
    pdl = pdl and use_pdl(q)
    if rotary is not None:
        if not decode_only:
            raise ValueError("rotary inside attention is for decode_only steps")
        half = rotary.cos_sin_cache.shape[-1] // 2
        if 2 * half != head_dim:
            raise ValueError("rotary inside attention needs the rotary dim to equal head_dim")
        if rotary.k.stride(-1) != 1 or rotary.v.stride(-1) != 1:
            raise ValueError("rotary inside attention needs k and v with contiguous heads")
        cs = rotary.cos_sin_cache
        cs = cs if cs.stride(-1) == 1 else cs.contiguous()
        rot_args = (
            rotary.positions, cs, rotary.k, rotary.v, rotary.slot_mapping, cs.stride(0),
            rotary.k.stride(0), rotary.k.stride(1), rotary.v.stride(0), rotary.v.stride(1),
        )  # fmt: skip
        rot_flags = {"ROTARY": True, "HALF": half}
    else:
        rot_args = (q, q, q, q, q, 0, 0, 0, 0, 0)
        rot_flags = {"ROTARY": False, "HALF": 1}
    scale_log2 = float(scale) * _LOG2E

    def launch(
        cfg: dict[str, int], lo: int, hi: int, segments: int, seg_bufs: tuple, decode: bool
    ) -> None:
        rows = num_seqs if decode else num_tokens // cfg["BLOCK_Q"] + num_seqs
        # Decode launches run head-major unless a tuning override says otherwise: on an
        # H200 (256 sequences, bf16 cache) W1's MHA decode read at 0.983 of the copy rate
        # head-major against 0.959 sequence-major; the other cases were within 1 %.
        cfg = {**cfg, "HEAD_MAJOR": bool(cfg.get("HEAD_MAJOR", decode))}
        if cfg["HEAD_MAJOR"] and not decode:
            raise ValueError("HEAD_MAJOR launch order is for decode_only steps")
        grid = (rows, num_kv_heads, segments)
        if cfg["HEAD_MAJOR"]:
            grid = (num_kv_heads, rows, segments)
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, *seg_bufs,
            *scales, scale_log2, num_seqs, lo, hi,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0), *rot_args,
            NUM_SEGMENTS=segments, DECODE=decode, USE_PDL=pdl,
            **{**common, **rot_flags, **cfg}, **pdl_kwargs(pdl),
        )  # fmt: skip

    decode = decode_only or num_tokens == num_seqs
    split = decode and num_segments > 1
    programs_per_sm = 0.0
    if not split and decode:
        sms = num_sms(q.device.index or 0) if q.device.type == "cuda" else 1
        programs_per_sm = num_seqs * num_kv_heads / sms
    small = _with_overrides(
        _small_tile_config(group, elem, split, programs_per_sm), small_tiles, group
    )
    if split:
        segments = next_power_of_2(num_segments)
        f32 = {"dtype": torch.float32, "device": q.device}
        seg_acc = torch.empty(num_tokens, num_heads, segments, d_pad, **f32)
        seg_max = torch.empty(num_tokens, num_heads, segments, **f32)
        seg_sum = torch.empty(num_tokens, num_heads, segments, **f32)
        seg_bufs = (seg_acc, seg_max, seg_sum)
        launch(small, 0, 2**31 - 1, segments, seg_bufs, decode_only)
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out, seg_acc, seg_max, seg_sum, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SEGMENTS=segments,
            USE_PDL=pdl, **pdl_kwargs(pdl),
        )  # fmt: skip
        return out

    no_bufs = (out, out, out)  # unused in 2D mode
    threshold = PREFILL_TILE_MIN_QUERY_LEN
    if decode or (max_query_len is not None and max_query_len < threshold):
        launch(small, 0, 2**31 - 1, 1, no_bufs, decode_only)
        return out
    launch(small, 0, threshold - 1, 1, no_bufs, False)
    if prefill_kernel:
        # Imported here: the prefill module builds on this module's kernel helpers.
        from asyncengine_kernels.prefill_attention import prefill_attention_launch

        prefill_attention_launch(
            q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, scale_log2,
            threshold, *(scales if kv_fp8 else (None, None)), dot_fp32=dot_fp32, pdl=pdl,
            overrides=large_tiles,
        )  # fmt: skip
        return out
    large = _with_overrides(_large_tile_config(group, d_pad, elem), large_tiles, group)
    launch(large, threshold, 2**31 - 1, 1, no_bufs, False)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    decode_only: bool = False,
    max_seq_len: int | None = None,
    num_segments: int = 1,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged causal attention: Triton on CUDA tensors, the torch reference otherwise.

    q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: int32
    [B, max_blocks]; query_start_loc: int32 [B+1]; seq_lens: int32 [B] (context length
    including this step's tokens, whose K/V are already in the cache). Returns [T, Hq, D] in
    q.dtype (written into `out` when given). Sequences with seq_len 0 give zeros.
    `max_seq_len` (the longest context) is a hint for the reference; `num_segments` is the
    Triton decode path's split-KV count (the step's `DecodePlan.segments`). An FP8 cache
    (`torch.float8_e4m3fn`) needs `k_scale` and `v_scale`, float32 [Hkv].
    """
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out)
    if use_triton(q):
        return paged_attention_triton(
            *args, max_query_len=max_query_len, decode_only=decode_only,
            num_segments=num_segments, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    return paged_attention_ref(
        *args, max_query_len=max_query_len, decode_only=decode_only, max_seq_len=max_seq_len,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
