"""`asyncengine serve --data-parallel-size N`: N engine replicas behind vllm-router.

Each replica is a full `asyncengine serve` in its own process (its own process group): on
CUDA one per visible GPU through `CUDA_VISIBLE_DEVICES` (or `--replicas-per-gpu` of them
sharing one), on the CPU N processes splitting the cores. Replica i serves its OpenAI API
on `--worker-base-port + i` (default: the router's port + 1 + i) and its WebSocket on
`--port + i`. Once every replica answers `/health`, vllm-router (an optional dependency:
`pip install asyncengine[router]`) starts in front of them on `--openai-port` with
`--router-policy`; it health-checks the workers, retries failed requests on another one and
takes workers added over its HTTP API (`/add_worker?url=`) from other hosts.

The fleet supervises: a replica that dies is restarted on its port and the router takes it
back once its health checks pass; a router that dies ends the fleet. Every failure to start
(too few GPUs, a port in use, a replica or router that does not come up) is one error line
and a non-zero exit, with every process already started stopped: process groups are
terminated on the way out (signals included), and each child also gets SIGKILL when this
process dies (Linux's parent-death signal). Logs of each process go to a file in a run
directory named at start.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import dataclasses
import importlib.util
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from asyncengine.config import EngineArgs

logger = logging.getLogger("asyncengine.fleet")

ROUTER_POLICIES = ("cache_aware", "power_of_two", "round_robin", "consistent_hash")
# Server flags every replica gets from the fleet's command line, as (dest, flag).
_SERVER_FLAGS = (
    ("served_model_name", "--served-model-name"),
    ("max_queued_requests", "--max-queued-requests"),
    ("max_queued_prompt_tokens", "--max-queued-prompt-tokens"),
    ("max_requests_per_connection", "--max-requests-per-connection"),
    ("max_message_size", "--max-message-size"),
    ("drain_timeout", "--drain-timeout"),
)
_POLL_S = 0.25


class FleetError(RuntimeError):
    """The fleet could not start or keep running; the message is the one line to print."""


def add_fleet_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas (data parallel behind vllm-router)")
    group.add_argument("--data-parallel-size", type=int, default=1,
                       help="engine replicas behind vllm-router on --openai-port; 1 serves "
                            "directly (default: 1)")
    group.add_argument("--router-policy", choices=ROUTER_POLICIES, default="cache_aware",
                       help="how the router picks a replica (default: cache_aware)")
    group.add_argument("--replicas-per-gpu", type=int, default=1,
                       help="replicas sharing one GPU (lower --gpu-memory-utilization to "
                            "fit them; default: 1)")
    group.add_argument("--worker-base-port", type=int, default=None,
                       help="OpenAI port of replica 0, +1 per replica (default: "
                            "--openai-port + 1)")
    group.add_argument("--router-health-check-interval", type=int, default=5,
                       help="seconds between the router's health checks of each replica")
    group.add_argument("--router-prometheus-port", type=int, default=0,
                       help="the router's own /metrics port (default 0: any free port)")
    group.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                       help="one more vllm-router argument, repeatable, e.g. "
                            "--router-arg=--retry-max-retries=3")


@dataclasses.dataclass
class FleetConfig:
    """What the fleet launches: `replica_argv` is the `serve` command line every replica
    gets (engine and server flags), the fleet adds each one's ports."""

    size: int
    replica_argv: list[str]
    device: str = "cpu"  # "cpu" or "cuda"
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    router_port: int = 8000
    worker_ports: list[int] = dataclasses.field(default_factory=list)  # OpenAI, per replica
    ws_ports: list[int] = dataclasses.field(default_factory=list)  # WebSocket, per replica
    replicas_per_gpu: int = 1
    gpu_memory_utilization: float = 0.9
    api_key: str | None = None
    health_check_interval_s: int = 5
    router_prometheus_port: int = 0
    router_args: list[str] = dataclasses.field(default_factory=list)
    log_dir: Path | None = None
    log_level: str = "INFO"
    startup_timeout_s: float = 600.0
    restart: bool = True

    @classmethod
    def with_base_ports(cls, size: int, replica_argv: list[str], *, router_port: int,
                        worker_base_port: int | None, ws_base_port: int,
                        **fields: Any) -> FleetConfig:
        """Replica i on `worker_base_port + i` (default: right after the router's port)
        and `ws_base_port + i`."""
        base = worker_base_port if worker_base_port is not None else router_port + 1
        return cls(size=size, replica_argv=replica_argv, router_port=router_port,
                   worker_ports=[base + i for i in range(size)],
                   ws_ports=[ws_base_port + i for i in range(size)], **fields)

    def url_of(self, port: int, scheme: str = "http") -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{port}"

    @property
    def router_url(self) -> str:
        return self.url_of(self.router_port)

    @property
    def worker_urls(self) -> list[str]:
        return [self.url_of(p) for p in self.worker_ports]

    @property
    def ws_urls(self) -> list[str]:
        return [self.url_of(p, "ws") for p in self.ws_ports]


# ---------------------------------------------------------------------- checks
def router_installed() -> bool:
    return importlib.util.find_spec("vllm_router") is not None


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as `CUDA_VISIBLE_DEVICES` entries."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [d.strip() for d in listed.split(",") if d.strip()]
        return ids[:count] if count else []
    return [str(i) for i in range(count)]


def gpu_assignment(config: FleetConfig, gpus: Sequence[str]) -> list[str]:
    """The `CUDA_VISIBLE_DEVICES` of each replica; refuses more replicas than GPUs hold."""
    per = config.replicas_per_gpu
    if per < 1:
        raise FleetError(f"--replicas-per-gpu must be >= 1, got {per}")
    if config.size > per * len(gpus):
        have = f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} visible"
        raise FleetError(f"--data-parallel-size {config.size} needs {-(-config.size // per)} "
                         f"GPU(s) at {per} replica(s) per GPU, {have} "
                         "(use --replicas-per-gpu or --device cpu)")
    if per > 1 and per * config.gpu_memory_utilization > 1.0:
        raise FleetError(f"{per} replicas per GPU at --gpu-memory-utilization "
                         f"{config.gpu_memory_utilization} use more than the whole GPU "
                         f"(at most {1.0 / per:.2f} each)")
    return [gpus[i // per] for i in range(config.size)]


def check_ports_free(host: str, ports: dict[int, str]) -> None:
    """Every port can be bound now (a later race is caught when a process fails)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port, what in ports.items():
        if not 0 < port < 65536:
            raise FleetError(f"port {port} ({what}) is out of range")
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                raise FleetError(f"cannot listen on {host}:{port} for {what}: "
                                 f"{exc.strerror or exc}") from None


_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy


async def http_status(url: str, timeout: float = 5.0) -> int | None:
    """The status of `GET url`, or None when nothing answers."""

    def get() -> int | None:
        try:
            with _opener.open(url, timeout=timeout) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except (OSError, ValueError):
            return None

    return await asyncio.to_thread(get)


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port the OS calls free now, other than `avoid`: ports the fleet has chosen but
    not yet bound look free too, and the OS may hand one of them out again."""
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in avoid:
            return port


# ---------------------------------------------------------------------- processes
def _parent_death_signal() -> None:
    """In the child: die with the parent (Linux), so a killed fleet leaves no replica."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_LIVE: set[subprocess.Popen[bytes]] = set()


def _kill_all_live() -> None:
    """atexit: no child outlives the fleet, however it ends."""
    for proc in list(_LIVE):
        _signal_group(proc, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
        _LIVE.discard(proc)


atexit.register(_kill_all_live)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class ManagedProcess:
    """A child in its own process group, logging to a file; stopped group-wide."""

    def __init__(self, name: str, argv: list[str], log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True,
                preexec_fn=_parent_death_signal if sys.platform == "linux" else None)
        _LIVE.add(self.proc)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def kill(self) -> None:
        """SIGKILL the whole group at once (tests: a replica that dies)."""
        if self.proc is not None:
            _signal_group(self.proc, signal.SIGKILL)
            self.proc.wait()
            _LIVE.discard(self.proc)

    def stop(self, timeout: float) -> None:
        """SIGTERM (a replica drains), then SIGKILL after `timeout`."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s: killed", self.name, timeout)
        _signal_group(proc, signal.SIGKILL)  # whatever it started itself goes too
        proc.wait()
        _LIVE.discard(proc)

    def last_words(self, lines: int = 1) -> str:
        """The end of its log: the error line when there is one, else the last line."""
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        errors = [t for t in text if "error" in t.lower()]
        chosen = errors[-lines:] if errors else text[-lines:]
        return " | ".join(t.strip() for t in chosen)


def replica_argv(config: FleetConfig, index: int) -> list[str]:
    return [sys.executable, "-m", "frontends.cli", "--log-level", config.log_level, "serve",
            *config.replica_argv, "--host", config.host,
            "--port", str(config.ws_ports[index]),
            "--openai-port", str(config.worker_ports[index])]


def router_argv(config: FleetConfig, prometheus_port: int) -> list[str]:
    argv = [sys.executable, "-m", "vllm_router.launch_router",
            "--host", config.host, "--port", str(config.router_port),
            "--worker-urls", *config.worker_urls,
            "--policy", config.policy,
            "--health-check-interval-secs", str(config.health_check_interval_s),
            "--worker-startup-check-interval", "1",
            "--prometheus-host", config.host, "--prometheus-port", str(prometheus_port),
            "--log-level", "warning"]
    if config.api_key:
        argv += ["--api-key", config.api_key]
    return argv + list(config.router_args)


# ---------------------------------------------------------------------- the fleet
class Fleet:
    """Starts, supervises and stops the replicas and the router."""

    def __init__(self, config: FleetConfig, *, gpus: Sequence[str] | None = None) -> None:
        self.config = config
        if config.size < 1:
            raise FleetError(f"--data-parallel-size must be >= 1, got {config.size}")
        if len(config.worker_ports) != config.size or len(config.ws_ports) != config.size:
            raise FleetError("every replica needs an OpenAI port and a WebSocket port")
        if config.policy not in ROUTER_POLICIES:
            raise FleetError(f"unknown router policy {config.policy!r} "
                             f"({', '.join(ROUTER_POLICIES)})")
        # Made by the first process started: a fleet refused before that leaves no folder.
        self.log_dir = config.log_dir or (
            Path(tempfile.gettempdir()) / f"asyncengine-fleet-{secrets.token_hex(6)}")
        devices = gpu_assignment(config, visible_gpus() if gpus is None else gpus) \
            if config.device == "cuda" else [None] * config.size
        threads = max(1, (os.cpu_count() or 1) // config.size)
        self.replicas: list[ManagedProcess] = []
        for i, gpu in enumerate(devices):
            env = dict(os.environ)
            if gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpu
            else:  # N CPU processes share the cores instead of each taking all of them
                env.setdefault("OMP_NUM_THREADS", str(threads))
            if config.api_key:
                env["ASYNCENGINE_API_KEY"] = config.api_key  # not on the command line
            where = f"GPU {gpu}" if gpu is not None else "CPU"
            self.replicas.append(ManagedProcess(
                f"replica {i} ({where})", replica_argv(config, i),
                self.log_dir / f"replica-{i}.log", env))
        self.router: ManagedProcess | None = None
        self.stopping = False

    async def start(self) -> None:
        """Replicas up and healthy, then the router ready; raises `FleetError` (with
        everything already started stopped) when any of it fails."""
        cfg = self.config
        if not router_installed():
            raise FleetError("--data-parallel-size needs vllm-router: "
                             "pip install 'asyncengine[router]'")
        ports = {cfg.router_port: "the router"}
        for i, (w, s) in enumerate(zip(cfg.worker_ports, cfg.ws_ports, strict=True)):
            for port, what in ((w, f"replica {i}'s OpenAI API"), (s, f"replica {i}'s WebSocket")):
                if port in ports:
                    raise FleetError(f"port {port} is both {ports[port]} and {what} "
                                     "(change --port, --openai-port or --worker-base-port)")
                ports[port] = what
        prometheus = cfg.router_prometheus_port or free_port(cfg.host, avoid=ports)
        if prometheus in ports:
            raise FleetError(f"port {prometheus} is both {ports[prometheus]} and the "
                             "router's metrics")
        ports[prometheus] = "the router's metrics"
        check_ports_free(cfg.host, ports)
        logger.info("starting %d replicas; logs in %s", cfg.size, self.log_dir)
        try:
            for replica in self.replicas:
                replica.start()
            await asyncio.gather(*(self._until_healthy(r, url) for r, url in
                                   zip(self.replicas, cfg.worker_urls, strict=True)))
            for replica, url in zip(self.replicas, cfg.worker_urls, strict=True):
                logger.info("%s serving on %s", replica.name, url)
            self.router = ManagedProcess("vllm-router", router_argv(cfg, prometheus),
                                         self.log_dir / "router.log")
            self.router.start()
            await self._until_router_ready()
        except BaseException:
            await self.stop()
            raise
        logger.info("vllm-router (%s) in front of %d replicas on %s/v1 (metrics on port %d)",
                    cfg.policy, cfg.size, cfg.router_url, prometheus)

    async def _until_healthy(self, proc: ManagedProcess, url: str) -> None:
        await _until_answers(proc, f"{url}/health", self.config.startup_timeout_s)

    async def _until_router_ready(self) -> None:
        assert self.router is not None
        # The router's /health is 503 while any worker is down: /readiness says it serves.
        await _until_answers(self.router, f"{self.config.router_url}/readiness", 60.0)

    async def supervise(self) -> None:
        """Restart replicas that die; return (raising `FleetError`) if the router dies."""
        while not self.stopping:
            if self.router is not None and not self.router.running:
                raise FleetError(f"vllm-router exited with status {self.router.returncode}: "
                                 f"{self.router.last_words()} (log: {self.router.log_path})")
            for replica in self.replicas:
                if not replica.running and not self.stopping and self.config.restart:
                    replica.restarts += 1
                    logger.warning("%s exited with status %s; restarting it (restart %d); "
                                   "the router sends it work again once it is healthy",
                                   replica.name, replica.returncode, replica.restarts)
                    replica.start()
            await asyncio.sleep(_POLL_S)

    async def stop(self, timeout: float = 30.0) -> None:
        """Router first (no new work), then the replicas drain in parallel."""
        self.stopping = True
        loop = asyncio.get_running_loop()
        if self.router is not None:
            await loop.run_in_executor(None, self.router.stop, 5.0)
        await asyncio.gather(*(loop.run_in_executor(None, r.stop, timeout)
                               for r in self.replicas))


# ---------------------------------------------------------------------- the command
def engine_argv(ns: argparse.Namespace) -> list[str]:
    """The engine flags of `ns` that differ from their defaults, as a command line."""
    hints = typing.get_type_hints(EngineArgs)
    argv: list[str] = []
    for field in dataclasses.fields(EngineArgs):
        value = getattr(ns, field.name)
        if value == field.default:
            continue
        flag = "--" + field.name.replace("_", "-")
        args = [a for a in typing.get_args(hints[field.name]) if a is not type(None)]
        if isinstance(value, bool) and (hints[field.name] is bool or args == [bool]):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def config_from(ns: argparse.Namespace) -> FleetConfig:
    argv = engine_argv(ns)
    for dest, flag in _SERVER_FLAGS:
        if getattr(ns, dest) is not None:
            argv += [flag, str(getattr(ns, dest))]
    if ns.log_prompts:
        argv.append("--log-prompts")
    if ns.allowed_origins is not None:
        argv += ["--allowed-origins", *ns.allowed_origins]
    device = ns.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not ns.openai_port:
        raise FleetError("--data-parallel-size needs --openai-port (the router's port)")
    return FleetConfig.with_base_ports(
        ns.data_parallel_size, argv, router_port=ns.openai_port,
        worker_base_port=ns.worker_base_port, ws_base_port=ns.port,
        device=device, policy=ns.router_policy, host=ns.host,
        replicas_per_gpu=ns.replicas_per_gpu,
        gpu_memory_utilization=ns.gpu_memory_utilization, api_key=ns.api_key,
        health_check_interval_s=ns.router_health_check_interval,
        router_prometheus_port=ns.router_prometheus_port, router_args=list(ns.router_arg),
        log_level=ns.log_level)


async def serve_fleet(ns: argparse.Namespace,
                      run_monitor: Callable[..., Any] | None = None) -> None:
    """The `serve --data-parallel-size N` command: until SIGINT/SIGTERM, or the router
    dies. With `run_monitor`, the dashboard shows the replicas (quitting it stops all)."""
    from frontends.server import require_key_off_loopback

    try:
        require_key_off_loopback(ns.host, ns.api_key)
    except ValueError as exc:
        raise FleetError(str(exc)) from None
    fleet = Fleet(config_from(ns))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await fleet.start()
        tasks = [asyncio.create_task(fleet.supervise()), asyncio.create_task(stop.wait())]
        if run_monitor is not None:
            tasks.append(asyncio.create_task(_dashboard(run_monitor, fleet, ns.api_key)))
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()  # the router's death raises here
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
        await fleet.stop(ns.drain_timeout)
        logger.info("fleet stopped")


async def _dashboard(run_monitor: Callable[..., Any], fleet: Fleet, api_key: str | None
                     ) -> None:
    """The fleet dashboard, owning the terminal: log lines go to Textual's log meanwhile."""
    from frontends.cli import _logs_to_textual

    with _logs_to_textual():
        await run_monitor(fleet.config.ws_urls, api_key)


async def _until_answers(proc: ManagedProcess, url: str, timeout_s: float) -> None:
    """Wait until `url` answers 200, or raise a `FleetError` naming `proc` and its log if it
    exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not proc.running:
            raise FleetError(f"{proc.name} exited with status {proc.returncode} while "
                             f"starting: {proc.last_words()} (log: {proc.log_path})")
        if await http_status(url) == 200:
            return
        if time.monotonic() > deadline:
            raise FleetError(f"{proc.name} did not answer {url} within {timeout_s:.0f} s "
                             f"(log: {proc.log_path})")
        await asyncio.sleep(_POLL_S)
