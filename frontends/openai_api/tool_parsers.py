"""Tool-call parsers: a model's own tool-call format in its output text → calls.

Chosen per model family with `--tool-call-parser`, as in vLLM: `hermes` reads
`<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks (Hermes, Qwen2.5, SmolLM2-style
templates); `llama3_json` reads a bare `{"name": …, "parameters": {…}}` object (several
separated by `;`). A block that does not parse stays in the content, as text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`


@dataclass
class ParseResult:
    content: str | None  # the text outside tool calls; None when there is none
    calls: list[ParsedCall]


class ToolParser:
    """Base: `parse` a whole output; `stream_prefix` says how much of a partial output is
    plain content that can be streamed before the parser has seen the end."""

    name = ""

    def parse(self, text: str) -> ParseResult:
        raise NotImplementedError

    def stream_prefix(self, text: str) -> int:
        """Length of the leading part of `text` that is surely content, not a tool call."""
        return 0


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call_of(obj: Any, args_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models emit the arguments already as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParseResult:
        calls: list[ParsedCall] = []
        kept: list[str] = []
        pos = 0
        for m in self._BLOCK.finditer(text):
            call = _call_of(_loads(m.group(1)), "arguments")
            if call is None:
                continue  # not a call: the block stays in the content
            kept.append(text[pos:m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        content = "".join(kept).strip() if calls else text
        return ParseResult(content or None, calls)

    def stream_prefix(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        # A suffix that could begin "<tool_call>" is held back until it is decided.
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> ParseResult:
        stripped = text.strip().removeprefix("<|python_tag|>").strip()
        if not stripped.startswith("{"):
            return ParseResult(text or None, [])
        calls: list[ParsedCall] = []
        for part in stripped.split(";"):
            call = _call_of(_loads(part), "parameters")
            if call is None:
                return ParseResult(text or None, [])
            calls.append(call)
        return ParseResult(None, calls)

    def stream_prefix(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped[0] in "{<":
            return 0  # may be a call: wait for the end
        return len(text)


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser)
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r} (known: "
                         f"{', '.join(sorted(PARSERS))})") from None
