"""Engine outputs as OpenAI objects: completions, chat completions and their stream chunks.

A mapper holds one response's id, model and per-choice state (text, token count, finish
reason, logprobs). `chunk` turns one engine delta of one choice into a stream chunk,
`final` builds the whole response, `usage_chunk` the last chunk of
`stream_options.include_usage`. Choices are keyed by their `index`, so a response made of
several engine requests (a batch of prompts, or `n` samples once the engine has them) is the
same code with more choices. The sampled token's logprob is always the first entry of an
engine logprobs dict (see `CompletionOutput.logprobs`). Prompt logprobs (vLLM's
`prompt_logprobs` field, and the prompt's part of `logprobs` under `echo`) come from
`frontends.openai_api.prompt_logprobs`; `echo` with `max_tokens: 0` answers the prompt alone.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable

import msgspec

from asyncengine.outputs import CompletionOutput, PromptLogprobs
from frontends.openai_api.prompt_logprobs import (
    PromptLogprobsField,
    echo_logprobs,
    prompt_logprobs_field,
)
from frontends.openai_api.tool_calls import ToolCallExtractor, ToolPlan, new_call_id

TokenText = Callable[[int], str]


# ----------------------------------------------------------------------- shared
class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "asyncengine"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


# ----------------------------------------------------------------------- completions
class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the prompt's first token (echo)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobsField | None = None


class Completion(msgspec.Struct, kw_only=True):
    """A completion, or (`stream`) one chunk of it: OpenAI uses one object type for both."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ----------------------------------------------------------------------- chat
class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob]


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class ToolCallDelta(msgspec.Struct, kw_only=True):
    index: int
    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessageOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsField | None = None


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobsField | None = None


# ----------------------------------------------------------------------- mapping
@dataclasses.dataclass
class _Choice:
    index: int
    text: list[str] = dataclasses.field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    text_offset: int = 0
    completion_logprobs: CompletionLogprobs | None = None
    chat_logprobs: list[TokenLogprob] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Mapper:
    """What both response kinds track per choice."""

    def __init__(self, response_id: str, model: str, prompt_tokens: list[int],
                 token_text: TokenText, logprobs: int | None, n: int = 1,
                 prompt_ids: list[list[int]] | None = None,
                 prompt_logprobs: int | None = None) -> None:
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens  # per prompt: its `n` choices share the prompt
        self.choices = [_Choice(i) for i in range(len(prompt_tokens) * n)]
        self.token_text = token_text
        self.logprobs = logprobs  # top alternatives per token, or None: no logprobs
        self._n = n
        self.prompt_ids = prompt_ids or []  # per prompt, for its prompt logprobs
        self.prompt_logprobs = prompt_logprobs  # the body's `prompt_logprobs`
        self._prompt_entries: dict[int, PromptLogprobs] = {}  # per prompt, once they come

    def add_prompt_logprobs(self, prompt_index: int, entries: PromptLogprobs) -> None:
        """The engine's prompt logprobs of prompt `prompt_index` (its first output's)."""
        self._prompt_entries[prompt_index] = entries

    def _prompt_field(self, prompt_index: int) -> PromptLogprobsField | None:
        entries = self._prompt_entries.get(prompt_index)
        if self.prompt_logprobs is None or entries is None:
            return None
        return prompt_logprobs_field(self.prompt_ids[prompt_index], entries,
                                     self.prompt_logprobs)

    def _advance(self, index: int, comp: CompletionOutput) -> _Choice:
        choice = self.choices[index]
        choice.text.append(comp.text)
        choice.completion_tokens += len(comp.token_ids)
        if comp.finish_reason is not None:
            choice.finish_reason = comp.finish_reason
        return choice

    def usage(self) -> Usage:
        prompt = sum(self.prompt_tokens)
        completion = sum(c.completion_tokens for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)

    def completion_tokens(self, index: int) -> int:
        return self.choices[index].completion_tokens

    def _top(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        """The `self.logprobs` most likely tokens of one position, best first."""
        n = self.logprobs or 0
        return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:n]


class CompletionMapper(_Mapper):
    """`/v1/completions`: `echo` texts (one per choice, or None) lead each choice's text."""

    def __init__(self, response_id: str, model: str, prompt_tokens: list[int],
                 token_text: TokenText, logprobs: int | None, n: int = 1,
                 echo: list[str] | None = None, *, echo_only: bool = False,
                 prompt_ids: list[list[int]] | None = None,
                 prompt_logprobs: int | None = None) -> None:
        super().__init__(response_id, model, prompt_tokens, token_text, logprobs, n,
                         prompt_ids, prompt_logprobs)
        self._echo = echo  # per prompt
        self._echo_only = echo_only  # max_tokens 0: the generated token is left out

    def _echo_of(self, index: int) -> str:
        assert self._echo is not None
        return self._echo[index // self._n]

    def chunk(self, index: int, comp: CompletionOutput) -> Completion:
        if self._echo_only:
            comp = CompletionOutput(index=comp.index, text="", token_ids=[],
                                    finish_reason=comp.finish_reason and "length")
        choice = self._advance(index, comp)
        text = comp.text
        first = len(choice.text) == 1
        lead = None
        if self._echo is not None and first:
            text = self._echo_of(index) + text
            choice.text_offset = len(self._echo_of(index))
            lead = self._echo_logprobs(index)
        prompt_lps = self._prompt_field(index // self._n) if first else None
        logprobs = self._logprobs(choice, comp, lead)
        return Completion(id=self.id, created=self.created, model=self.model,
                          choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                    finish_reason=comp.finish_reason,
                                                    prompt_logprobs=prompt_lps)])

    def _echo_logprobs(self, index: int) -> CompletionLogprobs | None:
        """The prompt's logprobs that lead choice `index`'s (echo with logprobs)."""
        entries = self._prompt_entries.get(index // self._n)
        if self.logprobs is None or entries is None:
            return None
        part = echo_logprobs(self.prompt_ids[index // self._n], entries, self.logprobs,
                             self.token_text)
        return CompletionLogprobs(tokens=part.tokens, token_logprobs=part.token_logprobs,
                                  top_logprobs=part.top_logprobs, text_offset=part.text_offset)

    def usage_chunk(self) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[],
                          usage=self.usage())

    def final(self) -> Completion:
        choices = []
        for c in self.choices:
            text = "".join(c.text)
            if self._echo is not None:
                text = self._echo_of(c.index) + text
            choices.append(CompletionChoice(index=c.index, text=text,
                                            logprobs=c.completion_logprobs,
                                            finish_reason=c.finish_reason,
                                            prompt_logprobs=self._prompt_field(
                                                c.index // self._n)))
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices,
                          usage=self.usage())

    def _logprobs(self, choice: _Choice, comp: CompletionOutput,
                  lead: CompletionLogprobs | None = None) -> CompletionLogprobs | None:
        """This chunk's logprobs (after `lead`, the prompt's under echo); the choice's whole
        logprobs grow by them."""
        if self.logprobs is None:
            return None
        delta = lead or CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[],
                                           text_offset=[])
        for tid, entry in zip(comp.token_ids, comp.logprobs or [], strict=False):
            token = self.token_text(tid)
            delta.tokens.append(token)
            delta.token_logprobs.append(entry.get(tid, next(iter(entry.values()), 0.0)))
            sampled = delta.token_logprobs[-1]
            # Keyed by text, as OpenAI's format is: tokens that decode alike share a key, and
            # the sampled token's value is the one kept. It is listed first, as vLLM does.
            top = {token: sampled}
            for t, lp in self._top(entry):
                top[self.token_text(t)] = lp
            top[token] = sampled
            delta.top_logprobs.append(top)
            delta.text_offset.append(choice.text_offset)
            choice.text_offset += len(token)
        whole = choice.completion_logprobs
        if whole is None:
            choice.completion_logprobs = CompletionLogprobs(
                tokens=list(delta.tokens), token_logprobs=list(delta.token_logprobs),
                top_logprobs=list(delta.top_logprobs), text_offset=list(delta.text_offset))
        else:
            whole.tokens += delta.tokens
            whole.token_logprobs += delta.token_logprobs
            whole.top_logprobs += delta.top_logprobs
            whole.text_offset += delta.text_offset
        return delta


class ChatMapper(_Mapper):
    """`/v1/chat/completions`: a role chunk opens each choice's stream. With a tool plan,
    each choice's text goes through its tool-call extractor: content streams as it is
    known, and the calls come whole with the choice's last chunk (finish reason
    `tool_calls`)."""

    def __init__(self, response_id: str, model: str, prompt_tokens: list[int],
                 token_text: TokenText, logprobs: int | None, n: int = 1,
                 prompt_ids: list[list[int]] | None = None,
                 prompt_logprobs: int | None = None,
                 tools: ToolPlan | None = None) -> None:
        super().__init__(response_id, model, prompt_tokens, token_text, logprobs, n,
                         prompt_ids, prompt_logprobs)
        self._extractors: dict[int, ToolCallExtractor] = (
            {c.index: tools.extractor() for c in self.choices} if tools is not None else {})
        self._messages: dict[int, ChatMessageOut] = {}  # choices that ended with tool calls

    def role_chunk(self, index: int) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model,
            choices=[ChatChunkChoice(index=index, delta=ChatDelta(role="assistant",
                                                                  content=""))])

    def chunk(self, index: int, comp: CompletionOutput) -> ChatCompletionChunk:
        choice = self._advance(index, comp)
        logprobs = self._logprobs(choice, comp)
        delta = ChatDelta(content=comp.text)
        extractor = self._extractors.get(index)
        if extractor is not None:
            delta.content = extractor.feed(comp.text) or None
            if comp.finish_reason is not None:
                self._end_tools(choice, extractor, delta)
        prompt_lps = self._prompt_field(0) if len(choice.text) == 1 and index == 0 else None
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model,
            choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                     finish_reason=choice.finish_reason
                                     if comp.finish_reason is not None else None)],
            prompt_logprobs=prompt_lps)

    def _end_tools(self, choice: _Choice, extractor: ToolCallExtractor,
                   delta: ChatDelta) -> None:
        content, parsed, rest = extractor.finish()
        if rest:
            delta.content = (delta.content or "") + rest
        if not parsed:
            return
        calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name,
                                                                  arguments=c.arguments))
                 for c in parsed]
        delta.tool_calls = [ToolCallDelta(index=k, id=c.id, function=c.function)
                            for k, c in enumerate(calls)]
        if not delta.content:
            delta.content = None
        if choice.finish_reason == "stop":  # cut short by max_tokens stays "length"
            choice.finish_reason = "tool_calls"
        self._messages[choice.index] = ChatMessageOut(role="assistant", content=content,
                                                      tool_calls=calls)

    def usage_chunk(self) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[], usage=self.usage())

    def final(self) -> ChatCompletion:
        choices = [
            ChatChoice(index=c.index,
                       message=self._messages.get(c.index) or ChatMessageOut(
                           role="assistant", content="".join(c.text)),
                       logprobs=(ChatLogprobs(content=c.chat_logprobs)
                                 if c.chat_logprobs is not None else None),
                       finish_reason=c.finish_reason)
            for c in self.choices
        ]
        return ChatCompletion(id=self.id, created=self.created, model=self.model,
                              choices=choices, usage=self.usage(),
                              prompt_logprobs=self._prompt_field(0))

    def _logprobs(self, choice: _Choice, comp: CompletionOutput) -> ChatLogprobs | None:
        if self.logprobs is None:
            return None
        content = []
        for tid, entry in zip(comp.token_ids, comp.logprobs or [], strict=False):
            token = self.token_text(tid)
            content.append(TokenLogprob(
                token=token, logprob=entry.get(tid, next(iter(entry.values()), 0.0)),
                bytes=list(token.encode()),
                top_logprobs=[TopLogprob(token=(t := self.token_text(k)), logprob=v,
                                         bytes=list(t.encode()))
                              for k, v in self._top(entry)]))
        if choice.chat_logprobs is None:
            choice.chat_logprobs = []
        choice.chat_logprobs += content
        return ChatLogprobs(content=content)
