"""The embedded SmolLM2-135M: our logits equal HF loading the same GGUF, and it knows Paris."""

from __future__ import annotations

from pathlib import Path

import torch

from models.config import ModelConfig
from models.default_model import default_gguf_path
from tests.models.test_llama import assert_close_rel, flat_forward


def test_default_model_architecture(default_model_dir: Path) -> None:
    cfg = ModelConfig.from_dir(default_model_dir)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings


def test_logits_match_hf_gguf(default_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    texts = [
        "The capital of France is",
        "Hello",
        "def fibonacci(n):\n    if n < 2:\n        return",
    ]
    prompts = [tok.encode(t) for t in texts]
    ours = flat_forward(default_model_dir, prompts)
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    with torch.inference_mode():
        for p, logits in zip(prompts, ours, strict=True):
            assert_close_rel(logits, hf(torch.tensor([p])).logits[0])


def test_minimal_greedy_loop_answers_paris(default_model_dir: Path) -> None:
    """A plain greedy loop (full recompute per token) over our model, no engine involved."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    start = len(ids)
    for _ in range(12):
        logits = flat_forward(default_model_dir, [ids])[0]
        ids.append(int(logits[-1].argmax()))
        if ids[-1] == tok.eos_token_id:
            break
    assert "Paris" in tok.decode(ids[start:])
