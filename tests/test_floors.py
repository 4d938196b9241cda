"""The packages stand on floors and import only downward: frontends → asyncengine → models →
kernels. Every import in every module counts, those inside functions and under
`TYPE_CHECKING` too: a lower floor that needs a setting or a shape gets it as an argument or
from a module on its own floor or below."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"asyncengine_kernels": 0, "models": 1, "asyncengine": 2, "frontends": 3}


def _modules() -> list[Path]:
    return sorted(p for pkg in FLOORS for p in (ROOT / pkg).rglob("*.py"))


def _imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in the module, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = path.relative_to(ROOT).parts[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                top = base[0] if base else (node.module or "").split(".")[0]
            else:
                top = (node.module or "").split(".")[0]
            found.append((node.lineno, top))
    return found


def upward_imports() -> list[str]:
    bad = []
    for path in _modules():
        floor = FLOORS[path.relative_to(ROOT).parts[0]]
        for line, top in _imported_packages(path):
            if FLOORS.get(top, -1) > floor:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {top}")
    return bad


def test_every_package_is_walked() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _modules()}
    assert {"asyncengine_kernels/envs.py", "models/loader.py", "asyncengine/llm_engine.py",
            "frontends/cli.py"} <= names  # fmt: skip


def test_floors_import_only_downward() -> None:
    assert upward_imports() == []


@pytest.mark.parametrize(
    ("source", "floor", "expected"),
    [
        ("from models.forward_context import AttentionMetadata", "asyncengine_kernels", ["models"]),
        ("import asyncengine.envs", "models", ["asyncengine"]),
        ("def f():\n    from frontends import cli", "asyncengine", ["frontends"]),
        ("if TYPE_CHECKING:\n    from asyncengine.config import EngineArgs", "models",
         ["asyncengine"]),
        ("from . import layers", "models", []),
        ("from asyncengine_kernels import rms_norm", "frontends", []),
    ],
)  # fmt: skip
def test_the_walk_sees_each_kind_of_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, floor: str, expected: list[str]
) -> None:
    module = tmp_path / floor / "probe.py"
    module.parent.mkdir()
    module.write_text(source + "\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    got = [top for _, top in _imported_packages(module) if FLOORS.get(top, -1) > FLOORS[floor]]
    assert got == expected


ENV_READ = re.compile(r"""(environ\.get\(|environ\[|getenv\()\s*f?["']ASYNCENGINE_""")


def test_only_the_envs_module_reads_asyncengine_variables() -> None:
    """One configuration surface: an `ASYNCENGINE_*` variable is read in
    `asyncengine_kernels/envs.py` alone (which builds the names from its prefix)."""
    assert ENV_READ.search('os.environ.get("ASYNCENGINE_HOPPER_PREFILL", "1")')
    readers = [p.relative_to(ROOT).as_posix() for p in _modules()
               if ENV_READ.search(p.read_text())]  # fmt: skip
    assert readers == []
