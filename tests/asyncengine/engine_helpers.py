"""Helpers for engine tests: HF greedy references, pool-emptiness checks, a pool that must
preempt, HF models saved as checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncengine.llm import LLM

# Engine arguments for a pool too small for the batch, with no room kept for growth at
# admission (which would spare the running requests): the engine must preempt.
TINY_POOL = {"num_kv_blocks": 14, "schedule_conservativeness": 0}


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """HF transformers `generate`, one prompt at a time (no padding effects), EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def assert_pool_clean(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    if engine.scheduler.swap_space is not None:
        assert engine.scheduler.swap_space.num_free_blocks == engine.scheduler.swap_space.num_blocks


def save_hf(model: torch.nn.Module, tokenizer_dir: Path | None, path: Path) -> Path:
    from transformers import AutoTokenizer

    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
    return path
