"""The per-step attention metadata: nesting, and one context per thread."""

from __future__ import annotations

import threading

import pytest
import torch

from models.forward_context import AttentionMetadata, get_attention_metadata, set_forward_context


def _meta(num_tokens: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.zeros((1, 1), dtype=torch.int32),
    )


def test_unset_raises_and_nesting_restores() -> None:
    with pytest.raises(RuntimeError, match="not set"):
        get_attention_metadata()
    outer, inner = _meta(3), _meta(5)
    with set_forward_context(outer):
        with set_forward_context(inner):
            assert get_attention_metadata() is inner
        assert get_attention_metadata() is outer
    with pytest.raises(RuntimeError, match="not set"):
        get_attention_metadata()


def test_each_thread_sees_its_own_step() -> None:
    """Two engines stepping in two threads (an AsyncLLMEngine beside an offline LLM) must not
    read each other's metadata, whatever the interleaving."""
    mine, theirs = _meta(4), _meta(1)
    entered, checked = threading.Event(), threading.Event()
    seen: list[object] = []

    def other_engine() -> None:
        with set_forward_context(theirs):
            entered.set()
            checked.wait(5)
            seen.append(get_attention_metadata())

    with set_forward_context(mine):
        thread = threading.Thread(target=other_engine)
        thread.start()
        assert entered.wait(5)
        assert get_attention_metadata() is mine  # the other thread entered after us
        checked.set()
        thread.join(5)
        assert get_attention_metadata() is mine  # and left before us
    assert seen == [theirs]
