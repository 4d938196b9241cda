"""The environment accessors: defaults, overrides, and a clear error for a malformed value."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from asyncengine_kernels import envs


def test_defaults_when_unset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("CACHE", "TP_TIMEOUT_S", "LOG_LEVEL", "API_KEY", "RELIABILITY_REPORT"):
        monkeypatch.delenv(envs.PREFIX + name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert envs.cache_dir() == tmp_path / "asyncengine"
    assert envs.tp_timeout_s() == 600.0
    assert envs.log_level() == "INFO"
    assert envs.api_key() is None
    assert envs.reliability_report() is None


def test_overrides_are_read_at_call_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("ASYNCENGINE_TP_TIMEOUT_S", "12.5")
    monkeypatch.setenv("ASYNCENGINE_API_KEY", "secret")
    monkeypatch.setenv("ASYNCENGINE_FUZZ_SEED", "7")
    assert envs.cache_dir() == tmp_path / "c"
    assert envs.tp_timeout_s() == 12.5
    assert envs.api_key() == "secret"
    assert envs.fuzz_seed() == 7


def test_empty_value_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCENGINE_API_KEY", "")
    assert envs.api_key() is None


def test_malformed_number_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCENGINE_TP_TIMEOUT_S", "ten")
    with pytest.raises(ValueError, match="ASYNCENGINE_TP_TIMEOUT_S"):
        envs.tp_timeout_s()


def test_integer_variables_take_integers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCENGINE_FUZZ_SEED", "12345678901234567")  # past float's precision
    assert envs.fuzz_seed() == 12345678901234567
    monkeypatch.setenv("ASYNCENGINE_FUZZ_SEED", "1.5")
    with pytest.raises(ValueError, match="ASYNCENGINE_FUZZ_SEED must be an integer"):
        envs.fuzz_seed()


def test_every_variable_is_documented() -> None:
    table = (Path(__file__).resolve().parents[2] / "docs" / "environment.md").read_text()
    source = Path(envs.__file__).read_text()
    names = set(re.findall(r'_(?:get|float|flag)\("([A-Z_]+)"', source))
    assert names, "no variables found in envs.py"
    for name in names:
        assert f"`{envs.PREFIX}{name}`" in table, name


def test_flags_take_one_or_zero_and_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCENGINE_TUNE_ALL_KINDS", raising=False)
    assert envs.tune_all_kinds() is False
    for raw, want in [("1", True), ("true", True), ("0", False), ("off", False)]:
        monkeypatch.setenv("ASYNCENGINE_TUNE_ALL_KINDS", raw)
        assert envs.tune_all_kinds() is want
    monkeypatch.setenv("ASYNCENGINE_TUNE_ALL_KINDS", "all")
    with pytest.raises(ValueError, match="ASYNCENGINE_TUNE_ALL_KINDS"):
        envs.tune_all_kinds()


def test_c_compiler_follows_cc(monkeypatch: pytest.MonkeyPatch) -> None:
    """`$CC` is the build convention's name (no prefix); empty or unset means none chosen."""
    monkeypatch.setenv("CC", "clang")
    assert envs.c_compiler() == "clang"
    monkeypatch.setenv("CC", "")
    assert envs.c_compiler() is None
    monkeypatch.delenv("CC")
    assert envs.c_compiler() is None
    table = (Path(__file__).resolve().parents[2] / "docs" / "environment.md").read_text()
    assert "| `CC` |" in table


def test_no_pdl_is_off_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCENGINE_NO_PDL", raising=False)
    assert envs.no_pdl() is False
    monkeypatch.setenv("ASYNCENGINE_NO_PDL", "1")
    assert envs.no_pdl() is True
