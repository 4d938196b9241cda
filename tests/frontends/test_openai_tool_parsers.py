"""Tool-call parsers (`frontends.openai_api.tool_parsers`) and tool plans
(`frontends.openai_api.tool_calls`)."""

from __future__ import annotations

import json

import pytest

from asyncengine.errors import InvalidRequestError
from frontends.openai_api.tool_calls import plan_from_body
from frontends.openai_api.tool_parsers import HermesToolParser, Llama3JsonToolParser, get_parser

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_hermes_parses_calls_and_keeps_the_rest() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    res = HermesToolParser().parse(text)
    assert res.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in res.calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_hermes_without_calls_or_with_broken_ones() -> None:
    p = HermesToolParser()
    assert p.parse("Just text.").calls == []
    assert p.parse("Just text.").content == "Just text."
    broken = "<tool_call>{not json}</tool_call>"
    assert p.parse(broken).calls == [] and p.parse(broken).content == broken
    # Cut short by max_tokens: an unclosed block whose JSON is whole still counts.
    assert p.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}').calls[0].name == "f"


def test_hermes_stream_prefix_holds_back_a_possible_tag() -> None:
    p = HermesToolParser()
    assert p.stream_prefix("Hello there") == len("Hello there")
    assert p.stream_prefix("Hello <tool") == len("Hello ")
    assert p.stream_prefix("Hi <tool_call>{") == len("Hi ")


def test_llama3_json() -> None:
    p = Llama3JsonToolParser()
    res = p.parse('{"name": "get_time", "parameters": {}}; {"name": "f", "parameters": {"x": 1}}')
    assert [c.name for c in res.calls] == ["get_time", "f"] and res.content is None
    assert p.parse("Plain answer").calls == []
    with pytest.raises(ValueError):
        get_parser("nope")


def test_plans_and_their_constraints() -> None:
    plan = plan_from_body([WEATHER, TIME], {"type": "function",
                                            "function": {"name": "get_weather"}}, None)
    assert plan is not None and plan.mode == "named"
    assert plan.constraint().json == WEATHER["function"]["parameters"]
    required = plan_from_body([WEATHER, TIME], "required", None)
    schema = required.constraint().json
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [alt["properties"]["name"]["enum"] for alt in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert "maxItems" not in schema
    single = plan_from_body([WEATHER, TIME], "required", None, parallel_tool_calls=False)
    assert single.constraint().json["maxItems"] == 1
    none = plan_from_body([WEATHER], "none", None)
    assert none.constraint() is None and none.template_tools() is None
    auto = plan_from_body([WEATHER], None, "hermes")
    assert auto.mode == "auto" and auto.template_tools() == [WEATHER]


@pytest.mark.parametrize("tools, choice, parser, field", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None,
     "tool_choice.function.name"),
    ([WEATHER], "auto", None, "tool_choice"),  # auto needs --tool-call-parser
    ([WEATHER], "sometimes", "hermes", "tool_choice"),
    (None, "required", None, "tool_choice"),
    ([{"type": "function", "function": {}}], "required", None, "tools[0].function.name"),
    ([{"type": "retrieval"}], "required", None, "tools[0].type"),
    ([WEATHER, WEATHER], "required", None, "tools"),
])  # fmt: skip
def test_bad_tools_name_the_field(tools: list | None, choice: object, parser: str | None,
                                  field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        plan_from_body(tools, choice, parser)
    assert err.value.field == field
