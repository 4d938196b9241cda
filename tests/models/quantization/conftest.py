"""Fixtures: one tiny Llama (GQA, llama3 rope) and its quantized copies per format."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.quant_writers import Scheme, write_quantized
from tests.tiny_models import build_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("quant-src") / "llama3", "llama3")


@pytest.fixture(scope="session")
def quantized(
    tiny_src: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[Scheme], tuple[Path, Path]]:
    """scheme -> (quantized dir, dequantized HF oracle dir), written once per session."""
    made: dict[Scheme, tuple[Path, Path]] = {}
    root = tmp_path_factory.mktemp("quant")

    def make(scheme: Scheme) -> tuple[Path, Path]:
        if scheme not in made:
            dst = root / (scheme.name + (f"-{scheme.mistake}" if scheme.mistake else ""))
            made[scheme] = (dst, write_quantized(tiny_src, dst, scheme))
        return made[scheme]

    return make
