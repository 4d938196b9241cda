"""Every environment variable asyncengine reads, in one place.

Performance choices are not environment variables: they are `EngineArgs` fields (which reach
tensor-parallel workers and are logged) or decided in code. What remains here is where things
live, how long to wait (start-up tuning included), how loud to be, and the secret that should
not sit in a shell history.
Each accessor reads the environment when called, so a test's `monkeypatch.setenv` takes effect.
docs/environment.md lists them for users; keep the two in step.
"""

from __future__ import annotations

import os
from pathlib import Path

PREFIX = "ASYNCENGINE_"


def _get(name: str) -> str | None:
    value = os.environ.get(PREFIX + name)
    return value if value not in (None, "") else None


def _number(name: str, default: float, kind: type[float] | type[int], what: str) -> float:
    raw = _get(name)
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"${PREFIX}{name} must be {what}, got {raw!r}") from None


def _float(name: str, default: float) -> float:
    return _number(name, default, float, "a number")


def _int(name: str, default: int) -> int:
    return int(_number(name, default, int, "an integer"))


def _flag(name: str) -> bool:
    raw = _get(name)
    if raw is None:
        return False
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"${PREFIX}{name} must be 1 or 0 (true or false), got {raw!r}")


def cache_dir() -> Path:
    """Where converted models (the embedded GGUF, GGUF checkpoints), the CPU path's
    compiled C kernels and the quantized layers' tuned matmul plans are cached."""
    root = _get("CACHE")
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        root = os.path.join(base, "asyncengine")
    return Path(root)


def c_compiler() -> str | None:
    """The C compiler named by `$CC` (the build convention, no prefix), if set: the CPU
    path's C kernels build with it, else with gcc or cc from PATH."""
    return os.environ.get("CC") or None


def tp_timeout_s() -> float:
    """Limit on one tensor-parallel collective and on the rendezvous, in seconds."""
    return _float("TP_TIMEOUT_S", 600.0)


def tune_all_kinds() -> bool:
    """Whether the start-up tuner of quantized layers times every kind and launch config it
    knows rather than the few its rule table names per format and row range: for a GPU the
    rules were not measured on (`models.quantization.kinds`, docs/quantization.md)."""
    return _flag("TUNE_ALL_KINDS")


def log_level() -> str:
    """The CLI's default logging level (`--log-level` overrides it)."""
    return _get("LOG_LEVEL") or "INFO"


def api_key() -> str | None:
    """The key the server requires and the client sends, when no flag or argument gives one."""
    return _get("API_KEY")


# Test knobs: read by the reliability suite only.


def test_timeout_factor() -> float:
    """Seconds per unit of the reliability tests' timeouts (raise it on slow machines)."""
    return _float("TEST_TIMEOUT_FACTOR", 1.0)


def fuzz_seed() -> int:
    """Seed of the protocol fuzzer, so a failing run can be replayed."""
    return _int("FUZZ_SEED", 20250601)


def reliability_report() -> Path | None:
    """File the reliability suite merges its measured figures into, if set."""
    path = _get("RELIABILITY_REPORT")
    return Path(path) if path else None


def no_pdl() -> bool:
    """Whether kernels launch without programmatic dependent launch, for profiles only: with
    it a kernel starts while its predecessor drains, so a profiler's per-kernel times overlap
    and their sum exceeds the step's. Read at each launch and baked into CUDA graphs when
    they are captured, so it must be set before the engine starts."""
    return _flag("NO_PDL")
