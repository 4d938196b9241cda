"""Chat tool calling: `tools` + `tool_choice` → how the request is generated and how its
output becomes OpenAI `tool_calls`.

`required` and a named function are enforced: the output is constrained to a JSON schema
built from the tools' `parameters` (named: that tool's arguments; required: a non-empty
array of `{"name", "parameters"}`), so the calls always parse and their arguments validate.
`auto` generates freely and the server's `--tool-call-parser` reads the model's own format;
`none` ignores the tools. Streamed tool calls arrive whole in the choice's last chunk.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Literal

from asyncengine.errors import InvalidRequestError
from asyncengine.structured_outputs import StructuredOutputsParams
from frontends.openai_api.tool_parsers import ParsedCall, ToolParser, get_parser

Mode = Literal["none", "auto", "required", "named"]


@dataclasses.dataclass
class ToolPlan:
    mode: Mode
    functions: list[dict[str, Any]]  # each {"name", "description"?, "parameters"?}
    tools: list[dict[str, Any]]  # as the body gave them, for the chat template
    named: str | None = None
    parser_name: str | None = None
    parallel: bool = True  # `parallel_tool_calls`: False allows one call


    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint that enforces `required` / a named function."""
        if self.mode == "named":
            fn = next(f for f in self.functions if f["name"] == self.named)
            return StructuredOutputsParams(json=_parameters(fn))
        if self.mode == "required":
            one_of = [{
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [f["name"]]},
                               "parameters": _parameters(f)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            } for f in self.functions]  # fmt: skip
            schema: dict[str, Any] = {
                "type": "array", "minItems": 1,
                "items": one_of[0] if len(one_of) == 1 else {"anyOf": one_of},
            }  # fmt: skip
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        return None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template gets as `tools` (nothing with `none`)."""
        return None if self.mode == "none" else self.tools

    def extractor(self) -> ToolCallExtractor:
        parser = get_parser(self.parser_name) if self.mode == "auto" and self.parser_name \
            else None
        return ToolCallExtractor(self, parser)


def plan_from_body(tools: list[Any] | None, tool_choice: Any, parser_name: str | None,
                   parallel_tool_calls: bool | None = None) -> ToolPlan | None:
    """The request's tool plan, or None without tools; `InvalidRequestError` naming the
    field for a malformed tool or a `tool_choice` that names no given tool."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise InvalidRequestError("tool_choice needs tools", field="tool_choice")
        return None
    functions = [_function(i, t) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tool function names must be unique", field="tools")
    plan = ToolPlan("auto", functions, list(tools), parser_name=parser_name,
                    parallel=parallel_tool_calls is not False)
    if tool_choice is None or tool_choice == "auto":
        if parser_name is None:
            raise InvalidRequestError(
                "tool_choice 'auto' needs the server started with --tool-call-parser "
                "(or use tool_choice 'required' or a named function)", field="tool_choice")
        return plan
    if tool_choice in ("none", "required"):
        plan.mode = tool_choice
        return plan
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools",
                                      field="tool_choice.function.name")
        plan.mode, plan.named = "named", name
        return plan
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}", field="tool_choice")


def _function(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequestError(f"{where}.type must be 'function'", field=f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidRequestError(f"{where}.function.name must be a non-empty string",
                                  field=f"{where}.function.name")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema",
                                  field=f"{where}.function.parameters")
    return fn


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallExtractor:
    """One choice's output → streamable content now, and at the end content plus calls."""

    def __init__(self, plan: ToolPlan, parser: ToolParser | None) -> None:
        self.plan = plan
        self.parser = parser
        self._text: list[str] = []
        self._streamed = 0  # characters of content already handed out

    def feed(self, delta: str) -> str:
        """Content that can be streamed now (auto only: text before any tool call)."""
        self._text.append(delta)
        if self.parser is None:
            return "" if self.plan.mode in ("named", "required") else delta
        text = "".join(self._text)
        upto = self.parser.stream_prefix(text)
        if upto <= self._streamed:
            return ""
        out, self._streamed = text[self._streamed:upto], upto
        return out

    def finish(self) -> tuple[str | None, list[ParsedCall], str | None]:
        """(all content, the calls, content not streamed yet)."""
        text = "".join(self._text)
        if self.plan.mode == "named":
            assert self.plan.named is not None
            return None, [ParsedCall(self.plan.named, text)], None
        if self.plan.mode == "required":
            calls = _required_calls(text)
            if calls is None:  # cut short (max_tokens): hand the text back as content
                return text, [], text
            return None, calls, None
        if self.parser is None:
            return text, [], None
        result = self.parser.parse(text)
        rest = text[self._streamed:] if not result.calls else None
        if result.calls and result.content and len(result.content) > self._streamed:
            rest = result.content[self._streamed:]
        return result.content, result.calls, rest


def _required_calls(text: str) -> list[ParsedCall] | None:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list):
        return None
    return [ParsedCall(it["name"], json.dumps(it["parameters"], ensure_ascii=False))
            for it in items if isinstance(it, dict) and "name" in it and "parameters" in it]
