"""The `asyncengine` command: flags from EngineArgs, and one error line (no traceback) for
a bad flag, model path, config or engine argument."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from frontends.cli import build_parser, engine_args_from, main

ROOT = Path(__file__).resolve().parents[2]


def test_cli_engine_flags_follow_engine_args() -> None:
    ns = build_parser().parse_args([
        "serve", "--model", "m", "--device", "cpu", "--max-model-len", "128",
        "--num-kv-blocks", "7", "--no-enable-prefix-caching", "--enforce-eager",
        "--preemption-mode", "swap", "--max-num-batched-tokens", "64", "--port", "0",
        "--kv-cache-dtype", "fp8",
    ])
    args = engine_args_from(ns)
    assert (args.model, args.device, args.max_model_len, args.num_kv_blocks) == ("m", "cpu", 128, 7)
    assert not args.enable_prefix_caching and args.enforce_eager
    assert args.preemption_mode == "swap" and args.max_num_batched_tokens == 64
    assert args.kv_cache_dtype == "fp8"
    assert args.calculate_kv_scales is None
    assert engine_args_from(build_parser().parse_args(["serve"])).kv_cache_dtype == "auto"
    for flag, value in (("--calculate-kv-scales", True), ("--no-calculate-kv-scales", False)):
        parsed = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8", flag])
        assert engine_args_from(parsed).calculate_kv_scales is value
    assert ns.host == "127.0.0.1" and ns.port == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "float8"])


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "asyncengine: error:" in line]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def bad_config_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{")
    return tmp_path


@pytest.mark.parametrize(("argv", "status", "words"), [
    (["generate", "hi", "--model", "/no/such/dir"], 1, "model path does not exist: /no/such/dir"),
    (["serve", "--model", "/no/such/dir", "--port", "0"], 1, "model path does not exist"),
    (["generate", "hi", "--model", "BAD_CONFIG"], 2, "config.json is not valid JSON"),
    (["serve", "--model", "BAD_CONFIG", "--port", "0"], 2, "config.json is not valid JSON"),
    (["generate", "hi", "--block-size", "3"], 2, "block_size must be a power of two, got 3"),
    (["serve", "--host", "0.0.0.0", "--port", "0"], 2, "refusing to bind non-loopback host"),
    (["chat", "--url", "ws://127.0.0.1:1"], 1, "cannot talk to the server at ws://127.0.0.1:1"),
])
def test_failures_print_one_line(argv: list[str], status: int, words: str, bad_config_dir: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(bad_config_dir) if a == "BAD_CONFIG" else a for a in argv]
    assert main(argv) == status
    line = one_error_line(capsys)
    assert line.startswith("asyncengine: error: ") and words in line


@pytest.mark.parametrize(("argv", "words"), [
    (["generate", "hi", "--block-size", "x"], "argument --block-size: invalid int value: 'x'"),
    (["serve", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["serve", "--kv-cache-dtype", "int8"], "argument --kv-cache-dtype: invalid choice: 'int8'"),
    (["--log-level", "loud", "generate", "hi"], "unknown log level 'loud'"),
    (["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_flags_print_one_line(argv: list[str], words: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    line = one_error_line(capsys)
    assert words in line and "--help" in line
    assert capsys.readouterr().out == ""


def test_debug_log_level_shows_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--log-level", "DEBUG", "generate", "hi", "--model", "/no/such/dir"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().endswith(
        "asyncengine: error: model path does not exist: /no/such/dir")


def test_a_subprocess_run_exits_non_zero_with_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "frontends.cli", "serve", "--model", "/no/such/dir"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("asyncengine:")]
    assert errors == ["asyncengine: error: model path does not exist: /no/such/dir"]
    assert "Traceback" not in proc.stderr


def test_serve_logs_stats_unless_disabled() -> None:
    assert not build_parser().parse_args(["serve"]).disable_log_stats
    assert build_parser().parse_args(["serve", "--disable-log-stats"]).disable_log_stats


async def test_log_stats_every_asks_the_engine_for_snapshots() -> None:
    import asyncio

    from asyncengine.stat_loggers import LoggingStatLogger
    from frontends.cli import log_stats_every

    class Engine:
        def __init__(self) -> None:
            self.loggers: list[object] = []
            self.asks = 0

        def add_stat_logger(self, stat_logger: object) -> None:
            self.loggers.append(stat_logger)

        def stats(self) -> None:
            self.asks += 1

    engine = Engine()
    task = asyncio.create_task(log_stats_every(engine, 0.01))
    await asyncio.sleep(0.1)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(engine.loggers) == 1 and isinstance(engine.loggers[0], LoggingStatLogger)
    assert engine.asks >= 3
