"""The body's output constraint as `StructuredOutputsParams`: OpenAI's `response_format`
(`json_object`, `json_schema`), vLLM's extra field `structured_outputs`, and vLLM's older
`guided_*` fields (mapped, so old clients stay constrained rather than silently free).

One constraint per request: two sources at once are refused naming the second.
"""

from __future__ import annotations

from typing import Any

from asyncengine.errors import InvalidRequestError
from asyncengine.structured_outputs import StructuredOutputsParams
from asyncengine.structured_outputs.params import CONSTRAINT_FIELDS

_OPTION_FIELDS = ("disable_any_whitespace",)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def from_body(response_format: dict[str, Any] | None,
              structured_outputs: dict[str, Any] | None,
              guided: dict[str, Any]) -> StructuredOutputsParams | None:
    """The request's constraint, or None; `InvalidRequestError` naming the body field."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if response_format is not None:
        params = _response_format(response_format)
        if params is not None:
            found.append(("response_format", params))
    if structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(structured_outputs)))
    for name, value in guided.items():
        if value is not None:
            found.append((name, StructuredOutputsParams(**{_GUIDED[name]: value})))
    if len(found) > 1:
        raise InvalidRequestError(
            f"one output constraint per request: {found[0][0]} and {found[1][0]} are both set",
            field=found[1][0])
    return found[0][1] if found else None


def _response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("response_format.json_schema must be an object",
                                      field="response_format.json_schema")
        if not isinstance(spec.get("name"), str):
            raise InvalidRequestError("response_format.json_schema.name must be a string",
                                      field="response_format.json_schema.name")
        schema = spec.get("schema", {})  # OpenAI: no schema means any JSON object
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format.json_schema.schema must be an object",
                                      field="response_format.json_schema.schema")
        # `strict` changes nothing here: the schema is always enforced.
        return StructuredOutputsParams(json=schema or {"type": "object"})
    raise InvalidRequestError(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        field="response_format.type")


def _structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams:
    unknown = set(body) - set(CONSTRAINT_FIELDS) - set(_OPTION_FIELDS)
    if unknown:
        name = sorted(unknown)[0]
        raise InvalidRequestError(f"structured_outputs.{name} is not supported",
                                  field=f"structured_outputs.{name}")
    return StructuredOutputsParams(**body)


def source_of(response_format: dict[str, Any] | None, guided: dict[str, Any]) -> str:
    """Which body field the constraint came from."""
    if response_format is not None and response_format.get("type") != "text":
        return "response_format"
    return next((name for name, value in guided.items() if value is not None),
                "structured_outputs")


def body_field(field: str, source: str) -> str:
    """The body's name for an engine field about the constraint: `structured_outputs.json`
    is `response_format.json_schema.schema` when the body used `response_format`."""
    if source == "response_format":
        return ("response_format.json_schema.schema" if field.endswith(".json")
                else "response_format")
    if source in _GUIDED:
        return source
    return field
