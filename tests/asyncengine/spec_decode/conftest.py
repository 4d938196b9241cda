"""Fixtures of the draft-model tests: a tiny target and a smaller draft of its vocabulary."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from asyncengine import LLM
from tests.asyncengine.engine_helpers import save_hf


@pytest.fixture(scope="module")
def pair(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 2-layer target whose second layer adds little, and a 1-layer draft made of the
    target's first layer: same vocabulary, fewer weights, agreeing with the target often but
    not always (about half its drafts are accepted)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if ".layers.1." in name and ("o_proj" in name or "down_proj" in name):
                p.mul_(0.2)
    root = tmp_path_factory.mktemp("draft-pair")
    target_dir = save_hf(target, tiny_llama_dir, root / "target")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = 1
    draft = LlamaForCausalLM(cfg)
    draft.load_state_dict(
        {k: v for k, v in target.state_dict().items() if ".layers.1." not in k}, strict=True
    )
    return target_dir, save_hf(draft, tiny_llama_dir, root / "draft")


@pytest.fixture(scope="module")
def base(pair: tuple[Path, Path]) -> LLM:
    return LLM(str(pair[0]), dtype="float32", device="cpu")
