"""Constraint → xgrammar grammar: invalid input and unsupported keywords are refused by
field and by name; valid constraints convert."""

from __future__ import annotations

import pytest

from asyncengine.errors import InvalidRequestError
from asyncengine.structured_outputs import StructuredOutputsParams
from asyncengine.structured_outputs.grammar import UNSUPPORTED_KEYWORDS, to_grammar


@pytest.mark.parametrize("kwargs", [
    {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    {"json": '{"type": "array", "items": {"enum": ["x", "y"]}}'},
    {"json": {"$defs": {"p": {"type": "string"}}, "$ref": "#/$defs/p"}},
    {"json_object": True},
    {"regex": r"\d{3}-[a-z]+"},
    {"choice": ['say "hi"', "back\\slash", "naïve"]},
    {"grammar": 'root ::= "a" b\nb ::= [0-9]+'},
])  # fmt: skip
def test_valid_constraints_convert(kwargs: dict) -> None:
    assert str(to_grammar(StructuredOutputsParams(**kwargs)))


@pytest.mark.parametrize("kwargs, field, words", [
    ({"json": {"type": "nope"}}, "structured_outputs.json", "nope"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"json": "[1, 2]"}, "structured_outputs.json", "JSON schema"),
    ({"regex": "a("}, "structured_outputs.regex", "parenthesis"),
    ({"grammar": "root ::= other"}, "structured_outputs.grammar", "other"),
])  # fmt: skip
def test_invalid_constraints_name_the_field(kwargs: dict, field: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        to_grammar(StructuredOutputsParams(**kwargs))
    assert err.value.field == field
    assert words in str(err.value)
    assert ".cc:" not in str(err.value)  # xgrammar's source location is dropped


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "object", "not": {"type": "string"}}, "not"),
    ({"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}},
     "uniqueItems"),
    ({"anyOf": [{"type": "number", "multipleOf": 3}]}, "multipleOf"),
    ({"type": "array", "items": {"if": {}, "then": {}}}, "if"),
    ({"$defs": {"a": {"type": "array", "contains": {}}}}, "contains"),
])  # fmt: skip
def test_unsupported_keywords_are_refused_by_name(schema: dict, keyword: str) -> None:
    assert keyword in UNSUPPORTED_KEYWORDS
    with pytest.raises(InvalidRequestError) as err:
        to_grammar(StructuredOutputsParams(json=schema))
    assert f"'{keyword}'" in str(err.value)


def test_keyword_names_used_as_property_names_are_fine() -> None:
    schema = {"type": "object", "properties": {"not": {"type": "string"},
                                               "contains": {"type": "integer"}}}
    to_grammar(StructuredOutputsParams(json=schema))
