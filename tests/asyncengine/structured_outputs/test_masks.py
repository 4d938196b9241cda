"""Masks go to constrained rows only, on the logits' full (padded) width."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncengine.structured_outputs import StructuredOutputsParams
from asyncengine.structured_outputs.compiler import StructuredOutputCompiler
from asyncengine.structured_outputs.masks import GrammarMasker
from asyncengine.structured_outputs.matcher import GrammarState


@dataclass
class _Row:
    grammar: GrammarState | None


def test_mask_only_constrained_rows(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(default_model_dir))
    width = 49152 + 32  # padded logits: the extra ids must never be allowed
    comp = StructuredOutputCompiler(tok, width, [2])
    grammar = comp.compile(StructuredOutputsParams(choice=["yes", "no"]))
    rows: list[Any] = [_Row(None), _Row(GrammarState(grammar)), _Row(None)]
    logits = torch.randn(3, width)
    before = logits.clone()
    masker = GrammarMasker(width, torch.device("cpu"))
    out = masker.apply(logits, rows)
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    texts = {tok.decode([t]) for t in allowed}
    assert allowed and all(t < 49152 for t in allowed)
    assert texts <= {"y", "ye", "yes", "n", "no"}
    assert masker.stats.steps == 1 and masker.stats.rows == 1
    # After "yes", only the stop token remains; once accepted the matcher is terminated.
    state = rows[1].grammar
    for t in tok.encode("yes"):
        assert state.accept(t)
    out = masker.apply(torch.zeros(3, width), rows)
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [2]
    assert state.accept(2) and state.is_terminated
    assert not GrammarState(grammar).accept(tok.encode("maybe")[0])
    comp.shutdown()


def test_no_constrained_rows_is_a_no_op() -> None:
    logits = torch.randn(2, 64)
    masker = GrammarMasker(64, torch.device("cpu"))
    assert masker.apply(logits, [_Row(None), _Row(None)]) is logits
    assert masker.stats.steps == 0


def test_matcher_catches_up_and_runs_one_token_ahead(default_model_dir: Path) -> None:
    """The mask of a step may accept the token in flight before the engine appends it; the
    engine's own catch-up then finds it accepted. A finished grammar allows every token."""
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(default_model_dir))
    comp = StructuredOutputCompiler(tok, 49152, [2])
    state = GrammarState(comp.compile(StructuredOutputsParams(choice=["yes indeed"])))
    ids = tok.encode("yes indeed")
    assert len(ids) >= 2
    state.catch_up([], ids[0])  # ahead of the host's output
    assert state.num_accepted == 1
    state.catch_up(ids[:1])  # the engine appends it: nothing new
    assert state.num_accepted == 1
    state.catch_up(ids[:1], ids[1])
    state.catch_up(ids, 2)
    assert state.is_terminated and state.num_accepted == len(ids) + 1
    bitmask = torch.zeros(1, (49152 + 31) // 32, dtype=torch.int32)
    state.fill_mask(bitmask, 0)
    assert bool((bitmask == -1).all())
    bad = GrammarState(comp.compile(StructuredOutputsParams(choice=["yes"])))
    with pytest.raises(ValueError, match="outside the request's grammar"):
        bad.catch_up(tok.encode("no"))
    comp.shutdown()
