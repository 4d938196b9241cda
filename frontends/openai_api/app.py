"""The Starlette app of the OpenAI-compatible API, on an `AsyncLLMEngine`.

A request body is decoded (`schemas`), its model and parameters checked, its prompt
tokenized here (the chat template for `messages`), and every engine request it makes passes
`AsyncLLMEngine.check_request` before `add_request`, synchronously, so the waiting-queue
limits hold exactly; a refusal is an OpenAI-shaped error (`errors`). Streams are server-sent
events (`data: {chunk}` then `data: [DONE]`); a failure after the stream began is sent as an
error chunk, then the stream ends. A client that goes away aborts its requests at once:
Starlette cancels a stream when the connection closes, and a non-streamed request races its
generation against the connection's `http.disconnect`. `/v1/*`, `/generate` (vLLM's simple
server's endpoint, `simple_generate`) and the worker routes that change or read the engine
need the API key, when one is set, as `Authorization: Bearer`; `/health` and `/metrics` do
not. The routes a load balancer calls on a worker (`/tokenize`, `/get_load`, ...) are in
`worker_routes`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import msgspec
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, Counter
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncengine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
)
from asyncengine.errors import ErrorCode, InvalidRequestError, RequestError
from asyncengine.outputs import RequestOutput
from asyncengine.request_check import QueueLimits
from asyncengine.sampling_params import SamplingParams
from asyncengine.stat_loggers import PrometheusStatLogger
from asyncengine.structured_outputs.frontend import compile_constraint
from frontends.api_key import ApiKey
from frontends.openai_api import schemas
from frontends.openai_api.errors import ApiError, api_error
from frontends.openai_api.responses import (
    ChatMapper,
    CompletionMapper,
    ModelCard,
    ModelList,
    new_id,
)
from frontends.openai_api.worker_routes import PROTECTED_PATHS, WorkerRoutes
from frontends.tokenize_offload import chat_size, maybe_in_thread

if TYPE_CHECKING:
    from frontends.openai_api.server import OpenAIConfig

logger = logging.getLogger(__name__)

_DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def sse_event(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None
                  ) -> Response:
    return Response(_encoder.encode(obj), status_code=status, headers=headers,
                    media_type="application/json")


def error_response(exc: ApiError) -> Response:
    return json_response(exc.body(), exc.status, exc.headers)


class EventStreamResponse(StreamingResponse):
    """Server-sent events; the generator is closed when the response ends however it ends,
    so a client that left mid-stream has its requests aborted at once."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        self._events = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()


class _RequireKey:
    """Refuses `/v1/*` without the right `Authorization: Bearer` key (HTTP 401)."""

    def __init__(self, app: ASGIApp, api: OpenAIApp) -> None:
        self.app = app
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path == "/generate"
                                        or path in PROTECTED_PATHS) \
                and not self.api.authorized(scope):
            exc = ApiError.of(ErrorCode.UNAUTHORIZED, "invalid or missing API key")
            self.api.count_refusal(exc)
            await error_response(exc)(scope, receive, send)
            return
        await self.app(scope, receive, send)


@dataclasses.dataclass(slots=True)
class _Submitted:
    """The engine requests of one HTTP request, and how their outputs map to choices."""

    streams: list[RequestStream]
    n: int


class OpenAIApp:
    """The routes and what they share: the engine, limits, the key and the metrics."""

    def __init__(self, engine: AsyncLLMEngine, config: OpenAIConfig, *,
                 model_name: str, metrics: PrometheusStatLogger, rejected: Counter) -> None:
        self.engine = engine
        self.config = config
        self.model_name = model_name
        self.metrics = metrics
        self._rejected = rejected
        self._queue_limits = QueueLimits(config.max_queued_requests,
                                         config.max_queued_prompt_tokens)
        self._api_key = ApiKey(config.api_key)
        self._in_flight: set[RequestStream] = set()
        self._created = int(time.time())
        self.draining = False
        self.app = Starlette(
            routes=[
                Route("/v1/models", self._endpoint(self.models), methods=["GET"]),
                Route("/v1/models/{model:path}", self._endpoint(self.model), methods=["GET"]),
                Route("/v1/completions", self._endpoint(self.completions), methods=["POST"]),
                Route("/v1/chat/completions", self._endpoint(self.chat_completions),
                      methods=["POST"]),
                Route("/generate", self._endpoint(self.generate), methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.render_metrics, methods=["GET"]),
                *WorkerRoutes(self).routes(self._endpoint),
            ],
            middleware=[Middleware(_RequireKey, api=self)],
            exception_handlers={HTTPException: self._http_exception},
        )

    # ------------------------------------------------------------------ plumbing
    def authorized(self, scope: Scope) -> bool:
        if not self._api_key.required:
            return True
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
        return self._api_key.admits(given)

    def count_refusal(self, exc: ApiError) -> None:
        self._rejected.labels(str(exc.code)).inc()

    def close_all(self) -> None:
        """Abort every request still in flight (the server is closing)."""
        for stream in list(self._in_flight):
            stream.close()
        self._in_flight.clear()

    def _endpoint(self, handler: Callable[[Request], Awaitable[Response]]
                  ) -> Callable[[Request], Awaitable[Response]]:
        """`handler` with every refusal answered in OpenAI's shape, and counted."""

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as exc:
                self.count_refusal(exc)
                return error_response(exc)
            except ClientDisconnect:
                return Response(status_code=HTTPStatus.BAD_REQUEST)  # nobody reads it
            except Exception:
                logger.exception("unexpected error serving %s", request.url.path)
                exc = ApiError.of(ErrorCode.INTERNAL_ERROR, "internal server error")
                self.count_refusal(exc)
                return error_response(exc)

        return run

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = ErrorCode.NOT_FOUND if exc.status_code == 404 else ErrorCode.INVALID_REQUEST
        err = ApiError(exc.status_code, code, str(exc.detail))
        self.count_refusal(err)
        return error_response(err)

    async def _body(self, request: Request) -> bytes:
        limit = self.config.max_body_size
        too_big = ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, ErrorCode.INVALID_REQUEST,
                           f"the body is larger than {limit} bytes")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError.of(ErrorCode.NOT_FOUND, f"the model `{model[:256]}` does not exist "
                              f"(this server serves `{self.model_name}`)", param="model")

    def _check_serving(self) -> None:
        if self.draining:
            raise ApiError.of(ErrorCode.ENGINE_ERROR, "server is shutting down")
        if not self.engine.is_running:
            raise ApiError.of(ErrorCode.ENGINE_ERROR, "engine is not running")

    # ------------------------------------------------------------------ plain routes
    async def health(self, request: Request) -> Response:
        if self.engine.errored:
            return Response("engine is dead\n", HTTPStatus.SERVICE_UNAVAILABLE)
        if self.draining or not self.engine.is_running:
            return Response("shutting down\n", HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=HTTPStatus.OK)

    async def render_metrics(self, request: Request) -> Response:
        self.metrics.on_stats(self.engine.stats())
        return Response(self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _card(self) -> ModelCard:
        root = self.engine.model_dir
        return ModelCard(id=self.model_name, created=self._created,
                         root=str(root) if root else None,
                         max_model_len=self.engine.max_model_len)

    async def models(self, request: Request) -> Response:
        return json_response(ModelList(data=[self._card()]))

    async def model(self, request: Request) -> Response:
        self._check_model(request.path_params["model"])
        return json_response(self._card())

    async def generate(self, request: Request) -> Response:
        """vLLM's simple server's `POST /generate` (`simple_generate`, which builds on this
        module, hence the late import)."""
        from frontends.openai_api.simple_generate import generate

        return await generate(self, request)

    # ------------------------------------------------------------------ completions
    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        req: schemas.CompletionRequest | None = None
        try:
            req = schemas.decode_completion(body)
            self._check_model(req.model)
            params = req.sampling_params()
            prompts = req.prompts()
            self._check_serving()
            await self._compile_constraint(params)
            prompt_ids = [await self._tokenize(p) for p in prompts]
            echo = [p if isinstance(p, str) else self._decode(p) for p in prompts] \
                if req.echo else None
            mapper = CompletionMapper(new_id("cmpl"), self.model_name,
                                      [len(ids) for ids in prompt_ids], self._token_text,
                                      params.logprobs, n=params.n, echo=echo,
                                      echo_only=req.echo_only, prompt_ids=prompt_ids,
                                      prompt_logprobs=req.prompt_logprobs)
            submitted = self._submit(mapper.id, prompt_ids, params)
        except RequestError as exc:
            raise ApiError.from_request_error(
                exc, req.param_name(exc.field) if req is not None else exc.field) from None
        return await self._reply(request, req, mapper, submitted)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._body(request)
        req: schemas.ChatCompletionRequest | None = None
        try:
            req = schemas.decode_chat(body)
            self._check_model(req.model)
            tools = req.tool_plan(self.config.tool_call_parser)
            params = req.sampling_params(tools)
            messages = req.template_messages()
            self._check_serving()
            await self._compile_constraint(params)
            prompt_ids = [await self._apply_chat_template(
                messages, tools.template_tools() if tools is not None else None)]
            mapper = ChatMapper(new_id("chatcmpl"), self.model_name, [len(prompt_ids[0])],
                                self._token_text, params.logprobs, n=params.n,
                                prompt_ids=prompt_ids, prompt_logprobs=req.prompt_logprobs,
                                tools=tools)
            submitted = self._submit(mapper.id, prompt_ids, params)
        except RequestError as exc:
            raise ApiError.from_request_error(
                exc, req.param_name(exc.field) if req is not None else exc.field) from None
        return await self._reply(request, req, mapper, submitted)

    async def _reply(self, request: Request,
                     req: schemas.CompletionRequest | schemas.ChatCompletionRequest,
                     mapper: CompletionMapper | ChatMapper, submitted: _Submitted) -> Response:
        """Stream the submitted requests' chunks, or wait for them and answer once."""
        if req.stream:
            return EventStreamResponse(self._events(mapper, submitted, req.include_usage,
                                                    req.continuous_usage))
        await self._until_disconnect(request, self._collect(mapper, submitted))
        return json_response(mapper.final())

    # ------------------------------------------------------------------ engine side
    async def _tokenize(self, prompt: schemas.Prompt) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.engine.tokenizer is None:
            raise InvalidRequestError("this server has no tokenizer: send the prompt as token "
                                      "ids", field="prompt")
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", field="prompt")
        return await maybe_in_thread(len(prompt), self.engine.encode, prompt)

    async def _compile_constraint(self, params: SamplingParams) -> None:
        """Compile the request's grammar (in a worker thread, within the time limit) before
        it is queued, so a bad or slow grammar is a 400 and the step loop never waits."""
        if params.structured_outputs is not None:
            await compile_constraint(self.engine, params.structured_outputs)

    async def _apply_chat_template(self, messages: list[dict[str, Any]],
                                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        try:
            ids = await maybe_in_thread(chat_size(messages, tools), self.engine.encode_chat,
                                        messages, tools)  # fmt: skip
        except RequestError:
            raise
        except (TemplateError, ValueError, TypeError, KeyError) as exc:
            # The template's own complaint about these messages (roles out of order, ...).
            raise InvalidRequestError(f"the chat template refused the messages: {exc}",
                                      field="messages") from exc
        return list(ids)

    def _decode(self, ids: list[int]) -> str:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("echo of token ids needs a tokenizer", field="echo")
        return str(tokenizer.decode(ids))

    def _token_text(self, token_id: int) -> str:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return f"token_id:{token_id}"
        return str(tokenizer.decode([token_id]))

    def _submit(self, response_id: str, prompt_ids: list[list[int]],
                params: SamplingParams) -> _Submitted:
        """Check and add one engine request per prompt, with no suspension in between, so the
        queue limits hold; a refusal aborts those already added."""
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompt_ids):
                rid = f"{response_id}-{i}"
                own = dataclasses.replace(params)
                self.engine.check_request(rid, ids, own, queue_limits=self._queue_limits)
                if self.config.log_prompts:
                    logger.info("request %s: %r", rid, ids)
                streams.append(self.engine.add_request(None, own, rid, prompt_token_ids=ids))
        except EngineDeadError as exc:
            for s in streams:
                s.close()
            raise api_error(exc) from None
        except BaseException:
            for s in streams:
                s.close()
            raise
        self._in_flight.update(streams)
        return _Submitted(streams, params.n)

    def _release(self, submitted: _Submitted) -> None:
        for s in submitted.streams:
            s.close()  # aborts the request if it has not finished
            self._in_flight.discard(s)

    async def _outputs(self, submitted: _Submitted
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every engine request, as they come."""
        streams = submitted.streams
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        # Bounded: a pump waits while the consumer lags, and its mailbox merges meanwhile.
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = \
            asyncio.Queue(maxsize=len(streams))

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await queue.put((i, out))
            except Exception as exc:
                await queue.put((i, exc))
            else:
                await queue.put((i, None))

        pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in pumps:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _collect(self, mapper: CompletionMapper | ChatMapper,
                       submitted: _Submitted) -> None:
        try:
            async for i, out in self._outputs(submitted):
                if out.prompt_logprobs is not None:
                    mapper.add_prompt_logprobs(i, out.prompt_logprobs)
                for comp in out.outputs:
                    mapper.chunk(i * submitted.n + comp.index, comp)
        except (RequestError, RequestFailedError, EngineDeadError) as exc:
            raise api_error(exc) from None
        finally:
            self._release(submitted)

    async def _events(self, mapper: CompletionMapper | ChatMapper, submitted: _Submitted,
                      include_usage: bool, continuous_usage: bool = False
                      ) -> AsyncIterator[bytes]:
        """The response as server-sent events; ends with `data: [DONE]`."""
        try:
            if isinstance(mapper, ChatMapper):
                for index in range(len(mapper.choices)):
                    yield sse_event(mapper.role_chunk(index))
            async for i, out in self._outputs(submitted):
                if out.prompt_logprobs is not None:
                    mapper.add_prompt_logprobs(i, out.prompt_logprobs)
                for comp in out.outputs:
                    if comp.text or comp.token_ids or comp.finish_reason is not None:
                        chunk = mapper.chunk(i * submitted.n + comp.index, comp)
                        if continuous_usage:
                            chunk.usage = mapper.usage()
                        yield sse_event(chunk)
            if include_usage:
                yield sse_event(mapper.usage_chunk())
        except Exception as exc:
            err = api_error(exc)  # the stream began: the error is its last event
            self.count_refusal(err)
            yield sse_event(err.body())
        finally:
            self._release(submitted)
        yield _DONE

    async def _until_disconnect(self, request: Request, work: Coroutine[Any, Any, None]
                                ) -> None:
        """Run `work` unless the client goes first: then cancel it (which aborts its engine
        requests) and raise `ClientDisconnect`."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
            await asyncio.gather(task, gone, return_exceptions=True)
        if task.cancelled():
            raise ClientDisconnect()
        task.result()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass

