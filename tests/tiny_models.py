"""Tiny random models of each supported architecture, saved as HF dirs (no downloads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Hello world! How are you today? I am fine, thank you.",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji: 😀🚀🎉 café naïve résumé",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000",
] * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer(vocab_size: int = 512) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(kind: str, vocab_size: int = 512) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        architectures=None,
    )
    if kind == "llama2":
        cfg = tf.LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **common)
        cfg.architectures = ["LlamaForCausalLM"]
    elif kind == "llama3":
        cfg = tf.LlamaConfig(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
            **common,
        )
        cfg.architectures = ["LlamaForCausalLM"]
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **common)
        cfg.architectures = ["Qwen2ForCausalLM"]
    elif kind == "tied":
        cfg = tf.LlamaConfig(
            num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, **common
        )
        cfg.architectures = ["LlamaForCausalLM"]
    elif kind == "mistral":
        cfg = tf.MistralConfig(
            num_attention_heads=4, num_key_value_heads=2, sliding_window=None, **common
        )
        cfg.architectures = ["MistralForCausalLM"]
    else:
        raise ValueError(kind)
    return cfg


def build_tiny_model_dir(path: Path, kind: str, with_tokenizer: bool = True) -> Path:
    import transformers as tf

    tokenizer = build_tiny_tokenizer()
    cfg = tiny_config(kind, vocab_size=len(tokenizer))
    torch.manual_seed(1234)
    cls = {"qwen2": tf.Qwen2ForCausalLM, "mistral": tf.MistralForCausalLM}.get(
        kind, tf.LlamaForCausalLM
    )
    model = cls(cfg)
    # Random init gives near-uniform logits; sharpen them so greedy paths are stable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(str(path), safe_serialization=True)
    if with_tokenizer:
        tokenizer.save_pretrained(str(path))
    return path
