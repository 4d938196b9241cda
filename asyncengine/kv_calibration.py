"""FP8 KV-cache scales calibrated at start-up, for a checkpoint that carries none.

With `kv_cache_dtype="fp8"` each attention layer stores K and V divided by a float32 scale per
KV head. A checkpoint may bring them (`self_attn.k_scale` / `v_scale`); when it does not (or
`calculate_kv_scales=True`), the engine runs the model once, before the KV pool exists and
before CUDA graphs are captured, over a fixed text shipped in the package
(`asyncengine/data/kv_calibration.txt`), through a scratch cache of the model dtype bound to
the layers for that pass only. Each KV head's scale is the largest |K| (after rotary, as
cached) or |V| it stored, over 448, the largest e4m3 value: scales of 1.0 send the small
values of some layers (SmolLM2's first-layer V) into e4m3's subnormals.

Without a tokenizer (`skip_tokenizer_init`) the pass runs over a fixed pseudo-random id
sequence instead. Under tensor parallelism rank 0 picks the ids and every rank runs the pass
with them (the forward's collectives line up), each calibrating its own KV heads.
`scripts/eval_quant.py` calibrates through the same `calibrate_kv_scales`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asyncengine_kernels.fp8_format import FP8_E4M3_MAX
from models.forward_context import AttentionMetadata, set_forward_context

logger = logging.getLogger(__name__)

CALIBRATION_TEXT = Path(__file__).resolve().parent / "data" / "kv_calibration.txt"
# Keeps a head that stored only zeros from a zero scale (its values stay zero either way).
MIN_SCALE = 1e-8
# Without a tokenizer: this many ids, drawn from a generator of this seed.
FIXED_IDS_LENGTH = 512
FIXED_IDS_SEED = 0

# Per layer, the K and V scales: float32 [num_kv_heads of this rank] each.
KVScales = list[tuple[torch.Tensor, torch.Tensor]]


def should_calibrate(
    calculate_kv_scales: bool | None, fp8_cache: bool, checkpoint_has_scales: bool
) -> bool:
    """`EngineArgs.calculate_kv_scales`: None calibrates an FP8 cache whose checkpoint has no
    KV scales, True always (EngineArgs refuses it without an FP8 cache), False never."""
    if not fp8_cache:
        return False
    if calculate_kv_scales is None:
        return not checkpoint_has_scales
    return calculate_kv_scales


def checkpoint_has_kv_scales(model: nn.Module) -> bool:
    """Whether loading set any layer's K or V scale from the checkpoint."""
    return any(attn.kv_scales_loaded for attn in model.attention_layers())  # type: ignore[operator]


def calibration_token_ids(tokenizer: Any | None, vocab_size: int, max_len: int) -> list[int]:
    """The ids of the calibration pass: the shipped text as the tokenizer encodes a prompt,
    or, without a tokenizer, a fixed pseudo-random sequence; at most `max_len` of them."""
    if tokenizer is not None:
        ids = list(tokenizer.encode(CALIBRATION_TEXT.read_text()))
    else:
        gen = torch.Generator().manual_seed(FIXED_IDS_SEED)
        ids = torch.randint(0, vocab_size, (FIXED_IDS_LENGTH,), generator=gen).tolist()
    return ids[:max_len]


def calibrate_kv_scales(
    model: nn.Module,
    token_ids: list[int],
    *,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int = 16,
    per_head: bool = True,
) -> KVScales:
    """Per layer, K and V scales that map the largest |K| (after rotary) and |V| of one
    prefill of `token_ids` to 448: per KV head, or with `per_head=False` the layer's largest
    in every entry. The pass writes into a scratch cache of `dtype` only; the layers' own
    caches are bound again afterwards. The model's scales are left as they were."""
    if not token_ids:
        raise ValueError("KV scale calibration needs at least one token")
    layers = model.attention_layers()  # type: ignore[operator]
    bound = [(attn.k_cache, attn.v_cache) for attn in layers]
    try:
        with torch.inference_mode():
            prefill_through_scratch_cache(model, token_ids, dtype=dtype, device=device,
                                          block_size=block_size)  # fmt: skip
            scales = []
            for attn in layers:
                pair = []
                for cache in (attn.k_cache, attn.v_cache):
                    amax = cache.abs().amax(dim=(0, 1, 3)).float()  # per KV head
                    if not per_head:
                        amax = amax.max().expand_as(amax)
                    pair.append((amax / FP8_E4M3_MAX).clamp(min=MIN_SCALE).clone())
                scales.append((pair[0], pair[1]))
    finally:
        for attn, (k_cache, v_cache) in zip(layers, bound, strict=True):
            attn.k_cache, attn.v_cache = k_cache, v_cache
    return scales


def prefill_through_scratch_cache(
    model: nn.Module, token_ids: list[int], *, dtype: torch.dtype, device: torch.device,
    block_size: int = 16,
) -> torch.Tensor:  # fmt: skip
    """One sequence as one prefill step through fresh zeroed caches of `dtype` bound to every
    attention layer (left bound: the caller reads or replaces them); the hidden states."""
    n = len(token_ids)
    blocks = -(-n // block_size)
    for attn in model.attention_layers():  # type: ignore[operator]
        shape = (blocks, block_size, attn.num_kv_heads, attn.head_dim)
        attn.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        attn.v_cache = torch.zeros(shape, dtype=dtype, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device).unsqueeze(0),
        max_query_len=n,
        max_seq_len=n,
    )
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    positions = torch.arange(n, dtype=torch.int64, device=device)
    with set_forward_context(meta):
        return model(ids, positions)


def set_kv_scales(model: nn.Module, scales: KVScales) -> None:
    """Copy per-layer scales (from `calibrate_kv_scales`) into the attention layers."""
    layers = model.attention_layers()  # type: ignore[operator]
    with torch.no_grad():
        for attn, (k_scale, v_scale) in zip(layers, scales, strict=True):
            attn.k_scale.copy_(k_scale)
            attn.v_scale.copy_(v_scale)


def describe_kv_scales(scales: KVScales, num_tokens: int) -> str:
    """The start-up log line: how many tokens, and the range of the K and V scales."""
    k = torch.cat([s[0].flatten().cpu() for s in scales])
    v = torch.cat([s[1].flatten().cpu() for s in scales])
    return (
        f"KV scales calibrated on {num_tokens} tokens: K scale range "
        f"{float(k.min()):.3g}..{float(k.max()):.3g}, V scale range "
        f"{float(v.min()):.3g}..{float(v.max()):.3g}"
    )
