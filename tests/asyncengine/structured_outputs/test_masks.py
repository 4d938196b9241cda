"""Masks go to constrained rows only, on the logits' full (padded) width."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
