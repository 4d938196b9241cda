"""The quantized layers' tuned matmul choices, kept on disk between starts.

Timing every kind that reads a quantized layout at every row count of the ladder compiles and
times some forty kernels per layer shape: on an H200 that adds one to two minutes to each
start of a 7B model. A start on the same GPU, with the same software, kernels and layer
shapes, reads the choices back instead. The key holds everything a choice depends on:
- the GPU's name and compute capability, and the torch and Triton versions;
- a digest of the kernel sources (`asyncengine_kernels/*.py`, `models/quantization/*.py`), so any
change
  to a kernel tunes again;
- the layer group (shape, format, group size, dtype, bias, input transform), the row ladder
  and the candidate kinds at each row count.

A different value of any of them is another entry. The tuner still checks the chosen kinds
against the reference before planning them, and times anew where one disagrees. An entry
is one small JSON file under `asyncengine_kernels.envs.cache_dir() / "matmul_plans"`: deleting the
folder makes the next start tune again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from asyncengine_kernels import envs

logger = logging.getLogger(__name__)

_SOURCE_PACKAGES = ("asyncengine_kernels", "models.quantization")


@functools.cache
def source_digest() -> str:
    """SHA-256 over the kernel and quantization sources: the code a timing measured."""
    digest = hashlib.sha256()
    for package in _SOURCE_PACKAGES:
        folder = Path(importlib.import_module(package).__file__ or "").parent
        for path in sorted(folder.glob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def device_identity(device: torch.device) -> list[str]:
    """The hardware and software a timing on `device` holds for."""
    parts = [device.type, torch.__version__]
    if device.type == "cuda":
        import triton

        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        parts += [torch.cuda.get_device_name(index), f"sm_{major}{minor}", triton.__version__]
    return parts


def plan_key(parts: Sequence[object]) -> str:
    """A file-name-safe key from the parts a choice depends on (each by its `str`)."""
    text = json.dumps([str(p) for p in parts])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class PlanCache:
    """Chosen kinds (by `MatmulKind.describe()`, one per ladder row count) per key, as JSON
    files in `root`. Unreadable or malformed entries read as missing; a folder that cannot
    be written costs only the saving (one warning)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def default(cls) -> PlanCache:
        return cls(envs.cache_dir() / "matmul_plans")

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def load(self, key: str) -> list[str] | None:
        try:
            data = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        kinds = data.get("kinds") if isinstance(data, dict) else None
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            return None
        return kinds

    def store(self, key: str, kinds: Sequence[str], about: str = "") -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            # Written whole, then renamed: a concurrent start never reads half an entry.
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"about": about, "kinds": list(kinds)}, f, indent=1)
            os.replace(tmp, self._path(key))
        except OSError as exc:
            logger.warning("matmul plan not saved to %s: %s", self.root, exc)
