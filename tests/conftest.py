"""Shared fixtures: tiny random Llama-family models saved as HF directories, built offline."""

from __future__ import annotations

import os

# Triton kernels run in the interpreter on CPU machines; it must be set before any
# @triton.jit decorator executes, i.e. before kernels are imported.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

from pathlib import Path

import pytest

from tests.tiny_models import build_tiny_model_dir, build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer().save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GQA Llama (4 query / 2 KV heads) with a byte-level BPE tokenizer."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama3")


@pytest.fixture(scope="session")
def tiny_mha_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer MHA Llama-2-style model."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-mha"), "llama2")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from models.default_model import default_model_dir as resolve

    return resolve()


@pytest.fixture(scope="session")
def q1_base() -> tuple[Path, list[int], float]:
    """Q1's 16-bit baseline, computed once for every accuracy test: the embedded SmolLM2's
    directory, the evaluation text's tokens and its perplexity (skips without the model)."""
    from models.default_model import default_model_dir
    from scripts.eval_quant import eval_tokens, perplexity

    try:
        model_dir = default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tokens = eval_tokens(model_dir)
    return model_dir, tokens, perplexity(model_dir, tokens)
