"""`StructuredOutputsParams`: one constraint of the right type, errors naming the field."""

from __future__ import annotations

import pytest

from asyncengine.errors import InvalidRequestError
from asyncengine.sampling_params import SamplingParams
from asyncengine.structured_outputs import StructuredOutputsParams


@pytest.mark.parametrize("kwargs, field", [
    ({}, "structured_outputs"),
    ({"json": {}, "regex": "a"}, "structured_outputs.regex"),
    ({"choice": ["a"], "grammar": "root ::= \"a\""}, "structured_outputs.grammar"),
    ({"json": 3}, "structured_outputs.json"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
    ({"json": {}, "disable_any_whitespace": 1}, "structured_outputs.disable_any_whitespace"),
])  # fmt: skip
def test_bad_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(**kwargs)
    assert err.value.field == field


def test_kind_and_canonical_key() -> None:
    a = StructuredOutputsParams(json={"b": 1, "a": {"type": "string"}})
    b = StructuredOutputsParams(json='{"a":{"type":"string"},"b":1}')
    assert a.kind == "json" and a.field_name == "structured_outputs.json"
    assert a.key() == b.key()  # a dict and its JSON text share the compiled grammar
    assert StructuredOutputsParams(json_object=True).key() != \
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True).key()
    assert StructuredOutputsParams(choice=["x", "y"]).kind == "choice"
    assert StructuredOutputsParams(json_object=False, regex="a").kind == "regex"


def test_sampling_params_carry_and_check_it() -> None:
    so = StructuredOutputsParams(regex="[0-9]+")
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    assert err.value.field == "structured_outputs"
    params = SamplingParams(structured_outputs=so)
    so.choice = ["a"]  # changed after construction: the request check catches it
    with pytest.raises(InvalidRequestError):
        params.validate()
