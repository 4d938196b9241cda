"""Request bodies of the OpenAI-compatible API as msgspec Structs, and their sampling params.

Decoding checks JSON types only (a wrong type names its JSON path); values are checked by
`SamplingParams` and the engine's request check, the one place every frontend shares.
Unknown fields are ignored, as vLLM's server does, so clients written for other servers
connect. Fields OpenAI defines but this engine cannot honour (`suffix`, `logit_bias`, ...)
are refused by name rather than silently dropped. Output constraints (`response_format`,
`structured_outputs`) are read by `structured`, tools by `tool_calls`.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from asyncengine.errors import InvalidRequestError
from asyncengine.sampling_params import RequestOutputKind, SamplingParams
from asyncengine.structured_outputs import StructuredOutputsParams
from frontends.openai_api import structured
from frontends.openai_api.tool_calls import ToolPlan, plan_from_body

# An engine prompt: text to tokenize, or token ids.
Prompt = str | list[int]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None
    # vLLM's: every chunk carries the usage so far, so a client counts the tokens of each.
    continuous_usage_stats: bool | None = None


class _SamplingFields(msgspec.Struct, kw_only=True):
    """What completions and chat share: OpenAI's fields, then vLLM's extra sampling fields.

    Every optional field accepts an explicit `null` (clients send them) meaning its default.
    """

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's own API does for logging
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None
    # Output constraints: OpenAI's, vLLM's, and vLLM's older names.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options
                    and self.stream_options.continuous_usage_stats)

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true",
                                      field="stream_options")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", field="logit_bias")

    def _guided(self) -> dict[str, Any]:
        return {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}

    def _has_body_constraint(self) -> bool:
        rf = self.response_format
        return (rf is not None and rf.get("type") != "text") or self.structured_outputs \
            is not None or any(v is not None for v in self._guided().values())

    def _constraint(self) -> StructuredOutputsParams | None:
        return structured.from_body(self.response_format, self.structured_outputs,
                                    self._guided())

    def _body_field(self, field: str | None) -> str | None:
        """The body's name for a constraint field the engine named."""
        if field is None or not field.startswith("structured_outputs."):
            return field  # not about the constraint's content (or named by the body already)
        return structured.body_field(field, structured.source_of(self.response_format,
                                                                 self._guided()))

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None,
                         constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's `SamplingParams`; a bad value raises `InvalidRequestError` naming the
        engine's field (the caller maps it back to the body's name)."""
        self._check_common()
        if constraint is None:
            constraint = self._constraint()
        return SamplingParams(
            n=_default(self.n, 1),
            temperature=_default(self.temperature, 1.0),
            top_p=_default(self.top_p, 1.0),
            top_k=_default(self.top_k, -1),
            min_p=_default(self.min_p, 0.0),
            repetition_penalty=_default(self.repetition_penalty, 1.0),
            presence_penalty=_default(self.presence_penalty, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=_default(self.ignore_eos, False),
            max_tokens=max_tokens,
            min_tokens=_default(self.min_tokens, 0),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None
            else self.prompt_logprobs,
            skip_special_tokens=_default(self.skip_special_tokens, True),
            include_stop_str_in_output=_default(self.include_stop_str_in_output, False),
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=constraint,
        )


class CompletionRequest(_SamplingFields, kw_only=True):
    """`POST /v1/completions`."""

    prompt: str | list[Any]
    max_tokens: int | None = 16  # OpenAI's default for completions; null: all the room left
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[Prompt]:
        """The prompts: one text, one list of token ids, or a batch of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty", field="prompt")
        if all(_is_token_id(t) for t in p):
            return [list(p)]
        if all(isinstance(t, str) for t in p):
            return list(p)
        if all(isinstance(t, list) and t and all(_is_token_id(x) for x in t) for t in p):
            return [list(t) for t in p]
        raise InvalidRequestError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids", field="prompt")

    def sampling_params(self) -> SamplingParams:
        if self.suffix is not None:
            raise InvalidRequestError("suffix is not supported", field="suffix")
        if self.best_of is not None and self.best_of != _default(self.n, 1):
            raise InvalidRequestError("best_of must equal n", field="best_of")
        max_tokens = self.max_tokens
        if max_tokens == 0:
            if not self.echo:
                raise InvalidRequestError("max_tokens 0 is allowed only with echo",
                                          field="max_tokens")
            # As vLLM: one token is generated and left out of the answer.
            max_tokens = 1
        # With echo, `logprobs` covers the prompt's tokens too (vLLM's prompt logprobs).
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and _is_token_id(self.logprobs):
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the answer is the prompt alone."""
        return bool(self.echo) and self.max_tokens == 0

    def param_name(self, field: str | None) -> str | None:
        """The body's name for an engine field named in an error."""
        if field == "prompt_logprobs" and self.prompt_logprobs is None:
            return "logprobs"  # set from logprobs by echo
        return "prompt" if field == "prompt_token_ids" else self._body_field(field)


class TextPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's result answers this call

    def template_dict(self, index: int) -> dict[str, Any]:
        """The message as the chat template takes it; text parts are joined by newlines."""
        content = self.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(
                        f"content part type {part.type[:32]!r} is not supported (only 'text')",
                        field=f"messages[{index}].content")
            content = "\n".join(p.text or "" for p in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # null: all the room `max_model_len` leaves
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", field="messages")
        return [m.template_dict(i) for i, m in enumerate(self.messages)]

    def tool_plan(self, parser_name: str | None) -> ToolPlan | None:
        """How `tools` / `tool_choice` are served (None: no tools); `parser_name` is the
        server's `--tool-call-parser`."""
        return plan_from_body(self.tools, self.tool_choice, parser_name,
                              self.parallel_tool_calls)

    def sampling_params(self, tools: ToolPlan | None = None) -> SamplingParams:
        constraint = self._constraint()
        forced = tools.constraint() if tools is not None else None
        if forced is not None:
            if constraint is not None:
                raise InvalidRequestError(
                    "tool_choice 'required' or a named function constrains the output itself: "
                    "it cannot be combined with response_format or structured_outputs",
                    field="tool_choice")
            constraint = forced
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true",
                                      field="top_logprobs")
        logprobs = _default(self.top_logprobs, 0) if self.logprobs else None
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        return self._sampling_params(max_tokens, logprobs, constraint=constraint)

    def param_name(self, field: str | None) -> str | None:
        """The body's name for an engine field named in an error."""
        if field is not None and field.startswith("structured_outputs") and self.tools \
                and self.tool_choice not in (None, "auto", "none") \
                and not self._has_body_constraint():
            return "tools"  # the constraint came from the tools' parameters
        if field in ("prompt", "prompt_token_ids"):
            return "messages"
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if field == "logprobs" and self.top_logprobs is not None:
            return "top_logprobs"
        return self._body_field(field)


_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def decode_completion(body: bytes) -> CompletionRequest:
    return _decode(_completion_decoder, body)


def decode_chat(body: bytes) -> ChatCompletionRequest:
    return _decode(_chat_decoder, body)


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    """Decode a body; every failure is an `InvalidRequestError` naming the field when the
    decoder says which one."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        message = str(exc)
        field = None
        if m := _PATH.search(message):
            field = m.group(1) or None
        elif m := _MISSING.search(message):
            field = m.group(1)
        raise InvalidRequestError(message, field=field) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        # msgspec recurses while it skips unknown fields: deep nesting ends here.
        raise InvalidRequestError("the body is not valid JSON: nested too deeply") from None


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
