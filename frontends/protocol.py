"""The WebSocket protocol: JSON text frames, one msgspec tagged union per direction on "type".

client → server: `generate`, `cancel`, `stats.subscribe`, `stats.unsubscribe`.
server → client: `delta`, `done`, `error`, `stats`.

With `params.n` > 1 one request streams n samples: each `delta` carries the `index` of its
sample, and the one `done` lists every sample's finish reason (`finish_reasons`, by index)
with usage summed over the samples. For n = 1 neither field is sent.

`params.prompt_logprobs = k` (vLLM's) scores the prompt: the `done` event then carries
`prompt_logprobs`, per prompt token None for the first, then `{token id: {logprob, rank,
decoded_token}}` holding the token itself and its top-k (the whole prompt at once, at the end,
so deltas stay small).

Limits live in the types (`msgspec.Meta`), so a decode validates everything and a failure
message names the JSON path (e.g. "... - at `$.params.max_tokens`"). `decode_client_message`
turns every failure into an `Error` event carrying the request id when it can be recovered.
Encoders and decoders are built once and reused. `Error.code` is one of
`asyncengine.errors.ErrorCode` (re-exported here as `ErrorCode`).
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec

from asyncengine.errors import ErrorCode
from asyncengine.outputs import PromptLogprobs
from asyncengine.sampling_params import RequestOutputKind, SamplingParams
from asyncengine.stats_schema import EngineStats
from asyncengine.structured_outputs import StructuredOutputsParams

_MAX_REQUEST_ID = 256
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_REQUEST_ID)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_MAX_TOKENS_LIMIT = 1 << 20
_MAX_N = 256  # the engine refuses an n the KV pool cannot hold; this bounds the message


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True,
                        omit_defaults=True):
    """One output constraint (`asyncengine.StructuredOutputsParams`, vLLM's names)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class GenerateParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Sampling parameters of a `generate` request (vLLM names and defaults)."""

    n: Annotated[int, msgspec.Meta(ge=1, le=_MAX_N)] = 1
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=_MAX_TOKENS_LIMIT)] = 16
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=_MAX_TOKENS_LIMIT)] = 0
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=1 << 20)] = -1
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = 1.0
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    stop: StopString | Annotated[list[StopString], msgspec.Meta(max_length=16)] | None = None
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=64)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")

    def to_sampling_params(
        self, output_kind: RequestOutputKind = RequestOutputKind.DELTA
    ) -> SamplingParams:
        return SamplingParams(
            n=self.n, max_tokens=self.max_tokens, min_tokens=self.min_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=list(self.stop) if isinstance(self.stop, list) else self.stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, output_kind=output_kind,
            prompt_logprobs=self.prompt_logprobs,
            structured_outputs=_constraint(self.structured_outputs),
        )


def _constraint(spec: StructuredOutputs | None) -> StructuredOutputsParams | None:
    if spec is None:
        return None
    return StructuredOutputsParams(**msgspec.structs.asdict(spec))


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    content: str


# ----------------------------------------------------------------------- client → server
class ClientEvent(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    """Base of every message a client sends."""


class Generate(ClientEvent, tag="generate", omit_defaults=True):
    """Start a request: exactly one of `prompt`, `messages` or `prompt_token_ids`."""

    request_id: RequestId
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None = None
    prompt_token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)] | None = None
    params: GenerateParams = msgspec.field(default_factory=GenerateParams)

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids))
        if given != 1:
            raise ValueError("exactly one of `prompt`, `messages`, `prompt_token_ids` is required")
        if self.prompt is not None and not self.prompt:
            raise ValueError("`prompt` must not be empty")


class Cancel(ClientEvent, tag="cancel"):
    request_id: RequestId


class StatsSubscribe(ClientEvent, tag="stats.subscribe"):
    interval: Annotated[float, msgspec.Meta(ge=0.05, le=3600.0)] = 1.0


class StatsUnsubscribe(ClientEvent, tag="stats.unsubscribe"):
    pass


ClientMessage = Generate | Cancel | StatsSubscribe | StatsUnsubscribe
CLIENT_TYPES: Final = frozenset({"generate", "cancel", "stats.subscribe", "stats.unsubscribe"})


# ----------------------------------------------------------------------- server → client
class ServerEvent(msgspec.Struct, kw_only=True, tag_field="type"):
    """Base of every message the server sends."""


class Delta(ServerEvent, tag="delta", omit_defaults=True):
    request_id: str
    text: str
    token_ids: list[int]
    index: int | None = None  # the sample's index, for a request with n > 1


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int


class PromptLogprob(msgspec.Struct, kw_only=True):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


WirePromptLogprobs = list[dict[int, PromptLogprob] | None]


def wire_prompt_logprobs(entries: PromptLogprobs) -> WirePromptLogprobs:
    """The engine's prompt logprobs as `done` carries them (JSON keys are the token ids)."""
    return [None if e is None else {
        t: PromptLogprob(logprob=max(lp.logprob, -9999.0), rank=lp.rank,
                         decoded_token=lp.decoded_token) for t, lp in e.items()}
        for e in entries]  # fmt: skip


class Done(ServerEvent, tag="done", omit_defaults=True):
    request_id: str
    finish_reason: str  # with n > 1, sample 0's
    usage: Usage
    finish_reasons: list[str] | None = None  # every sample's, by index, for n > 1
    prompt_logprobs: WirePromptLogprobs | None = None  # with params.prompt_logprobs


class Error(ServerEvent, tag="error"):
    code: str  # an `ErrorCode` value; a plain string so a client accepts codes added later
    message: str
    request_id: str | None = None


class Stats(ServerEvent, tag="stats"):
    stats: EngineStats


ServerMessage = Delta | Done | Error | Stats


# ----------------------------------------------------------------------- codecs
_encoder = msgspec.json.Encoder()
_client_decoder = msgspec.json.Decoder(ClientMessage)
_server_decoder = msgspec.json.Decoder(ServerMessage)


class _Probe(msgspec.Struct):
    """Lenient view of a bad message, to recover its type and request id."""

    type: str | None = None
    request_id: str | None = None


_probe_decoder = msgspec.json.Decoder(_Probe)


def encode(event: ClientEvent | ServerEvent) -> bytes:
    """JSON bytes of one event (send them as a text frame)."""
    return _encoder.encode(event)


def decode_server_message(data: bytes | str) -> Delta | Done | Error | Stats:
    return _server_decoder.decode(data)


def decode_client_message(data: bytes | str) -> Generate | Cancel | StatsSubscribe | \
        StatsUnsubscribe | Error:
    """Decode one client frame; every failure comes back as an `Error` event to send."""
    try:
        return _client_decoder.decode(data)
    except msgspec.ValidationError as exc:
        probe = _probe(data)
        if probe.type is not None and probe.type not in CLIENT_TYPES:
            return Error(code=ErrorCode.UNKNOWN_TYPE, request_id=probe.request_id,
                         message=f"unknown message type {probe.type[:64]!r}; expected one of "
                                 f"{', '.join(sorted(CLIENT_TYPES))}")
        return Error(code=ErrorCode.INVALID_REQUEST, message=str(exc), request_id=probe.request_id)
    except msgspec.DecodeError as exc:
        return Error(code=ErrorCode.INVALID_REQUEST, message=f"malformed JSON: {exc}")
    except RecursionError:
        # msgspec recurses while it skips fields (e.g. to find the tag): deep nesting ends here.
        return Error(code=ErrorCode.INVALID_REQUEST, message="malformed JSON: nested too deeply")


def _probe(data: bytes | str) -> _Probe:
    try:
        probe = _probe_decoder.decode(data)
    except (msgspec.MsgspecError, RecursionError):
        return _Probe()
    if probe.request_id is not None and len(probe.request_id) > _MAX_REQUEST_ID:
        probe.request_id = None  # not a valid id: echoing it back would only amplify
    return probe
