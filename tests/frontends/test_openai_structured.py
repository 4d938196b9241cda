"""Structured outputs and tool calling over the OpenAI API and the WebSocket, with the
official `openai` client, on the embedded SmolLM2 (CPU)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.llm_engine import LLMEngine
from frontends.client import AsyncClient, InvalidRequestError
from frontends.openai_api import OpenAIConfig, OpenAIServer, serve_openai
from frontends.server import EngineServer, ServerConfig, serve_engine

from .conftest import all_blocks_free, engine_args

MODEL = "smol"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                            "maxItems": 3}},
    "required": ["name", "age", "pets"], "additionalProperties": False,
}  # fmt: skip
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 12}}, "required": ["zone"],
        "additionalProperties": False}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)
    pets: list[Literal["cat", "dog"]] = pydantic.Field(max_length=3)


@pytest.fixture(scope="module")
def model_dir(default_model_dir: Path) -> Path:
    return default_model_dir


@pytest.fixture(scope="module")
def llm_engine(model_dir: Path) -> LLMEngine:
    """One engine for the module (each test's `engine` wraps it and checks its pool)."""
    return LLMEngine.from_engine_args(engine_args(model_dir, max_model_len=512))


@pytest.fixture
async def api(engine: AsyncLLMEngine) -> AsyncIterator[OpenAIServer]:
    config = OpenAIConfig(port=0, served_model_name=MODEL, tool_call_parser="hermes")
    async with serve_openai(engine, config) as srv:
        yield srv


@pytest.fixture
def client(api: OpenAIServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0)


async def test_parse_with_a_pydantic_model(client: openai.AsyncOpenAI,
                                           engine: AsyncLLMEngine) -> None:
    """`chat.completions.parse(response_format=Model)`: greedy and sampled replies parse."""
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 5, "n": 2}):
        done = await client.chat.completions.parse(
            model=MODEL, response_format=Person, max_tokens=120, **kw,
            messages=[{"role": "user", "content": "Describe a person and their pets."}])
        for choice in done.choices:
            assert choice.finish_reason == "stop"
            assert isinstance(choice.message.parsed, Person)
            jsonschema.validate(json.loads(choice.message.content or ""),
                                Person.model_json_schema())
    await all_blocks_free(engine)


async def test_json_schema_streamed_and_json_object(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A person as JSON."}],
        temperature=0.7, seed=1, max_tokens=120, stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    text, reasons = "", []
    async for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    done = await client.chat.completions.create(
        model=MODEL, max_tokens=60, temperature=0.0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Return a JSON object with a name and an age."}])
    assert isinstance(json.loads(done.choices[0].message.content or ""), dict)


async def test_structured_outputs_extra_field_on_completions(client: openai.AsyncOpenAI
                                                             ) -> None:
    done = await client.completions.create(
        model=MODEL, prompt="The best pet is the", max_tokens=5, temperature=1.0, n=3, seed=2,
        extra_body={"structured_outputs": {"choice": [" cat", " dog"]}})
    assert {c.text for c in done.choices} <= {" cat", " dog"}
    done = await client.completions.create(
        model=MODEL, prompt="A date: ", max_tokens=12, temperature=0.0,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    assert done.choices[0].finish_reason == "stop"
    assert len(done.choices[0].text) == 10


def _arguments(call: Any, tool: dict[str, Any]) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


async def test_named_and_required_tool_choice(client: openai.AsyncOpenAI,
                                              engine: AsyncLLMEngine) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    done = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[TIME, WEATHER], tool_choice=named, max_tokens=60,
        temperature=0.0)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _arguments(choice.message.tool_calls[0], WEATHER)

    done = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[TIME, WEATHER], tool_choice="required",
        max_tokens=120, temperature=0.8, seed=3)
    calls = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and calls
    tools = {"get_time": TIME, "get_weather": WEATHER}
    for call in calls:
        _arguments(call, tools[call.function.name])

    # Streamed: the calls arrive whole in the last chunk; the SDK accumulates them.
    stream = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=named, max_tokens=60,
        temperature=0.0, stream=True)
    deltas, reason = [], None
    async for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            reason = c.finish_reason or reason
    assert reason == "tool_calls" and len(deltas) == 1
    assert _arguments(deltas[0], WEATHER) == _arguments(choice.message.tool_calls[0], WEATHER)
    await all_blocks_free(engine)


async def test_auto_parses_hermes_tool_calls(client: openai.AsyncOpenAI) -> None:
    """`auto` reads the model's `<tool_call>` blocks (the model's text is pinned here with a
    regex, so the parser sees a call); plain replies stay content."""
    forced = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
              r'\{"city": "Paris", "unit": "celsius"\}\}\n</tool_call>')
    extra = {"structured_outputs": {"regex": forced}}
    done = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0.0,
        extra_body=extra)
    msg = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Checking."
    assert _arguments(msg.tool_calls[0], WEATHER) == {"city": "Paris", "unit": "celsius"}

    stream = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=200,
        temperature=0.0, extra_body=extra, stream=True)
    content, calls, reason = "", [], None
    async for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            reason = c.finish_reason or reason
    assert "<tool_call>" not in content and content.strip() == "Checking."
    assert reason == "tool_calls" and calls[0].function.name == "get_weather"

    plain = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8,
        temperature=0.0)
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
])  # fmt: skip
async def test_bad_constraints_are_400_naming_the_field(client: openai.AsyncOpenAI,
                                                         body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                             extra_body=body)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param  # type: ignore[index]


async def test_compile_timeout_is_400_and_delays_nothing(model_dir: Path) -> None:
    eng = AsyncLLMEngine(LLMEngine.from_engine_args(engine_args(
        model_dir, max_model_len=512, structured_outputs_compile_timeout=1e-9)))
    try:
        async with serve_openai(eng, OpenAIConfig(port=0, served_model_name=MODEL)) as srv:
            client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(
                    model=MODEL, messages=ASK, max_tokens=4, response_format={
                        "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
            assert "longer than" in str(err.value)
            ok = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
            assert ok.choices[0].message.content
    finally:
        await eng.shutdown()


@pytest.fixture
async def ws_server(engine: AsyncLLMEngine) -> AsyncIterator[EngineServer]:
    async with serve_engine(engine, ServerConfig(port=0)) as srv:
        yield srv


async def test_websocket_carries_the_constraint(ws_server: EngineServer,
                                                engine: AsyncLLMEngine) -> None:
    async with AsyncClient(ws_server.url) as client:
        done = await client.complete(messages=ASK, max_tokens=120, temperature=0.0,
                                     structured_outputs={"json": PERSON})
        assert done.finish_reason == "stop"
        jsonschema.validate(json.loads(done.text), PERSON)
        with pytest.raises(InvalidRequestError) as err:
            await client.complete("x", max_tokens=4, structured_outputs={"regex": "(("})
        assert "structured_outputs.regex" in str(err.value)
    await all_blocks_free(engine)
