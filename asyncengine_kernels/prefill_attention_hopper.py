"""Prefill attention for Hopper (sm_90) in Gluon: warp-specialized, fed by the tensor copy engine.

The Triton prefill kernel (`asyncengine_kernels.prefill_attention`) runs both warpgroups of a
program in lockstep: they meet at a barrier every key tile (for the shared-memory pipeline), so the
tensor cores idle while both compute the softmax's exponentials. This kernel splits the
work by role, as FlashAttention-3 does, in Triton's lower-level Gluon language, which exposes
warp specialization, `wgmma`, mbarriers and TMA on sm_90:
- a producer warp finds each work item (a block of 128 query rows of one sequence and KV
  head), hands it to the consumers through a two-slot ring in shared memory, and copies its
  key tiles' K and V from the paged cache with the tensor memory accelerator (TMA), one
  16-row cache block per copy, into a ring of `NUM_STAGES` stages, each completing on an
  mbarrier;
- two consumer warpgroups each own 64 of the item's 128 query rows and run their own online
  softmax; neither waits for the other, so one's exponentials run under the other's matrix
  products (a stage is freed once both have read it).

The grid is persistent (one program per multiprocessor, items dealt round-robin, longest
first): the producer looks up the next item and starts its copies while the consumers
finish the current one, so a short item (most of them, for prompts of a few thousand
tokens) does not pay a launch, a look-up and a first copy's latency of its own.

Same contract as `prefill_attention_launch` (and so as `paged_attention_ref`) for the
sequences it covers, for 16-bit caches with head_dim 128: rows of GQA heads packed into the
128-row tile (`GROUP` heads of one KV head per query token), K and V read from the paged
cache (the step's own keys included), causal masking only on the diagonal tiles.

Cache slots past a sequence's end may hold anything (NaN in the tests), and 0 * NaN would
poison P @ V: for the one tile that runs past a sequence's last written slot, a consumer
copies V into its own buffer with those rows zeroed before multiplying. K needs nothing
(masked scores are replaced by -inf).

head_dim 128 is split into two 64-wide halves (two TMA descriptors' boxes, two `wgmma`s):
a 64-element bf16 row is exactly the 128-byte swizzle span, so a 16-row cache block lands
in a stage as a contiguous, swizzle-aligned slice.

`available()` says whether this Triton build has Gluon's Hopper module; `supported()` whether
a launch qualifies. Otherwise the Triton kernel serves.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from asyncengine_kernels.paged_attention import _find_seq_idx

try:  # Gluon ships with Triton 3.5+; older builds and CPU-only installs fall back.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _GLUON = True
except Exception:
    _GLUON = False

__all__ = [
    "HOPPER_PREFILL_CONFIG",
    "available",
    "hopper_prefill_launch",
    "supported",
    "try_hopper_prefill",
]

logger = logging.getLogger(__name__)

# Launch shape: 128 query rows per program (two consumer warpgroups of 64), key tiles of
# `TILE` keys in `NUM_STAGES` shared-memory stages (32 KB each at 64 keys, plus 32 KB of the
# consumers' masked-V buffers). PIPELINE: each consumer's softmax of a tile overlaps its own
# P @ V of the previous one; PINGPONG: the two consumers' matrix products take turns.
# Chosen by `scripts/bench_kernels.py --only prefill` on an H200: the overlap on 64-key
# tiles is 4-7 % faster than 128-key tiles without it at 2k-4k tokens and level at 8k (on
# 128-key tiles it ran 20 % slower: two score tiles crowd the registers); ping-pong
# measured between 5 % slower and 4 % faster, so it is off.
HOPPER_PREFILL_CONFIG: dict[str, int] = {"TILE": 64, "NUM_STAGES": 4, "PIPELINE": 1, "PINGPONG": 0}
_ROWS = 128  # query rows per program
_HALF_ROWS = 64  # per consumer warpgroup (wgmma's 64-row minimum)
_HALF_D = 64  # head_dim is handled in two halves of 64 (one 128-byte swizzle row)
_HEAD_DIM = 128
# Registers per thread: the kernel starts at MAXNREG for its 12 warps (the producer's warp
# rounds up to a warpgroup), then the consumers grow to CONSUMER_REGS and the producer
# shrinks to PRODUCER_REGS (setmaxnreg); 168 x 12 warps fits 64K registers.
_MAXNREG = 168
_CONSUMER_REGS = 240
_PRODUCER_REGS = 32


# Gluon is experimental and its API moves between Triton releases: the kernel is checked on
# the GPU with Triton 3.6 and compiled (not run) with 3.9. If it does not build with the
# installed Triton, the first failure is kept here and prefill stays on the Triton kernel.
_BUILD_FAILURE: list[str] = []
_BUILT: set[tuple[Any, ...]] = set()


def available() -> bool:
    """Whether this Triton build has Gluon's Hopper module (and the kernel has not failed to
    build with it)."""
    return _GLUON and not _BUILD_FAILURE


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `hopper_prefill_launch` serves these tensors: an sm_90 GPU, 16-bit q and cache
    of one dtype, head_dim 128, GQA groups that divide 64 rows, contiguous caches whose
    blocks are whole multiples of 8 rows that divide the key tile."""
    if not (available() and q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)):
        return False
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    return (
        q.dtype in (torch.bfloat16, torch.float16)
        and k_cache.dtype == q.dtype
        and v_cache.dtype == q.dtype
        and head_dim == _HEAD_DIM
        and q.stride(2) == 1
        and _HALF_ROWS % group == 0
        and block_size % 8 == 0
        and HOPPER_PREFILL_CONFIG["TILE"] % block_size == 0
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


if _GLUON:
    # Gluon kernels read module globals only as constexprs.
    HALF_D = gl.constexpr(_HALF_D)
    HALF_ROWS = gl.constexpr(_HALF_ROWS)
    CONSUMER_REGS = gl.constexpr(_CONSUMER_REGS)
    PRODUCER_REGS = gl.constexpr(_PRODUCER_REGS)
    INFO_FIELDS = gl.constexpr(8)
    # Two builtins were renamed after Triton 3.6: the CTA (partition) barrier and the TMA
    # load. Same arguments either way.
    _sync_threads = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.jit
    def _publish(info, info_ready, info_empty, n, kv_head, q_start, q_len, q_block_start,
                 ctx_len, num_tiles, more):  # fmt: skip
        """Producer: hand the consumers their n-th item through a two-slot ring."""
        slot = n % 2
        mbarrier.wait(info_empty.index(slot), ((n // 2) & 1) ^ 1)
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        f = gl.arange(0, INFO_FIELDS, layout=layout)
        vals = gl.where(f == 0, kv_head, 0) + gl.where(f == 1, q_start, 0)
        vals += gl.where(f == 2, q_len, 0) + gl.where(f == 3, q_block_start, 0)
        vals += gl.where(f == 4, ctx_len, 0) + gl.where(f == 5, num_tiles, 0)
        vals += gl.where(f == 6, more, 0)
        info.index(slot).store(vals)
        _sync_threads()  # every lane's field is written before the release
        mbarrier.arrive(info_ready.index(slot), count=1)

    @gluon.jit
    def _field(vals, f, k: gl.constexpr):
        return gl.sum(gl.where(f == k, vals, 0), axis=0)

    # The three partitions take one argument list (Gluon requires it of worker
    # partitions), so each receives arguments only the others use.
    @gluon.jit
    def _produce(
        q_ptr, out_ptr, k_desc, v_desc, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        k_lo, k_hi, v_lo, v_hi, vm_lo, vm_hi, ready, empty, turns, info, info_ready,
        info_empty, scale_log2, num_seqs, q_len_lo, num_items, num_q_blocks, num_kv_heads,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        GROUP: gl.constexpr, BLOCK_Q: gl.constexpr, TILE: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr, PIPELINE: gl.constexpr,
        PINGPONG: gl.constexpr, HALF: gl.constexpr,
    ):  # fmt: skip
        """The producer warp: finds each of this program's items (a block of query rows of one
        sequence and KV head), hands it to the consumers, and copies its key tiles' K and V
        halves into the stage ring, one cache block per TMA copy. It runs ahead of the
        consumers by the ring's depth, so an item's look-up and first copies happen while
        the previous item is still being computed."""
        tile_bytes: gl.constexpr = 4 * TILE * HALF_D * k_desc.dtype.primitive_bitwidth // 8
        t_all = 0  # tiles issued by this program: the ring's position
        n_pub = 0
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        for rnd in range(gl.cdiv(num_items, nprog)):
            # Items are numbered longest first (blocks in reverse, all heads of a block
            # together) and dealt in a snake: forwards on even rounds, backwards on odd ones,
            # so every program's total stays near the mean.
            item = rnd * nprog + pid + (rnd % 2) * (nprog - 1 - 2 * pid)
            looked_up = gl.minimum(item, num_items - 1)  # the last round may run short
            kv_head = looked_up % num_kv_heads
            q_block_id = num_q_blocks - 1 - looked_up // num_kv_heads
            seq_idx = _find_seq_idx(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
            q_start = gl.load(query_start_loc_ptr + seq_idx)
            q_len = gl.load(query_start_loc_ptr + seq_idx + 1) - q_start
            q_block_start = (q_block_id - (q_start // BLOCK_Q + seq_idx)) * BLOCK_Q
            if (item < num_items) & (q_len >= q_len_lo) & (q_block_start < q_len):
                ctx_len = gl.load(seq_lens_ptr + seq_idx) - q_len
                last_q = gl.minimum(q_block_start + BLOCK_Q, q_len) - 1
                num_keys = gl.maximum(ctx_len + last_q + 1, 0)
                num_tiles = gl.cdiv(num_keys, TILE)
                _publish(info, info_ready, info_empty, n_pub, kv_head, q_start, q_len,
                         q_block_start, ctx_len, num_tiles, 1)  # fmt: skip
                n_pub += 1
                bt_row_ptr = block_tables_ptr + seq_idx.to(gl.int64) * stride_bt
                col = kv_head * (2 * HALF_D)
                for t in range(num_tiles):
                    stage = t_all % NUM_STAGES
                    # A stage is free once both consumers have released its previous tile;
                    # the first pass waits on the barrier's initial (completed) phase.
                    mbarrier.wait(empty.index(stage), ((t_all // NUM_STAGES) & 1) ^ 1)
                    bar = ready.index(stage)
                    mbarrier.expect(bar, tile_bytes)
                    for i in gl.static_range(TILE // BLOCK_SIZE):
                        key0 = t * TILE + i * BLOCK_SIZE
                        # Blocks wholly past the keys are never used: copy block 0 in their
                        # place (the consumers mask those rows) so every stage gets the
                        # same bytes.
                        blk = gl.load(bt_row_ptr + key0 // BLOCK_SIZE, mask=key0 < num_keys,
                                      other=0)  # fmt: skip
                        row = gl.maximum(blk, 0) * BLOCK_SIZE
                        _tma_load(
                            k_desc, [row, col], bar,
                            k_lo.index(stage).slice(i * BLOCK_SIZE, BLOCK_SIZE),
                        )  # fmt: skip
                        _tma_load(
                            k_desc, [row, col + HALF_D], bar,
                            k_hi.index(stage).slice(i * BLOCK_SIZE, BLOCK_SIZE),
                        )  # fmt: skip
                        _tma_load(
                            v_desc, [row, col], bar,
                            v_lo.index(stage).slice(i * BLOCK_SIZE, BLOCK_SIZE),
                        )  # fmt: skip
                        _tma_load(
                            v_desc, [row, col + HALF_D], bar,
                            v_hi.index(stage).slice(i * BLOCK_SIZE, BLOCK_SIZE),
                        )  # fmt: skip
                    t_all += 1
        _publish(info, info_ready, info_empty, n_pub, 0, 0, 0, 0, 0, 0, 0)  # no more items

    @gluon.jit
    def _ready_stage(ready, i, NUM_STAGES: gl.constexpr):
        """Consumer: wait until the ring's i-th tile (counted over this program's items) has
        landed; returns its stage."""
        stage = i % NUM_STAGES
        mbarrier.wait(ready.index(stage), (i // NUM_STAGES) & 1)
        return stage

    @gluon.jit
    def _issue_scores(q_lo, q_hi, k_lo, k_hi, stage, s_layout: gl.constexpr,
                      TILE: gl.constexpr):  # fmt: skip
        """Issue Q @ K^T of one stage over both head_dim halves ([64, TILE] fp32): two
        asynchronous wgmma groups, not waited for."""
        zero = gl.zeros([HALF_ROWS, TILE], gl.float32, s_layout)
        s = warpgroup_mma(q_lo, k_lo.index(stage).permute((1, 0)), zero, use_acc=False,
                          is_async=True)  # fmt: skip
        return warpgroup_mma(q_hi, k_hi.index(stage).permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _scores(q_lo, q_hi, k_lo, k_hi, stage, s_layout: gl.constexpr, TILE: gl.constexpr):
        """Q @ K^T of one stage, waited for."""
        s = _issue_scores(q_lo, q_hi, k_lo, k_hi, stage, s_layout, TILE)
        return warpgroup_mma_wait(num_outstanding=0, deps=(s,))

    @gluon.jit
    def _accumulate(p, v_lo, v_hi, acc_lo, acc_hi):
        """acc += P @ V over both head_dim halves (v_lo / v_hi: [TILE, 64] shared tiles)."""
        acc_lo = warpgroup_mma(p, v_lo, acc_lo, is_async=True)
        acc_hi = warpgroup_mma(p, v_hi, acc_hi, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc_lo, acc_hi))

    @gluon.constexpr_function
    def _score_layout(tile):
        """Scores of a consumer warpgroup: wgmma m64 x tile accumulators."""
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, tile, 16]
        )

    @gluon.constexpr_function
    def _out_layout():
        """Output halves of a consumer warpgroup: wgmma m64 x 64 accumulators."""
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _HALF_D, 16]
        )

    @gluon.constexpr_function
    def _load_layout():
        """16-byte loads of 8 values, a warp over 4 rows x 64 columns."""
        return gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    @gluon.jit
    def _take(info, info_ready, info_empty, n, f):
        """Consumer: the n-th item the producer handed over, as (more, kv_head, q_start,
        q_len, q_block_start, ctx_len, num_tiles); more == 0 ends the work."""
        slot = n % 2
        mbarrier.wait(info_ready.index(slot), (n // 2) & 1)
        vals = info.index(slot).load(f.type.layout)
        fields = (_field(vals, f, 6), _field(vals, f, 0), _field(vals, f, 1),
                  _field(vals, f, 2), _field(vals, f, 3), _field(vals, f, 4),
                  _field(vals, f, 5))  # fmt: skip
        mbarrier.arrive(info_empty.index(slot), count=1)
        return fields

    @gluon.jit
    def _rows(kv_head, q_start, q_block_start, layout: gl.constexpr,
              HALF: gl.constexpr, GROUP: gl.constexpr):  # fmt: skip
        """This half's 64 rows in `layout`: (query position, token id, query head). Row r is
        token q_block_start + HALF * 64 // GROUP + r // GROUP, head kv_head * GROUP + r % G."""
        FIRST_ROW_Q: gl.constexpr = HALF * (HALF_ROWS // GROUP)
        r = gl.arange(0, HALF_ROWS, layout=layout)
        q_pos = q_block_start + FIRST_ROW_Q + r // GROUP
        return q_pos, (q_start + q_pos).to(gl.int64), kv_head * GROUP + r % GROUP

    @gluon.jit
    def _load_q(q_ptr, kv_head, q_start, q_len, q_block_start, stride_qt, stride_qh,
                ld_layout: gl.constexpr, HALF: gl.constexpr, GROUP: gl.constexpr):  # fmt: skip
        """This half's Q rows as two [64, 64] halves, in the load layout (the conversion to
        the wgmma operand is left to the first use, so the loads' latency can be hidden)."""
        q_pos, tok, head = _rows(
            kv_head, q_start, q_block_start, gl.SliceLayout(1, ld_layout), HALF, GROUP
        )
        d = gl.arange(0, HALF_D, layout=gl.SliceLayout(0, ld_layout))
        offs = gl.expand_dims(tok * stride_qt + head * stride_qh, 1) + gl.expand_dims(d, 0)
        mask = gl.expand_dims(q_pos < q_len, 1) & gl.expand_dims(d < HALF_D, 0)
        q_lo = gl.load(q_ptr + offs, mask=mask, other=0.0)
        q_hi = gl.load(q_ptr + offs + HALF_D, mask=mask, other=0.0)
        return q_lo, q_hi

    @gluon.jit
    def _take_turn(turns, k, HALF: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: wait until the other consumer has issued its matrix products for tile
        k - 1 (tile k of consumer 0 goes first), so one's products run while the other
        computes its softmax (FlashAttention-3's inter-warpgroup schedule)."""
        if PINGPONG:
            mbarrier.wait(turns.index(HALF), (k & 1) ^ (1 - HALF))

    @gluon.jit
    def _pass_turn(turns, HALF: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turns.index(1 - HALF), count=1)

    @gluon.jit
    def _softmax_step(s, m_i, l_i, scale_log2):
        """Online softmax over one unmasked score tile: (P in float32, the factor that
        rescales the earlier sums, new max, new sum)."""
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
        p = gl.exp2(s * scale_log2 - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _full_tiles_pipelined(
        q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, ready, empty, turns, t_all, full, scale_log2,
        m_i, l_i, acc_lo, acc_hi, HALF: gl.constexpr, TILE: gl.constexpr,
        NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr,
    ):  # fmt: skip
        """The unmasked tiles (full >= 1), with tile t's softmax running while tile t-1's
        P @ V is on the tensor cores (FlashAttention-3's intra-warpgroup overlap): the next
        tile's scores and the last P @ V are issued together, and the wait lets P @ V run
        on while the exponentials are computed."""
        dtype: gl.constexpr = q_lo.dtype
        s_layout: gl.constexpr = _score_layout(TILE)
        o_layout: gl.constexpr = _out_layout()
        p_dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        stage = _ready_stage(ready, t_all, NUM_STAGES)
        _take_turn(turns, t_all, HALF, PINGPONG)
        s = _scores(q_lo, q_hi, k_lo, k_hi, stage, s_layout, TILE)
        _pass_turn(turns, HALF, PINGPONG)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, scale_log2)
        p16 = gl.convert_layout(p.to(dtype), p_dot)
        for t in range(1, full):
            prev = stage
            stage = _ready_stage(ready, t_all + t, NUM_STAGES)
            _take_turn(turns, t_all + t, HALF, PINGPONG)
            s = _issue_scores(q_lo, q_hi, k_lo, k_hi, stage, s_layout, TILE)
            alpha_o = gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            acc_lo = warpgroup_mma(p16, v_lo.index(prev), acc_lo * alpha_o, is_async=True)
            acc_hi = warpgroup_mma(p16, v_hi.index(prev), acc_hi * alpha_o, is_async=True)
            _pass_turn(turns, HALF, PINGPONG)
            # Groups complete in order: two outstanding means the scores are done.
            s = warpgroup_mma_wait(num_outstanding=2, deps=(s,))
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, scale_log2)
            p16_next = gl.convert_layout(p.to(dtype), p_dot)
            # p16 stays live until its P @ V has read it.
            acc_lo, acc_hi, p16 = warpgroup_mma_wait(
                num_outstanding=0, deps=(acc_lo, acc_hi, p16)
            )
            mbarrier.arrive(empty.index(prev), count=1)
            p16 = p16_next
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        acc_lo, acc_hi = _accumulate(
            p16, v_lo.index(stage), v_hi.index(stage), acc_lo * alpha_o, acc_hi * alpha_o
        )
        mbarrier.arrive(empty.index(stage), count=1)
        return m_i, l_i, acc_lo, acc_hi

    @gluon.jit
    def _attend(
        q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, vm_lo, vm_hi, ready, empty, turns, t_all,
        q_len, q_block_start, ctx_len, num_tiles, scale_log2,
        HALF: gl.constexpr, GROUP: gl.constexpr, TILE: gl.constexpr, NUM_STAGES: gl.constexpr,
        PIPELINE: gl.constexpr, PINGPONG: gl.constexpr,
    ):  # fmt: skip
        """One item for one consumer warpgroup: online softmax over the item's key tiles (from
        ring position `t_all` on) for 64 of its 128 rows; returns (acc_lo, acc_hi, l)."""
        dtype: gl.constexpr = q_lo.dtype
        s_layout: gl.constexpr = _score_layout(TILE)
        o_layout: gl.constexpr = _out_layout()
        q_dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        p_dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        ld_layout: gl.constexpr = _load_layout()
        ROWS_Q: gl.constexpr = HALF_ROWS // GROUP  # query tokens of this half
        FIRST_ROW_Q: gl.constexpr = HALF * ROWS_Q
        q_lo = gl.convert_layout(q_lo, q_dot)
        q_hi = gl.convert_layout(q_hi, q_dot)

        # Causal pruning for this half: every row sees the first `full` tiles whole; the
        # diagonal tiles up to `tiles` are masked; the item's later tiles are only released.
        first_q = q_block_start + FIRST_ROW_Q
        last_q = gl.minimum(first_q + ROWS_Q, q_len) - 1
        my_keys = gl.maximum(ctx_len + last_q + 1, 0)
        tiles = gl.cdiv(my_keys, TILE)
        full = gl.minimum(gl.maximum(ctx_len + first_q + 1, 0) // TILE, tiles)
        if first_q >= q_len:  # the item's last rows, past the sequence: nothing to compute
            tiles = 0
            full = 0

        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        m_i = gl.full([HALF_ROWS], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([HALF_ROWS], gl.float32, row_s)
        acc_lo = gl.zeros([HALF_ROWS, HALF_D], gl.float32, o_layout)
        acc_hi = gl.zeros([HALF_ROWS, HALF_D], gl.float32, o_layout)

        if PIPELINE:
            if full > 0:
                m_i, l_i, acc_lo, acc_hi = _full_tiles_pipelined(
                    q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, ready, empty, turns, t_all, full,
                    scale_log2, m_i, l_i, acc_lo, acc_hi, HALF=HALF, TILE=TILE,
                    NUM_STAGES=NUM_STAGES, PINGPONG=PINGPONG,
                )  # fmt: skip
        else:
            for t in range(0, full):
                stage = _ready_stage(ready, t_all + t, NUM_STAGES)
                _take_turn(turns, t_all + t, HALF, PINGPONG)
                s = _scores(q_lo, q_hi, k_lo, k_hi, stage, s_layout, TILE)
                _pass_turn(turns, HALF, PINGPONG)
                p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, scale_log2)
                alpha_o = gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                p16 = gl.convert_layout(p.to(dtype), p_dot)
                acc_lo, acc_hi = _accumulate(
                    p16, v_lo.index(stage), v_hi.index(stage), acc_lo * alpha_o,
                    acc_hi * alpha_o,
                )  # fmt: skip
                mbarrier.arrive(empty.index(stage), count=1)

        # The diagonal: causal mask and bounds. A tile that runs past the sequence's last
        # written slot is multiplied from this warpgroup's own copy of V with those rows
        # zeroed (unwritten slots may hold NaN, and 0 * NaN is NaN).
        seq_len = ctx_len + q_len
        q_abs = ctx_len + first_q + gl.arange(0, HALF_ROWS, layout=row_s) // GROUP
        vm_lo_mine = vm_lo.index(HALF)
        vm_hi_mine = vm_hi.index(HALF)
        v_rows_layout: gl.constexpr = gl.SliceLayout(1, ld_layout)
        for t in range(full, tiles):
            stage = _ready_stage(ready, t_all + t, NUM_STAGES)
            _take_turn(turns, t_all + t, HALF, PINGPONG)
            s = _scores(q_lo, q_hi, k_lo, k_hi, stage, s_layout, TILE)
            _pass_turn(turns, HALF, PINGPONG)
            keys = t * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(0, s_layout))
            visible = (gl.expand_dims(keys, 0) <= gl.expand_dims(q_abs, 1)) & gl.expand_dims(
                keys < my_keys, 0
            )
            s = gl.where(visible, s * scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_safe = gl.where(m_new > float("-inf"), m_new, 0.0)
            p = gl.exp2(s - gl.expand_dims(m_safe, 1))
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            alpha_o = gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p16 = gl.convert_layout(p.to(dtype), p_dot)
            if (t + 1) * TILE > seq_len:
                # The tile runs past the sequence's written slots: zero those V rows.
                v_rows = t * TILE + gl.arange(0, TILE, layout=v_rows_layout)
                v_keep = gl.expand_dims(v_rows < my_keys, 1)
                vm_lo_mine.store(gl.where(v_keep, v_lo.index(stage).load(ld_layout), 0.0))
                vm_hi_mine.store(gl.where(v_keep, v_hi.index(stage).load(ld_layout), 0.0))
                fence_async_shared()
                _sync_threads()  # the whole warpgroup's rows in place before its wgmma
                acc_lo, acc_hi = _accumulate(
                    p16, vm_lo_mine, vm_hi_mine, acc_lo * alpha_o, acc_hi * alpha_o
                )
            else:  # every slot written (masked keys have P = 0 and finite V)
                acc_lo, acc_hi = _accumulate(
                    p16, v_lo.index(stage), v_hi.index(stage), acc_lo * alpha_o,
                    acc_hi * alpha_o,
                )  # fmt: skip
            mbarrier.arrive(empty.index(stage), count=1)

        # Tiles only the other half sees: release them as they arrive (and pass the turn:
        # both consumers take one per tile).
        for t in range(tiles, num_tiles):
            stage = _ready_stage(ready, t_all + t, NUM_STAGES)
            _take_turn(turns, t_all + t, HALF, PINGPONG)
            _pass_turn(turns, HALF, PINGPONG)
            mbarrier.arrive(empty.index(stage), count=1)
        return acc_lo, acc_hi, l_i

    @gluon.jit
    def _store_rows(out_ptr, acc_lo, acc_hi, l_i, kv_head, q_start, q_len, q_block_start,
                    stride_ot, stride_oh, HALF: gl.constexpr, GROUP: gl.constexpr):  # fmt: skip
        """acc / l into this half's rows of `out` (rows that saw no key get zeros)."""
        o_layout: gl.constexpr = acc_lo.type.layout
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        l_o = gl.convert_layout(l_i, row_o)
        inv = gl.expand_dims(1.0 / gl.where(l_o == 0.0, 1.0, l_o), 1)
        q_pos, tok, head = _rows(kv_head, q_start, q_block_start, row_o, HALF, GROUP)
        d = gl.arange(0, HALF_D, layout=gl.SliceLayout(0, o_layout))
        offs = gl.expand_dims(tok * stride_ot + head * stride_oh, 1) + gl.expand_dims(d, 0)
        mask = gl.expand_dims(q_pos < q_len, 1) & gl.expand_dims(d < HALF_D, 0)
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        gl.store(out_ptr + offs, (acc_lo * inv).to(dtype), mask=mask)
        gl.store(out_ptr + offs + HALF_D, (acc_hi * inv).to(dtype), mask=mask)

    @gluon.jit
    def _consume(
        q_ptr, out_ptr, k_lo, k_hi, v_lo, v_hi, vm_lo, vm_hi, ready, empty, turns, info,
        info_ready, info_empty, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh,
        HALF: gl.constexpr, GROUP: gl.constexpr, TILE: gl.constexpr, NUM_STAGES: gl.constexpr,
        PIPELINE: gl.constexpr, PINGPONG: gl.constexpr,
    ):  # fmt: skip
        """A consumer warpgroup: the items the producer hands over, until it says no more.
        The next item's Q rows are loaded before this item's output is written, so their
        latency hides behind the stores."""
        ld_layout: gl.constexpr = _load_layout()
        info_layout: gl.constexpr = gl.BlockedLayout([INFO_FIELDS], [32], [4], [0])
        f = gl.arange(0, INFO_FIELDS, layout=info_layout)
        more, kv_head, q_start, q_len, q_block_start, ctx_len, num_tiles = _take(
            info, info_ready, info_empty, 0, f
        )
        q_lo, q_hi = _load_q(q_ptr, kv_head, q_start, q_len, q_block_start, stride_qt,
                             stride_qh, ld_layout, HALF, GROUP)  # fmt: skip
        t_all = 0
        n = 1
        while more != 0:
            acc_lo, acc_hi, l_i = _attend(
                q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, vm_lo, vm_hi, ready, empty, turns, t_all,
                q_len, q_block_start, ctx_len, num_tiles, scale_log2,
                HALF=HALF, GROUP=GROUP, TILE=TILE, NUM_STAGES=NUM_STAGES, PIPELINE=PIPELINE,
                PINGPONG=PINGPONG,
            )  # fmt: skip
            t_all += num_tiles
            nxt = _take(info, info_ready, info_empty, n, f)
            n += 1
            q_lo, q_hi = _load_q(q_ptr, nxt[1], nxt[2], nxt[3], nxt[4], stride_qt, stride_qh,
                                 ld_layout, HALF, GROUP)  # fmt: skip
            _store_rows(out_ptr, acc_lo, acc_hi, l_i, kv_head, q_start, q_len, q_block_start,
                        stride_ot, stride_oh, HALF, GROUP)  # fmt: skip
            more, kv_head, q_start, q_len, q_block_start, ctx_len, num_tiles = nxt

    @gluon.jit
    def _consumer(
        q_ptr, out_ptr, k_desc, v_desc, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        k_lo, k_hi, v_lo, v_hi, vm_lo, vm_hi, ready, empty, turns, info, info_ready,
        info_empty, scale_log2, num_seqs, q_len_lo, num_items, num_q_blocks, num_kv_heads,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        GROUP: gl.constexpr, BLOCK_Q: gl.constexpr, TILE: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr, PIPELINE: gl.constexpr,
        PINGPONG: gl.constexpr, HALF: gl.constexpr,
    ):  # fmt: skip
        """A consumer partition (HALF 0: the default partition, 1: a worker)."""
        _consume(
            q_ptr, out_ptr, k_lo, k_hi, v_lo, v_hi, vm_lo, vm_hi, ready, empty, turns, info,
            info_ready, info_empty, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh,
            HALF=HALF, GROUP=GROUP, TILE=TILE, NUM_STAGES=NUM_STAGES, PIPELINE=PIPELINE,
            PINGPONG=PINGPONG,
        )  # fmt: skip

    @gluon.jit(do_not_specialize=["num_seqs", "q_len_lo", "num_items", "num_q_blocks",
                                  "stride_bt"])  # fmt: skip
    def _hopper_prefill_kernel(
        q_ptr, out_ptr, k_desc, v_desc, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        scale_log2, num_seqs, q_len_lo, num_items, num_q_blocks, num_kv_heads,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        GROUP: gl.constexpr, BLOCK_Q: gl.constexpr, TILE: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr, PIPELINE: gl.constexpr,
        PINGPONG: gl.constexpr,
    ):  # fmt: skip
        shape: gl.constexpr = [NUM_STAGES, TILE, HALF_D]
        k_lo = gl.allocate_shared_memory(k_desc.dtype, shape, k_desc.layout)
        k_hi = gl.allocate_shared_memory(k_desc.dtype, shape, k_desc.layout)
        v_lo = gl.allocate_shared_memory(v_desc.dtype, shape, v_desc.layout)
        v_hi = gl.allocate_shared_memory(v_desc.dtype, shape, v_desc.layout)
        vm_lo = gl.allocate_shared_memory(v_desc.dtype, [2, TILE, HALF_D], v_desc.layout)
        vm_hi = gl.allocate_shared_memory(v_desc.dtype, [2, TILE, HALF_D], v_desc.layout)
        info = gl.allocate_shared_memory(
            gl.int32, [2, INFO_FIELDS], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        info_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        info_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one release per consumer
        for i in gl.static_range(2):
            mbarrier.init(info_ready.index(i), count=1)
            mbarrier.init(info_empty.index(i), count=2)
            mbarrier.init(turns.index(i), count=1)

        # Constexprs reach the partitions only when written in the tuple itself.
        gl.warp_specialize(
            [
                (_consumer, (
                    q_ptr, out_ptr, k_desc, v_desc, block_tables_ptr, query_start_loc_ptr,
                    seq_lens_ptr, k_lo, k_hi, v_lo, v_hi, vm_lo, vm_hi, ready, empty, turns,
                    info, info_ready, info_empty, scale_log2, num_seqs, q_len_lo, num_items,
                    num_q_blocks, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_bt, GROUP, BLOCK_Q, TILE, BLOCK_SIZE, NUM_STAGES, PIPELINE,
                    PINGPONG, 0,
                )),
                (_consumer, (
                    q_ptr, out_ptr, k_desc, v_desc, block_tables_ptr, query_start_loc_ptr,
                    seq_lens_ptr, k_lo, k_hi, v_lo, v_hi, vm_lo, vm_hi, ready, empty, turns,
                    info, info_ready, info_empty, scale_log2, num_seqs, q_len_lo, num_items,
                    num_q_blocks, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_bt, GROUP, BLOCK_Q, TILE, BLOCK_SIZE, NUM_STAGES, PIPELINE,
                    PINGPONG, 1,
                )),
                (_produce, (
                    q_ptr, out_ptr, k_desc, v_desc, block_tables_ptr, query_start_loc_ptr,
                    seq_lens_ptr, k_lo, k_hi, v_lo, v_hi, vm_lo, vm_hi, ready, empty, turns,
                    info, info_ready, info_empty, scale_log2, num_seqs, q_len_lo, num_items,
                    num_q_blocks, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_bt, GROUP, BLOCK_Q, TILE, BLOCK_SIZE, NUM_STAGES, PIPELINE,
                    PINGPONG, 1,
                )),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


def _descriptor(cache: torch.Tensor) -> Any:
    """TMA descriptor over a [blocks, block_size, Hkv, D] cache as rows of Hkv * D, copying
    one cache block's 64-wide half row (a [block_size, 64] box) at a time.

    Built at each launch (a few microseconds, against a launch's milliseconds of work) rather
    than kept: a descriptor holds its tensor, so a cache of them would keep a dropped engine's
    whole KV pool in memory."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = cache.view(num_blocks * block_size, num_kv_heads * head_dim)
    layout = _box_layout(block_size, cache.dtype)
    return TensorDescriptor.from_tensor(rows, [block_size, _HALF_D], layout)


@functools.cache
def _box_layout(block_size: int, dtype: torch.dtype) -> Any:
    elem = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([block_size, _HALF_D], elem)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def hopper_prefill_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale_log2: float,
    min_query_len: int,
    *,
    overrides: dict[str, int] | None = None,
) -> None:
    """Attention of every sequence with at least `min_query_len` query tokens into `out`
    (the other rows are left as they are); `supported(q, k_cache, v_cache)` must hold.
    `overrides` replaces entries of `HOPPER_PREFILL_CONFIG` (TILE, NUM_STAGES).

    The grid is persistent: one program per multiprocessor (fewer for small launches), each
    taking every grid-th item of (block of query rows, KV head), longest blocks first."""
    cfg = {**HOPPER_PREFILL_CONFIG, **(overrides or {})}
    num_tokens, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_q = _ROWS // group
    num_seqs = seq_lens.shape[0]
    num_q_blocks = num_tokens // block_q + num_seqs  # a bound the host knows
    num_items = num_q_blocks * num_kv_heads
    grid = (min(num_items, _num_sms(q.device)),)
    _hopper_prefill_kernel[grid](
        q, out, _descriptor(k_cache), _descriptor(v_cache), block_tables, query_start_loc,
        seq_lens, scale_log2, num_seqs, min_query_len, num_items, num_q_blocks, num_kv_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, TILE=cfg["TILE"], BLOCK_SIZE=block_size,
        NUM_STAGES=cfg["NUM_STAGES"], PIPELINE=bool(cfg["PIPELINE"]),
        PINGPONG=bool(cfg["PINGPONG"]), num_warps=4,
        maxnreg=_MAXNREG,
    )  # fmt: skip


def try_hopper_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale_log2: float,
    min_query_len: int,
) -> bool:
    """`hopper_prefill_launch` if `supported`, returning whether it ran. The first launch of
    each specialization compiles it; a kernel that does not build with this Triton is
    reported once and never tried again (the caller then runs the Triton kernel)."""
    if not supported(q, k_cache, v_cache):
        return False
    args = (q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, scale_log2,
            min_query_len)  # fmt: skip
    key = (q.shape[1] // k_cache.shape[2], k_cache.shape[1], q.dtype,
           tuple(sorted(HOPPER_PREFILL_CONFIG.items())))  # fmt: skip
    if key in _BUILT:
        hopper_prefill_launch(*args)
        return True
    try:
        hopper_prefill_launch(*args)
    except Exception as exc:  # a compiler error from an untested Triton: fall back, once
        import triton

        _BUILD_FAILURE.append(f"{type(exc).__name__}: {exc}"[:500])
        logger.warning(
            "The Gluon prefill attention kernel does not build with Triton %s (%s); prefill "
            "attention runs the Triton kernel instead.", triton.__version__,
            _BUILD_FAILURE[0].splitlines()[0],
        )  # fmt: skip
        return False
    _BUILT.add(key)
    return True
