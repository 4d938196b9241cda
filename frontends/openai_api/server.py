"""Runs the OpenAI-compatible app under uvicorn on the running event loop.

`asyncengine serve` starts it beside the WebSocket server: same process, same loop (uvloop)
and the same `AsyncLLMEngine`, its own port. The socket is bound here, so port 0 works and
the port is known before the first request. Signals stay with the caller (uvicorn would
otherwise take SIGINT/SIGTERM from the WebSocket server's handlers); `drain` stops accepting
and lets responses in flight finish, `close` aborts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import uvicorn
from prometheus_client import Counter

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.stat_loggers import PrometheusStatLogger
from frontends.listening import ListeningAddress
from frontends.openai_api.app import OpenAIApp
from frontends.openai_api.tool_parsers import PARSERS
from frontends.server import require_key_off_loopback

logger = logging.getLogger(__name__)

# The embedded model's id when no --served-model-name is given.
_EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct"


@dataclasses.dataclass
class OpenAIConfig:
    """How the HTTP API listens and what it accepts."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # None: the model directory's (or file's) name
    max_queued_requests: int = 1024  # accepted requests still waiting for a first token
    max_queued_prompt_tokens: int = 1 << 20  # their prompt tokens
    max_body_size: int = 1 << 24  # bytes; larger bodies get HTTP 413
    drain_timeout: float = 30.0
    log_prompts: bool = False
    # How `tool_choice: auto` reads calls from the model's text (None: auto is refused).
    tool_call_parser: str | None = None

    def validate(self) -> None:
        require_key_off_loopback(self.host, self.api_key)
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(PARSERS))}, "
                             f"got {self.tool_call_parser!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_size < 1:
            raise ValueError("max_body_size must be >= 1")


def served_model_name(engine: AsyncLLMEngine, configured: str | None) -> str:
    """The model id clients send: as configured, else the model path's last part."""
    if configured:
        return configured
    model = engine.requested_model
    if not model:
        return _EMBEDDED_MODEL_ID
    return Path(model).name or str(model)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the process's owner handles signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class OpenAIServer(ListeningAddress):
    """The HTTP API around an engine. `metrics`, when given, is the stat logger (and
    registry) another frontend already feeds, so `/metrics` on both ports says the same."""

    scheme = "http"

    def __init__(self, engine: AsyncLLMEngine, config: OpenAIConfig, *,
                 metrics: PrometheusStatLogger | None = None) -> None:
        config.validate()
        self.engine = engine
        self.config = config
        self.model_name = served_model_name(engine, config.served_model_name)
        self._own_metrics = metrics is None
        self.metrics = metrics or PrometheusStatLogger(engine.model_name)
        rejected = Counter("asyncengine_http_requests_rejected",
                           "OpenAI API requests refused, by error code.", ["code"],
                           registry=self.metrics.registry)
        self.api = OpenAIApp(engine, config, model_name=self.model_name, metrics=self.metrics,
                             rejected=rejected)
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self._address: tuple[str, int] | None = None

    async def start(self) -> None:
        cfg = self.config
        sock = _bind(cfg.host, cfg.port)
        self._address = sock.getsockname()[:2]
        uv_config = uvicorn.Config(
            self.api.app, lifespan="off", log_config=None, access_log=False, ws="none",
            timeout_graceful_shutdown=int(cfg.drain_timeout), server_header=False,
        )
        self._server = _Uvicorn(uv_config)
        if self._own_metrics:
            self.engine.add_stat_logger(self.metrics)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()  # raises why it did not start
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        logger.info("OpenAI-compatible API for %r on %s/v1", self.model_name, self.url)

    async def drain(self, timeout: float | None = None) -> None:
        """Stop accepting; let responses in flight finish (aborted after `timeout`)."""
        if self._server is None or self._task is None or self._task.done():
            return
        self.api.draining = True
        timeout = self.config.drain_timeout if timeout is None else timeout
        self._server.config.timeout_graceful_shutdown = max(0, int(timeout))
        self._server.should_exit = True
        await asyncio.wait([self._task])
        self._finish()

    async def close(self) -> None:
        """Stop at once: requests in flight are aborted."""
        if self._server is None or self._task is None or self._task.done():
            self._finish()
            return
        self.api.draining = True
        self.api.close_all()
        self._server.should_exit = True
        self._server.force_exit = True
        for task in list(self._server.server_state.tasks):
            task.cancel()
        await asyncio.wait([self._task])
        self._finish()

    def _finish(self) -> None:
        self.api.close_all()
        if self._own_metrics:
            self.engine.remove_stat_logger(self.metrics)
        if self._task is not None and self._task.done() and not self._task.cancelled() \
                and self._task.exception() is not None:
            logger.error("the HTTP server failed: %r", self._task.exception())


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for the OpenAI API: {exc}") from exc
    sock.setblocking(False)
    return sock


@contextlib.asynccontextmanager
async def serve_openai(engine: AsyncLLMEngine, config: OpenAIConfig | None = None, *,
                       metrics: PrometheusStatLogger | None = None
                       ) -> AsyncIterator[OpenAIServer]:
    """Serve the API for the duration of the block; on exit, requests in flight are aborted.

    `async with serve_openai(engine, OpenAIConfig(port=0)) as server: server.url`
    """
    server = OpenAIServer(engine, config or OpenAIConfig(), metrics=metrics)
    await server.start()
    try:
        yield server
    finally:
        await server.close()
