"""What a load balancer calls on a worker, beside the OpenAI routes: vllm-router's contract.

`POST /tokenize` and `POST /detokenize` take and answer vLLM's shapes (the cache-aware
policy tokenizes prompts), `GET /get_load` answers `{"load": N}` with the requests accepted
and not finished (the power-of-two policy), `POST /flush_cache` (and vLLM's name for it,
`POST /reset_prefix_cache`) drops the prefix cache's free blocks, and `GET /version` says
which asyncengine this is. `/health` and `/v1/models` are the app's own routes.

`/tokenize`, `/detokenize` and the cache flush need the API key when one is set, like
`/v1/*`; `/get_load` and `/version`, like `/health`, do not.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncengine.errors import ErrorCode, InvalidRequestError, RequestError
from frontends.openai_api.errors import ApiError
from frontends.openai_api.schemas import ChatMessage, _decode

if TYPE_CHECKING:
    from frontends.openai_api.app import OpenAIApp

Handler = Callable[[Request], Awaitable[Response]]

# Routes behind the API key besides `/v1/*`.
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize", "/flush_cache", "/reset_prefix_cache"})


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's `TokenizeCompletionRequest` (`prompt`) or `TokenizeChatRequest` (`messages`)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class LoadResponse(msgspec.Struct, kw_only=True):
    load: int


class FlushResponse(msgspec.Struct, kw_only=True):
    status: str
    flushed_blocks: int


class VersionResponse(msgspec.Struct, kw_only=True):
    version: str


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)
_encoder = msgspec.json.Encoder()


@functools.cache
def asyncengine_version() -> str:
    try:
        return importlib.metadata.version("asyncengine")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def _json(obj: object) -> Response:
    return Response(_encoder.encode(obj), media_type="application/json")


class WorkerRoutes:
    """The handlers, on the app's engine, model name and body limit."""

    def __init__(self, api: OpenAIApp) -> None:
        self.api = api
        self.engine = api.engine

    def routes(self, wrap: Callable[[Handler], Handler]) -> list[Route]:
        """The routes, each handler wrapped by `wrap` (the app answers refusals in
        OpenAI's shape)."""
        return [
            Route("/tokenize", wrap(self.tokenize), methods=["POST"]),
            Route("/detokenize", wrap(self.detokenize), methods=["POST"]),
            Route("/get_load", wrap(self.get_load), methods=["GET"]),
            Route("/flush_cache", wrap(self.flush_cache), methods=["POST"]),
            Route("/reset_prefix_cache", wrap(self.flush_cache), methods=["POST"]),
            Route("/version", wrap(self.version), methods=["GET"]),
        ]

    async def tokenize(self, request: Request) -> Response:
        body = await self.api._body(request)
        try:
            req: TokenizeRequest = _decode(_tokenize_decoder, body)
            self.api._check_model(req.model)
            ids = self._tokens_of(req)
            strs = None
            if req.return_token_strs:
                tokenizer = self.engine.tokenizer
                strs = [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
        except RequestError as exc:
            raise ApiError.from_request_error(exc) from None
        return _json(TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len,
                                      tokens=ids, token_strs=strs))

    def _tokens_of(self, req: TokenizeRequest) -> list[int]:
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages",
                                      field="prompt" if req.prompt is None else "messages")
        if req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            return self.engine.encode(req.prompt, add_special_tokens=special)
        assert req.messages is not None
        if not req.messages:
            raise InvalidRequestError("messages must not be empty", field="messages")
        if req.add_special_tokens:
            # vLLM's flag for chat: the template already places BOS; asking again doubles it.
            raise InvalidRequestError("add_special_tokens is not supported with messages "
                                      "(the chat template adds them)",
                                      field="add_special_tokens")
        messages = [m.template_dict(i) for i, m in enumerate(req.messages)]
        return self.engine.encode_chat(messages,
                                       add_generation_prompt=req.add_generation_prompt)

    async def detokenize(self, request: Request) -> Response:
        body = await self.api._body(request)
        try:
            req: DetokenizeRequest = _decode(_detokenize_decoder, body)
            self.api._check_model(req.model)
            vocab = self._vocab_size()
            for i, token in enumerate(req.tokens):
                if not 0 <= token < vocab:
                    raise InvalidRequestError(f"token id {token} is outside the vocabulary "
                                              f"[0, {vocab})", field=f"tokens[{i}]")
            text = self.engine.decode(req.tokens)
        except RequestError as exc:
            raise ApiError.from_request_error(exc) from None
        return _json(DetokenizeResponse(prompt=text))

    def _vocab_size(self) -> int:
        tokenizer = self.engine.tokenizer
        sizes = [getattr(self.engine.model_config, "vocab_size", None)]
        if tokenizer is not None:
            sizes.append(len(tokenizer))
        return max(int(s) for s in sizes if s)

    async def get_load(self, request: Request) -> Response:
        return _json(LoadResponse(load=self.engine.load))

    async def flush_cache(self, request: Request) -> Response:
        self.api._check_serving()
        try:
            dropped = await self.engine.reset_prefix_cache()
        except RuntimeError as exc:  # the engine died or stopped meanwhile
            raise ApiError.of(ErrorCode.ENGINE_ERROR, str(exc)) from None
        return _json(FlushResponse(status="ok", flushed_blocks=dropped))

    async def version(self, request: Request) -> Response:
        return _json(VersionResponse(version=asyncengine_version()))
