"""Building, caching and the fallbacks of the CPU C kernels (asyncengine_kernels/cpu_native.py)."""

from __future__ import annotations

import ctypes
import logging
import shutil
from pathlib import Path

import pytest

import asyncengine_kernels.cpu_native as cpu_native

SOURCE = "int answer(int x) { return 2 * x + 1; }\n"
needs_cc = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    return tmp_path


def _build(name: str, source: str) -> ctypes.CDLL | None:
    return cpu_native.native_library.__wrapped__(name, source)  # past the per-process cache


@needs_cc
def test_builds_once_and_reuses_the_cached_library(cache: Path) -> None:
    lib = _build("probe", SOURCE)
    assert lib is not None and lib.answer(20) == 41
    built = list((cache / "native").glob("probe_*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert _build("probe", SOURCE) is not None
    assert built[0].stat().st_mtime_ns == mtime  # loaded, not compiled again
    assert _build("probe", SOURCE + "\n") is not None  # another source: another file
    assert len(list((cache / "native").glob("probe_*.so"))) == 2


def test_without_a_compiler_returns_none(
    cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_native, "_compiler", lambda: None)
    with caplog.at_level(logging.INFO, logger="asyncengine_kernels.cpu_native"):
        assert _build("probe", SOURCE) is None
    assert "no C compiler" in caplog.text
    assert not (cache / "native").exists()


@needs_cc
def test_a_failing_build_returns_none_with_the_compiler_message(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="asyncengine_kernels.cpu_native"):
        assert _build("broken", "this is not C;\n") is None
    assert "build or load failed" in caplog.text
    assert not list((cache / "native").glob("broken_*.so"))


def test_compiler_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cc = shutil.which("sh")
    assert cc is not None
    monkeypatch.setenv("CC", cc)
    assert cpu_native._compiler() == cc
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert cpu_native._compiler() == (shutil.which("gcc") or shutil.which("cc"))
