"""From a `StructuredOutputsParams` to an xgrammar `Grammar`, or an error naming the field.

Converting is cheap (no token masks yet) and catches every invalid schema, regex and EBNF
grammar, so requests are checked here before they are queued; the expensive part, compiling
the grammar against the vocabulary, happens later off the step loop (`compiler`).

JSON-schema keywords that xgrammar would ignore (so the output would not be guaranteed to
validate) are refused by name: `UNSUPPORTED_KEYWORDS`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from asyncengine.errors import InvalidRequestError
from asyncengine.structured_outputs.params import StructuredOutputsParams

# Keywords a schema may not use: the grammar could not enforce them.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies",
    "uniqueItems", "contains", "minContains", "maxContains", "unevaluatedProperties",
    "unevaluatedItems", "multipleOf", "$dynamicRef", "$dynamicAnchor",
})  # fmt: skip
# Where a keyword's value is a schema, a list of schemas, or a map of name -> schema.
_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
# JSON text is kept bounded: free whitespace at most this many characters at a time.
MAX_WHITESPACE = 4
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def to_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The grammar of the constraint; `InvalidRequestError` naming the field if invalid."""
    kind, name = params.kind, params.field_name
    try:
        if kind == "json":
            schema = _load_schema(params.json, name)
            return xgr.Grammar.from_json_schema(
                json.dumps(schema), **json_options(params.disable_any_whitespace)
            )
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', **json_options(params.disable_any_whitespace)
            )
        if kind == "regex":
            assert params.regex is not None
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            assert params.choice is not None
            # JSON string literals are valid EBNF literals (same escapes).
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            )
        assert params.grammar is not None
        return xgr.Grammar.from_ebnf(params.grammar)
    except InvalidRequestError:
        raise
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidRequestError(f"invalid {name}: {_clean(e)}", field=name) from None


def json_options(disable_any_whitespace: bool) -> dict[str, Any]:
    if disable_any_whitespace:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}


def _load_schema(value: dict[str, Any] | str | None, name: str) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{name} is not valid JSON: {e}", field=name) from None
    if not isinstance(value, dict | bool):
        raise InvalidRequestError(f"{name} must be a JSON schema (object)", field=name)
    check_supported(value, name)
    return value


def check_supported(schema: Any, name: str, path: str = "") -> None:
    """Refuse the first keyword of `UNSUPPORTED_KEYWORDS` found anywhere in the schema."""
    if not isinstance(schema, dict):
        return
    for key in schema:
        if key in UNSUPPORTED_KEYWORDS:
            where = f" at {path}" if path else ""
            raise InvalidRequestError(
                f"{name}: the JSON-schema keyword '{key}'{where} is not supported "
                "(it cannot be enforced while generating)",
                field=name,
            )
    for key in _SUBSCHEMA:
        if key in schema:
            check_supported(schema[key], name, f"{path}/{key}")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                check_supported(sub, name, f"{path}/{key}/{i}")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for prop, sub in schema[key].items():
                check_supported(sub, name, f"{path}/{key}/{prop}")


def _clean(exc: BaseException) -> str:
    """xgrammar's message without its "[time] /path/file.cc:123: " prefix."""
    text = _LOCATION.sub("", str(exc).strip())
    return text.splitlines()[0] if text else type(exc).__name__
