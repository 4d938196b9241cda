"""`StructuredOutputsParams`: the one constraint a request's output must follow, in vLLM's
spelling (`json`, `regex`, `choice`, `grammar`, `json_object`).

Only the shape of the request is checked here (one constraint, the right types); whether a
schema, regex or grammar is itself valid is decided when it is converted to a grammar
(`asyncengine.structured_outputs.grammar`), which names the same fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from asyncengine.errors import InvalidRequestError

# The constraint fields, one of which a request sets.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
FIELD_PREFIX = "structured_outputs"


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output.

    `json` is a JSON schema (a dict or its JSON text); `regex` a regular expression; `choice`
    a list of strings, one of which is the whole output; `grammar` an EBNF grammar (xgrammar's
    dialect, GBNF-like, rule `root`); `json_object=True` any JSON object.
    `disable_any_whitespace` keeps JSON compact (no free whitespace between tokens).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint is set (one of `CONSTRAINT_FIELDS`)."""
        return next(f for f in CONSTRAINT_FIELDS if _is_set(self, f))

    @property
    def field_name(self) -> str:
        """The dotted field name errors about the constraint use."""
        return f"{FIELD_PREFIX}.{self.kind}"

    def key(self) -> tuple[str, str, bool]:
        """A hashable, canonical key of the constraint (the compiled-grammar cache's key)."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            value = json.dumps(list(value))
        elif kind == "json_object":
            value = ""
        return kind, value, bool(self.disable_any_whitespace)

    def validate(self) -> None:
        """Raise `InvalidRequestError` naming the field unless exactly one constraint of the
        right type is set."""
        given = [f for f in CONSTRAINT_FIELDS if _is_set(self, f)]
        if not given:
            raise InvalidRequestError(
                "structured_outputs must set one of " + ", ".join(CONSTRAINT_FIELDS),
                field=FIELD_PREFIX,
            )
        if len(given) > 1:
            raise InvalidRequestError(
                f"structured_outputs takes one constraint per request, got {', '.join(given)}",
                field=f"{FIELD_PREFIX}.{given[1]}",
            )
        kind = given[0]
        value = getattr(self, kind)
        name = f"{FIELD_PREFIX}.{kind}"
        if kind == "json" and not isinstance(value, dict | str):
            raise InvalidRequestError(f"{name} must be a JSON schema (object)", field=name)
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise InvalidRequestError(f"{name} must be a non-empty string", field=name)
        if kind == "choice" and (
            not isinstance(value, list | tuple)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidRequestError(
                f"{name} must be a non-empty list of non-empty strings", field=name
            )
        if kind == "json_object" and value is not True:
            raise InvalidRequestError(f"{name} must be true", field=name)
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError(
                f"{FIELD_PREFIX}.disable_any_whitespace must be a boolean",
                field=f"{FIELD_PREFIX}.disable_any_whitespace",
            )


def _is_set(params: StructuredOutputsParams, name: str) -> bool:
    value = getattr(params, name)
    if name == "json_object":
        return value is not None and value is not False
    return value is not None
