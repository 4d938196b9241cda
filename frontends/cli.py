"""The `asyncengine` command: `serve`, `chat`, `generate` and `monitor`.

Engine flags are generated from `EngineArgs` in vLLM's spelling (`--max-num-seqs`,
`--enable-prefix-caching/--no-enable-prefix-caching`, ...). The async entry points run on
uvloop. Any failure (a bad flag, model path, config or engine argument, an unreachable
server) ends with one `asyncengine: error: ...` line on stderr and a non-zero exit; the
traceback is printed only with `--log-level DEBUG`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import sys
import traceback
import types
import typing
from collections.abc import Coroutine, Sequence
from typing import Any

from asyncengine.config import EngineArgs
from asyncengine_kernels import envs
from frontends.fleet import FleetError, add_fleet_args
from frontends.openai_api.tool_parsers import PARSERS

logger = logging.getLogger("asyncengine.cli")

DEFAULT_URL = "ws://127.0.0.1:8765"
_ENGINE_HELP = {
    "model": "model directory or GGUF file; omitted: the embedded SmolLM2-135M-Instruct",
    "tokenizer": "tokenizer directory (default: the model's)",
    "device": "where the model runs",
    "speculative_config": "speculative decoding as a JSON object, vLLM's spelling: "
    "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' "
    "or a draft model: '{\"model\": \"DIR\", \"num_speculative_tokens\": 4}'",
    "dtype": "weight and activation dtype",
    "seed": "random seed for weights (dummy) and sampling",
    "max_model_len": "longest prompt + output, in tokens (default: the model's limit)",
    "block_size": "tokens per KV-cache block",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use",
    "num_kv_blocks": "number of KV-cache blocks (overrides memory profiling)",
    "swap_space": "CPU swap space for preempted requests, GiB",
    "preemption_mode": "what preemption does with a request's KV blocks",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "max_num_seqs": "most requests in one batch (a ceiling: the KV pool decides how many of "
    "them run)",
    "schedule_conservativeness": "room admission keeps for running requests' growth: 1 "
    "adaptive, 0 none (admit whatever fits now), above 1 more",
    "max_num_batched_tokens": "token budget of one step",
    "enforce_eager": "never use CUDA graphs",
    "async_scheduling": "prepare step N+1 while step N runs on the device (default: on CUDA)",
    "tensor_parallel_size": "number of GPUs to shard the model over",
    "load_format": "weight format; dummy = random weights with the model's shapes",
    "quantization": "quantized weight format (default: what config.json says)",
    "skip_tokenizer_init": "no tokenizer: token-id prompts in, token ids out",
    "cpu_kv_cache_gib": "CPU only: cap on the KV pool, GiB",
    "structured_outputs_compile_timeout": "seconds a grammar may take to compile before its "
                                          "request is refused",
    "structured_outputs_jump_forward": "verify the tokens a grammar forces as drafts, "
                                       "several in one model step (exact)",
    "kv_cache_dtype": "KV cache element type: auto (the model dtype) or fp8 / fp8_e4m3 (e4m3 "
    "with per-KV-head K/V scales, half the bytes; CUDA needs compute capability 8.9+)",
    "calculate_kv_scales": "FP8 KV cache: calibrate the K/V scales at start-up on a shipped "
    "text (default: when the checkpoint has none; --no-calculate-kv-scales keeps 1.0)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineArgs` field, typed and defaulted from the dataclass."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    for field in dataclasses.fields(EngineArgs):
        flag = "--" + field.name.replace("_", "-")
        hint = hints[field.name]
        kwargs: dict[str, Any] = {"default": field.default, "dest": field.name,
                                  "help": _ENGINE_HELP.get(field.name, field.name)}
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if hint is bool or (args == [bool] and field.default is None):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(hint) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(hint))
        elif typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
            inner = args[0]
            if typing.get_origin(inner) is typing.Literal:
                kwargs["choices"] = list(typing.get_args(inner))
            elif inner is dict:
                kwargs["type"] = _json_object
            else:
                kwargs["type"] = inner
        else:
            kwargs["type"] = hint
        if "help" in kwargs and field.default is not None and hint is not bool:
            kwargs["help"] += f" (default: {field.default})"
        group.add_argument(flag, **kwargs)


def _json_object(value: str) -> dict:
    """A flag given as a JSON object (`--speculative-config '{"method": "ngram", ...}'`)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {value!r}") from e
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return parsed


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


class _ArgumentParser(argparse.ArgumentParser):
    """Reports a usage error in one line (argparse prints the whole usage block first)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"asyncengine: error: {message} (see `{self.prog} --help`)\n")


def _log_level(value: str) -> str:
    level = value.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(
            f"unknown log level {value!r} (DEBUG, INFO, WARNING, ERROR or CRITICAL)")
    return level


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="asyncengine",
                             description="LLM inference engine with a WebSocket server and an "
                                         "OpenAI-compatible HTTP API.")
    parser.add_argument("--log-level", default=envs.log_level(),
                        type=_log_level, help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over WebSocket and OpenAI's HTTP API")
    add_engine_args(serve)
    net = serve.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1",
                     help="interface to bind (non-loopback needs an API key)")
    net.add_argument("--port", type=int, default=8765, help="WebSocket port")
    net.add_argument("--openai-port", type=int, default=8000,
                     help="port of the OpenAI-compatible HTTP API (/v1/completions, "
                          "/v1/chat/completions, /v1/models); 0 turns it off (default: 8000)")
    net.add_argument("--served-model-name", default=None,
                     help="model id of the OpenAI API (default: the model directory's name)")
    _add_api_key(net)
    net.add_argument("--allowed-origins", nargs="*", default=None,
                     help="accepted Origin headers of browser clients; default: loopback "
                          "pages only, '*' for any (clients sending no Origin are accepted)")
    net.add_argument("--max-queued-requests", type=int, default=1024)
    net.add_argument("--max-queued-prompt-tokens", type=int, default=1 << 20)
    net.add_argument("--max-requests-per-connection", type=int, default=256)
    net.add_argument("--max-message-size", type=int, default=1 << 20,
                     help="largest accepted WebSocket frame, bytes")
    net.add_argument("--drain-timeout", type=float, default=30.0,
                     help="seconds in-flight requests may take to finish on shutdown")
    net.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                     help="how tool_choice 'auto' reads tool calls from the model's output "
                          "(hermes: <tool_call> JSON blocks)")
    net.add_argument("--log-prompts", action="store_true",
                     help="log prompt text (off by default)")
    net.add_argument("--disable-log-stats", action="store_true",
                     help="no throughput/queue/KV line in the log every 10 s while serving")
    net.add_argument("--dashboard", action="store_true",
                     help="run the terminal dashboard in this process")
    net.add_argument("--demo-load", action="store_true",
                     help="keep a few demo generations running against the server")
    add_fleet_args(serve)

    chat = sub.add_parser("chat", help="interactive chat with a running server")
    chat.add_argument("--url", default=DEFAULT_URL)
    _add_api_key(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)

    gen = sub.add_parser("generate", help="generate for one prompt offline (no server)")
    add_engine_args(gen)
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)

    mon = sub.add_parser("monitor", help="terminal dashboard of a running server")
    mon.add_argument("--url", nargs="+", default=[DEFAULT_URL],
                     help="WebSocket URL of the server; several (a fleet's replicas): one "
                          "row each beside their totals")
    _add_api_key(mon)
    mon.add_argument("--interval", type=float, default=1.0)
    return parser


def _add_api_key(parser: Any) -> None:
    parser.add_argument("--api-key", default=envs.api_key(),
                        help="API key (default: $ASYNCENGINE_API_KEY)")


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run `coro` on uvloop."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _import_dashboard(name: str = "run_monitor") -> Any:
    """`frontends.dashboard.<name>` (`run_monitor` or `run_fleet_monitor`), or a one-line
    exit where the dashboard's dependencies are missing."""
    try:
        import frontends.dashboard as dashboard
    except ImportError as exc:
        raise SystemExit(f"the dashboard is not available ({exc}); "
                         "run `asyncengine serve` without --dashboard") from exc
    return getattr(dashboard, name)


async def serve(ns: argparse.Namespace) -> None:
    from asyncengine.async_engine import AsyncLLMEngine
    from frontends.openai_api import OpenAIConfig, OpenAIServer
    from frontends.server import ServerConfig, run_server

    config = ServerConfig(
        host=ns.host, port=ns.port, api_key=ns.api_key, allowed_origins=ns.allowed_origins,
        max_size=ns.max_message_size, max_queued_requests=ns.max_queued_requests,
        max_queued_prompt_tokens=ns.max_queued_prompt_tokens,
        max_requests_per_connection=ns.max_requests_per_connection,
        drain_timeout=ns.drain_timeout, log_prompts=ns.log_prompts,
    )
    http_config = None
    if ns.openai_port:
        http_config = OpenAIConfig(
            host=ns.host, port=ns.openai_port, api_key=ns.api_key,
            served_model_name=ns.served_model_name,
            max_queued_requests=ns.max_queued_requests,
            max_queued_prompt_tokens=ns.max_queued_prompt_tokens,
            drain_timeout=ns.drain_timeout, log_prompts=ns.log_prompts,
            tool_call_parser=ns.tool_call_parser,
        )
    config.validate()  # refuse a bad bind before spending time on the model
    if http_config is not None:
        http_config.validate()
    run_monitor = _import_dashboard() if ns.dashboard else None
    args = engine_args_from(ns)
    logger.info("loading model %s", args.model or "(embedded SmolLM2-135M-Instruct)")
    engine = AsyncLLMEngine.from_engine_args(args)
    pool = engine.block_pool
    logger.info("model %s on %s (%s): %d KV blocks of %d tokens, max_model_len %d",
                engine.model_name, engine.device, engine.dtype,
                pool.num_blocks, pool.block_size, engine.max_model_len)

    # The HTTP API starts once the WebSocket server listens (it shares its metrics) and
    # drains beside it when a signal sets `stop`.
    stop = asyncio.Event()
    http_servers: list[OpenAIServer] = []
    http_failure: list[BaseException] = []

    async def after_start(server: Any) -> None:
        logger.info("listening on %s%s", server.url,
                    " (API key required)" if config.api_key else "")
        if http_config is not None:
            http = OpenAIServer(engine, http_config, metrics=server.metrics)
            try:
                await http.start()
            except BaseException as exc:
                http_failure.append(exc)
                raise
            http_servers.append(http)
        stats_lines = None
        if not ns.disable_log_stats:
            stats_lines = asyncio.create_task(log_stats_every(engine, STATS_LOG_INTERVAL_S))
        demo = None
        if ns.demo_load:
            from frontends.demo_load import run_demo_load

            demo = asyncio.create_task(run_demo_load(server.url, config.api_key))
        try:
            if run_monitor is not None:
                with _logs_to_textual():
                    await run_monitor(server.url, config.api_key)
            else:
                await asyncio.Event().wait()  # until a signal stops the server
        finally:
            for task in (demo, stats_lines):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)

    async def drain_http() -> None:
        await stop.wait()
        for http in http_servers:
            await http.drain()

    http_drain = asyncio.create_task(drain_http())
    try:
        await run_server(engine, config, stop=stop, on_started=after_start)
    finally:
        stop.set()
        await http_drain
        await engine.shutdown()
    if http_failure:
        raise http_failure[0]


STATS_LOG_INTERVAL_S = 10.0


async def log_stats_every(engine: Any, interval_s: float) -> None:
    """A `LoggingStatLogger` on `engine`, fed a fresh snapshot every `interval_s`: the
    engine takes snapshots only when asked (`AsyncLLMEngine.stats`)."""
    from asyncengine.stat_loggers import LoggingStatLogger

    # Spaced a little under the asks, so that a snapshot arriving a moment early never
    # skips a line.
    engine.add_stat_logger(LoggingStatLogger(0.9 * interval_s))
    while True:
        await asyncio.sleep(interval_s)
        engine.stats()


@contextlib.contextmanager
def _logs_to_textual() -> Any:
    """While the dashboard owns the terminal, log lines go to Textual's log, not stderr."""
    from textual.logging import TextualHandler

    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = [TextualHandler()]
    try:
        yield
    finally:
        root.handlers = saved


def generate(ns: argparse.Namespace) -> None:
    from asyncengine.llm import LLM
    from asyncengine.sampling_params import SamplingParams

    args = engine_args_from(ns)
    llm = LLM(**dataclasses.asdict(args))
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature)
    if ns.chat:
        [out] = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False)
    else:
        [out] = llm.generate([ns.prompt], params, use_tqdm=False)
    comp = out.outputs[0]
    print(comp.text if llm.get_tokenizer() is not None else comp.token_ids)


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().level > logging.DEBUG:  # one line per connection is noise
        logging.getLogger("websockets").setLevel(logging.WARNING)
        logging.getLogger("uvicorn").setLevel(logging.WARNING)
    try:
        if ns.command == "serve" and ns.data_parallel_size != 1:
            from frontends.fleet import serve_fleet

            run_monitor = _import_dashboard("run_fleet_monitor") if ns.dashboard else None
            run_async(serve_fleet(ns, run_monitor))
        elif ns.command == "serve":
            run_async(serve(ns))
        elif ns.command == "generate":
            generate(ns)
        elif ns.command == "chat":
            from frontends.chat import run_chat

            try:
                run_async(run_chat(ns.url, ns.api_key, system=ns.system,
                                   max_tokens=ns.max_tokens, temperature=ns.temperature))
            except OSError as exc:
                raise OSError(f"cannot talk to the server at {ns.url}: {exc}") from exc
        elif ns.command == "monitor":
            if len(ns.url) > 1:
                run_async(_import_dashboard("run_fleet_monitor")(ns.url, ns.api_key,
                                                      interval=ns.interval))
            else:
                run_async(_import_dashboard()(ns.url[0], ns.api_key, interval=ns.interval))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        return _report(exc, debug=ns.log_level == "DEBUG")
    return 0


def _report(exc: Exception, *, debug: bool) -> int:
    """One line on stderr for a failure; exit status 2 for a bad value, 1 otherwise."""
    if debug:
        traceback.print_exc()
    # A ValueError or an OSError (missing path, refused connection) says it all; anything
    # else is unexpected, so its type is part of the line.
    if isinstance(exc, ValueError | OSError | FleetError):
        line = str(exc)
    else:
        line = f"{type(exc).__name__}: {exc}"
        if not debug:
            line += " (--log-level DEBUG shows the traceback)"
    print(f"asyncengine: error: {line}", file=sys.stderr)
    return 2 if isinstance(exc, ValueError) else 1


if __name__ == "__main__":
    sys.exit(main())
