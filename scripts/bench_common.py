"""Shared pieces of the GPU benchmarks: model shapes of BENCHMARKS.md and dummy model dirs."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # W1 / L1: Llama-2-7B
    "llama2-7b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    ),
    # W2: Llama-3-8B
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        bos_token_id=128000,
        eos_token_id=128001,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    ),
    # A small shape for smoke runs.
    "tiny": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
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


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def triton_variants() -> dict[str, int]:
    """Compiled variants per Triton kernel of `kernels` so far: a pass that adds any paid for
    a compile (or a disk-cache load) inside the timed region."""
    import sys

    counts: dict[str, int] = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("kernels.") or mod is None:
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
                counts[f"{mod_name.removeprefix('kernels.')}.{name}"] = n
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
