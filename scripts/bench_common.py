"""Shared pieces of the GPU benchmarks: model shapes of BENCHMARKS.md, dummy model dirs and
the hardware floor (the least time one H200 needs for a set of requests)."""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# What the Llama-2-7B and Llama-3-8B shapes share.
_LLAMA_7B_CLASS: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    rms_norm_eps=1e-5,
    torch_dtype="bfloat16",
    tie_word_embeddings=False,
)
# What the small shapes (smoke runs, a draft model) share.
_SMALL_LLAMA: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="bfloat16",
    tie_word_embeddings=False,
)
# W2's shape, which the long-prompt shape extends.
LLAMA3_8B: dict[str, Any] = dict(
    _LLAMA_7B_CLASS,
    intermediate_size=14336,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    bos_token_id=128000,
    eos_token_id=128001,
)

SHAPES: dict[str, dict[str, Any]] = {
    # W1 / L1: Llama-2-7B
    "llama2-7b": dict(
        _LLAMA_7B_CLASS,
        intermediate_size=11008,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # W2: Llama-3-8B
    "llama3-8b": LLAMA3_8B,
    # Long prompts: Llama-3.1-8B, W2's shape with llama3 RoPE scaling and a 128k context
    # (Llama-3-8B's 8192 cannot hold an 8192-token prompt and its output).
    "llama3.1-8b": dict(
        LLAMA3_8B,
        max_position_embeddings=131072,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
    ),
    # A draft model for Llama-2-7B: Llama-160M's shape (12 layers of 768), Llama-2's vocabulary.
    "llama-160m": dict(
        _SMALL_LLAMA,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        vocab_size=32000,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
    ),
    # A small shape for smoke runs.
    "tiny": dict(
        _SMALL_LLAMA,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=4096,
    ),
}


def dummy_model_dir(shape: str) -> Path:
    """A directory holding only config.json, for load_format='dummy'."""
    path = Path(tempfile.gettempdir()) / f"asyncengine-dummy-{shape}"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(SHAPES[shape], indent=2))
    return path


def param_count(shape: str) -> int:
    c = SHAPES[shape]
    h, i, layers, v = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        c["vocab_size"],
    )
    hd = h // c["num_attention_heads"]
    attn = h * hd * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)
    return layers * (attn + 3 * h * i + 2 * h) + 2 * v * h + h


PEAK_FLOPS = 787.5e12  # measured bf16 dense matmul on one H200
PEAK_BW = 4.25e12  # measured device-to-device copy rate


def kv_bytes_per_token(shape: str, kv_elem_bytes: int = 2) -> int:
    c = SHAPES[shape]
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * kv_elem_bytes


def prefill_flops(shape: str, prompt_len: int) -> float:
    """FLOPs of one prompt's prefill: 2 per parameter per token, plus causal attention's
    QK^T and PV (2 FLOPs per multiply-add, 2 products, head_dim x query heads, over the
    p(p+1)/2 query/key pairs of each layer): the quadratic term that dominates long prompts."""
    c = SHAPES[shape]
    linear = 2.0 * param_count(shape) * prompt_len
    pairs = prompt_len * (prompt_len + 1) / 2
    attention = 4.0 * c["num_hidden_layers"] * c["hidden_size"] * pairs
    return linear + attention


def floor_seconds_for(shape: str, prefill_lens: Sequence[int],
                      decodes: Sequence[tuple[int, int]], concurrency: int, weight_bytes: int,
                      kv_elem_bytes: int = 2) -> dict[str, float]:
    """Lower bound on the time one H200 needs (BENCHMARKS.md): prefill at the matmul peak,
    and for each decode step the weights read once plus every running sequence's KV cache.
    `prefill_lens`: the prompts prefilled; `decodes`: (prompt_len, output_len) per decoding
    sequence. At most `concurrency` sequences decode in one step, and no sequence emits two
    tokens in one, so the steps are at least the longest output and the outputs over the
    concurrency."""
    prefill = sum(prefill_flops(shape, p) for p in prefill_lens) / PEAK_FLOPS
    # Each output token reads the KV of its context: the prompt and half its output on average.
    kv_tokens = sum(o * (p + o / 2) for p, o in decodes)
    kv = kv_tokens * kv_bytes_per_token(shape, kv_elem_bytes) / PEAK_BW
    outputs = [o for _, o in decodes]
    steps = max(max(outputs, default=0), math.ceil(sum(outputs) / max(concurrency, 1)))
    weights = steps * weight_bytes / PEAK_BW
    return {"prefill_s": prefill, "kv_read_s": kv, "weights_s": weights,
            "total_s": prefill + kv + weights}


def request_floor_seconds(shape: str, prompt_len: int, output_len: int, weight_bytes: int,
                          kv_elem_bytes: int = 2) -> float:
    """Least time from a request's arrival to its last token on an otherwise idle H200: its
    prefill (which yields the first token), then one step per further token, each reading
    the weights and the request's own KV cache."""
    decode_steps = max(output_len - 1, 0)
    kv = decode_steps * (prompt_len + output_len / 2) * kv_bytes_per_token(shape, kv_elem_bytes)
    return (prefill_flops(shape, prompt_len) / PEAK_FLOPS
            + (decode_steps * weight_bytes + kv) / PEAK_BW)


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two outputs share (the shorter's length if one is a prefix
    of the other): where two greedy runs part."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))  # fmt: skip


def triton_variants() -> dict[str, int]:
    """Compiled variants per Triton kernel of `asyncengine_kernels` so far: a pass that adds any
    paid for a compile (or a disk-cache load) inside the timed region."""
    import sys

    counts: dict[str, int] = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("asyncengine_kernels.") or mod is None:
            continue
        for name, fn in vars(mod).items():
            caches = getattr(fn, "device_caches", None)
            if not isinstance(caches, dict):
                continue
            n = 0
            for entry in caches.values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                n += len(cache) if hasattr(cache, "__len__") else 0
            if n:
                counts[f"{mod_name.removeprefix('asyncengine_kernels.')}.{name}"] = n
    return counts


def cuda_segment_allocs() -> int:
    """cudaMalloc calls made by torch's caching allocator so far (0 without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_stats().get("segment.all.allocated", 0))


def warmth_delta(before: tuple[dict[str, int], int]) -> dict[str, Any]:
    """What a pass added since `before` (from `warmth()`): new kernel variants and mallocs."""
    variants, allocs = warmth()
    new = {k: v - before[0].get(k, 0) for k, v in variants.items() if v > before[0].get(k, 0)}
    return {"new_triton_variants": new, "new_cuda_segments": allocs - before[1]}


def warmth() -> tuple[dict[str, int], int]:
    return triton_variants(), cuda_segment_allocs()
