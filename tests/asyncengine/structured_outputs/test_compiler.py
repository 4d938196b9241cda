"""The grammar compiler: compiles in worker threads, caches by constraint, shares one
compile between concurrent requests, refuses past its time limit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncengine.errors import InvalidRequestError
from asyncengine.structured_outputs import StructuredOutputsParams
from asyncengine.structured_outputs.compiler import StructuredOutputCompiler


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def test_compile_is_cached_by_constraint(tokenizer: Any) -> None:
    comp = StructuredOutputCompiler(tokenizer, 49152, [2])
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties":{"x":{"type":"integer"}},"type":"object"}')
    first = comp.submit(a)
    assert comp.submit(b) is first  # same canonical key: one compile
    grammar = comp.compile(a)
    assert grammar is first.result()
    assert comp.stats.num_compiled == 1 and comp.stats.num_cache_hits >= 2
    assert comp.stats.tokenizer_info_s > 0 and comp.stats.compile_s_max > 0
    assert grammar.tokenizer_info.vocab_size == 49152
    comp.shutdown()


def test_padded_vocab_width(tokenizer: Any) -> None:
    """A model whose logits are wider than the tokenizer compiles for the logits' width."""
    comp = StructuredOutputCompiler(tokenizer, 49152 + 64, [2])
    grammar = comp.compile(StructuredOutputsParams(choice=["a", "b"]))
    assert grammar.tokenizer_info.vocab_size == 49152 + 64
    comp.shutdown()


def test_invalid_is_refused_before_compiling(tokenizer: Any) -> None:
    comp = StructuredOutputCompiler(tokenizer, 49152, [2])
    with pytest.raises(InvalidRequestError) as err:
        comp.submit(StructuredOutputsParams(regex="(("))
    assert err.value.field == "structured_outputs.regex"
    assert comp.stats.num_compiled == 0


def test_time_limit(tokenizer: Any) -> None:
    comp = StructuredOutputCompiler(tokenizer, 49152, [2], compile_timeout_s=1e-9)
    with pytest.raises(InvalidRequestError) as err:
        comp.compile(StructuredOutputsParams(json={"type": "array"}))
    assert "longer than" in str(err.value)
    assert err.value.field == "structured_outputs.json"
    comp.shutdown()


def test_no_tokenizer_is_refused() -> None:
    comp = StructuredOutputCompiler(None, 100, [0])
    with pytest.raises(InvalidRequestError) as err:
        comp.submit(StructuredOutputsParams(regex="a"))
    assert err.value.field == "structured_outputs"
