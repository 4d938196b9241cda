"""Top-k / top-p / min-p filtering and sampling by the exponential race, without host syncs.

Order (as in vLLM): keep the top_k largest logits; then top-p over the renormalized softmax of
what is left (the smallest set of most likely tokens whose mass reaches top_p, at least one);
then min-p (drop tokens whose probability is below min_p times the largest); then sample
argmax(probs / exp_noise), where exp_noise holds Exponential(1) draws made by the caller, so a
seeded request reproduces whatever batch it is in. Disabled values: top_k <= 0 or >= V,
top_p == 1, min_p == 0.

- `apply_top_k_top_p_min_p_ref` / `sample_from_logits_ref`: torch, with one full-vocab sort
  (skipped on CPU when no row uses top-k/top-p). The CPU path and the oracle.
- `sample_from_logits_triton`: one program per row and no sort. Each filter becomes a
  threshold on the logit value: top-k's is the k-th largest logit, top-p's the largest logit
  t whose "mass of tokens >= t" still reaches top_p, min-p's is max + log(min_p). The first two
  are found by a search over the order-preserving integer image of the float32 logits; each
  pass over the row tests 16 pivots at once, so a search takes about 8 passes (32 bits,
  4 bits a pass) and is exact. A row with no filter costs two passes (max, then the race);
  top-k adds ~8, top-p ~9 (skipped when min-p's threshold is already the higher one).
  Tokens tied with a threshold are all kept, where a sort would break ties by position.
"""

from __future__ import annotations

import torch

from asyncengine_kernels._triton_utils import tl, triton, use_triton

__all__ = [
    "apply_top_k_top_p_min_p_ref",
    "sample_from_logits",
    "sample_from_logits_ref",
    "sample_from_logits_triton",
]


def apply_top_k_top_p_min_p_ref(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Masked copy of logits [B, V] (float32): -inf where a filter drops the token."""
    vocab = logits.shape[-1]
    logits = logits.float()
    k = top_k.to(torch.int64)
    k_on = (k > 0) & (k < vocab)
    p_on = top_p < 1.0
    # On CPU a host check is free and skips the sort; on CUDA always sort (no sync).
    if logits.is_cuda or bool((k_on | p_on).any()):
        vals, idx = logits.sort(dim=-1)  # ascending
        kth_pos = (vocab - torch.where(k_on, k, vocab)).unsqueeze(1)
        kth = vals.gather(1, kth_pos)
        vals = vals.masked_fill(vals < kth, float("-inf"))
        cum = vals.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p.to(cum.dtype)).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        vals = vals.masked_fill(drop & p_on.unsqueeze(1), float("-inf"))
        logits = torch.empty_like(vals).scatter_(1, idx, vals)
    else:
        logits = logits.clone()
    probs = logits.softmax(dim=-1)
    limit = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.dtype).unsqueeze(1)
    return logits.masked_fill(probs < limit, float("-inf"))


def sample_from_logits_ref(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    exp_noise: torch.Tensor,
) -> torch.Tensor:
    masked = apply_top_k_top_p_min_p_ref(logits, top_k, top_p, min_p)
    return (masked.softmax(dim=-1) / exp_noise).argmax(dim=-1)


@triton.jit
def _float_key(x):
    """Order-preserving map of float32 to int32 (negative floats: flip the magnitude bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _pivots(lo, hi, NUM_PIVOTS: tl.constexpr):
    """NUM_PIVOTS increasing int32 keys in (lo, hi], the last one == hi."""
    i = tl.arange(0, NUM_PIVOTS).to(tl.int64) + 1
    width = hi.to(tl.int64) - lo.to(tl.int64)
    return (lo.to(tl.int64) + (width * i + NUM_PIVOTS - 1) // NUM_PIVOTS).to(tl.int32)


@triton.jit
def _narrow(lo, hi, piv, ok):
    """Keep the largest pivot where the predicate holds as lo, the next one (minus 1) as hi."""
    new_lo = tl.max(tl.where(ok, piv, lo), axis=0)
    new_hi = tl.min(tl.where(ok, hi, piv - 1), axis=0)
    return new_lo, new_hi


@triton.jit
def _sample_kernel(
    logits_ptr,
    noise_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    out_ptr,
    vocab,
    stride_l,
    stride_n,
    BLOCK_V: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    offs = tl.arange(0, BLOCK_V)
    k = tl.load(top_k_ptr + row).to(tl.int32)
    p = tl.load(top_p_ptr + row).to(tl.float32)
    min_p = tl.load(min_p_ptr + row).to(tl.float32)
    key_min = -2147483647 - 1

    m = float("-inf")
    for start in range(0, vocab, BLOCK_V):
        x = tl.load(row_ptr + start + offs, mask=start + offs < vocab, other=float("-inf"))
        m = tl.maximum(m, tl.max(x, axis=0))
    key_max = _float_key(m)

    # top-k: the largest key t with count(key >= t) >= k, i.e. the k-th largest logit.
    # Per-pivot partial counts stay elementwise in a 2D accumulator; one reduction per pass.
    thr_k = key_min
    if (k > 0) & (k < vocab):
        lo = key_min
        hi = key_max
        while lo < hi:
            piv = _pivots(lo, hi, NUM_PIVOTS)
            count = tl.zeros([BLOCK_V, NUM_PIVOTS], dtype=tl.int32)
            for start in range(0, vocab, BLOCK_V):
                valid = start + offs < vocab
                x = tl.load(row_ptr + start + offs, mask=valid, other=float("-inf"))
                ge = (_float_key(x)[:, None] >= piv[None, :]) & valid[:, None]
                count += ge.to(tl.int32)
            lo, hi = _narrow(lo, hi, piv, tl.sum(count, axis=0) >= k)
        thr_k = lo

    # min-p: p_i >= min_p * p_max  <=>  x_i >= max + log(min_p).
    thr_min = key_min
    if min_p > 0.0:
        thr_min = _float_key(m + tl.log(min_p))

    # top-p over the top-k survivors: the largest t whose mass(key >= t) reaches p * total.
    # When even the min-p survivors fall short of p * total, min-p's threshold is the higher
    # one and the search is skipped.
    thr_p = key_min
    if p < 1.0:
        total = 0.0
        above_min = 0.0
        for start in range(0, vocab, BLOCK_V):
            x = tl.load(row_ptr + start + offs, mask=start + offs < vocab, other=float("-inf"))
            key = _float_key(x)
            e = tl.where(key >= thr_k, tl.exp(x - m), 0.0)
            total += tl.sum(e, axis=0)
            above_min += tl.sum(tl.where(key >= thr_min, e, 0.0), axis=0)
        target = p * total
        if above_min >= target:
            lo = tl.maximum(thr_k, thr_min)
            hi = key_max
            while lo < hi:
                piv = _pivots(lo, hi, NUM_PIVOTS)
                mass = tl.zeros([BLOCK_V, NUM_PIVOTS], dtype=tl.float32)
                for start in range(0, vocab, BLOCK_V):
                    valid = start + offs < vocab
                    x = tl.load(row_ptr + start + offs, mask=valid, other=float("-inf"))
                    key = _float_key(x)
                    e = tl.where(key >= thr_k, tl.exp(x - m), 0.0)
                    mass += tl.where(key[:, None] >= piv[None, :], e[:, None], 0.0)
                lo, hi = _narrow(lo, hi, piv, tl.sum(mass, axis=0) >= target)
            thr_p = lo

    thr = tl.maximum(tl.maximum(thr_k, thr_p), thr_min)

    # Exponential race among the survivors: argmax of exp(x - max) / noise.
    best = -1.0
    best_idx = 0
    for start in range(0, vocab, BLOCK_V):
        valid = start + offs < vocab
        x = tl.load(row_ptr + start + offs, mask=valid, other=float("-inf"))
        noise = tl.load(noise_ptr + row * stride_n + start + offs, mask=valid, other=1.0)
        score = tl.where(valid & (_float_key(x) >= thr), tl.exp(x - m) / noise, -1.0)
        tile_best = tl.max(score, axis=0)
        tile_idx = tl.argmax(score, axis=0) + start
        take = tile_best > best
        best_idx = tl.where(take, tile_idx, best_idx)
        best = tl.where(take, tile_best, best)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


def sample_from_logits_triton(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    exp_noise: torch.Tensor,
) -> torch.Tensor:
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    noise = exp_noise.float()
    if noise.stride(-1) != 1:
        noise = noise.contiguous()
    block_v = min(512, triton.next_power_of_2(vocab))
    _sample_kernel[(num_rows,)](
        logits, noise, top_k, top_p, min_p, out, vocab, logits.stride(0), noise.stride(0),
        BLOCK_V=block_v, NUM_PIVOTS=16, num_warps=8,
    )  # fmt: skip
    return out


def sample_from_logits(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    exp_noise: torch.Tensor,
) -> torch.Tensor:
    """Filtered sampling of token ids int64 [B] from temperature-scaled logits [B, V]."""
    fn = sample_from_logits_triton if use_triton(logits) else sample_from_logits_ref
    return fn(logits, top_k, top_p, min_p, exp_noise)
