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


@dataclass
class _Drafting:
    grammar: GrammarState | None
    spec_token_ids: list[int]
    num_pending_tokens: int = 0


def _allowed(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_verify_rows_get_the_mask_after_the_drafts_before_them(default_model_dir: Path) -> None:
    """In a verify step, row j of a constrained request is masked as the grammar stands after
    its first j drafts; the matcher is left where it was (it advances only over kept tokens).
    Drafts are checked before: the allowed prefix of a run with a forbidden token."""
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(default_model_dir))
    width = 49152
    comp = StructuredOutputCompiler(tok, width, [2])
    grammar = comp.compile(StructuredOutputsParams(choice=["yes indeed", "no way"]))
    state = GrammarState(grammar)
    drafts = tok.encode("yes indeed")
    assert len(drafts) == 2
    assert state.num_allowed([*drafts, 2, drafts[0]]) == 3  # the stop token ends the choice
    assert state.num_allowed([drafts[0], tok.encode(" way")[0]]) == 1
    assert state.num_allowed(tok.encode("maybe")) == 0
    # A verify step: an unconstrained request (1 draft) and the constrained one (2 drafts).
    rows: list[Any] = [_Drafting(None, [7]), _Drafting(state, list(drafts))]
    masker = GrammarMasker(width, torch.device("cpu"))
    logits = torch.zeros(2 + 3, width)
    out = masker.apply(logits, rows, num_spec=[1, 2])
    assert _allowed(out[0]) == _allowed(out[1]) == set(range(width))
    # Each constrained row allows what a matcher fed the drafts before it allows.
    for j in range(3):
        fresh = GrammarState(grammar)
        fresh.catch_up(drafts[:j])
        want = torch.zeros(1, width)
        GrammarMasker(width, torch.device("cpu")).apply(want, [_Drafting(fresh, [])])
        assert _allowed(out[2 + j]) == _allowed(want[0])
    assert _allowed(out[4]) == {2}
    assert drafts[0] in _allowed(out[2]) and drafts[1] in _allowed(out[3])
    assert state.num_accepted == 0
    assert state.num_allowed(drafts) == 2  # rolled back: the first draft is allowed again
    assert masker.stats.rows == 3
    with pytest.raises(ValueError, match="outside the request's grammar"):
        masker.apply(torch.zeros(2, width), [_Drafting(state, tok.encode("maybe")[:1])],
                     num_spec=[1])  # fmt: skip
    assert state.num_allowed(drafts) == 2  # a failed fill leaves the state as it was too
    comp.shutdown()
