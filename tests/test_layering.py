"""The architecture's import rules, checked on the source (docs/ARCHITECTURE.md draws them).

Each part of the library sits on a level; a module imports only from its own part or from parts on lower
levels, so the arrows point down: ui -> cli -> bench -> runtime -> methods -> kv / attention -> models ->
media -> report -> the foundation modules. Imports inside functions count too. The library never imports
gradio, and nothing in it imports the app's `ui` package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LIBRARY = REPO / "visualkv"

#: each part of the library and its level (higher may import lower; equal levels may import each other)
LEVELS = {
    "errors": 0,
    "devices": 0,
    "layout": 0,
    "scoring": 0,
    "report": 1,
    "media": 2,
    "models": 3,
    "kv": 4,
    "attention": 4,
    "methods": 5,
    "runtime": 6,
    "bench": 7,
    "eval": 7,
    "cli": 8,
}
TOP = 9  # visualkv/__init__.py and __main__.py: the public names and the entry point


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function. `from visualkv import X` names the part X
    when X is one, else the package's public names (`visualkv`, the top level)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "visualkv":
                names.add(node.module)
                continue
            for alias in node.names:
                names.add(f"visualkv.{alias.name}" if alias.name in LEVELS else "visualkv")
    return names


def _relative_imports(path: Path) -> list[int]:
    """Line numbers of relative imports (`from . import x`), which the level check could not place."""
    tree = ast.parse(path.read_text())
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0]


def level_of_module(module: str) -> int | None:
    """The level of a dotted module name ("visualkv.kv.cache" -> kv's; "visualkv" -> the top); None outside."""
    pieces = module.split(".")
    if pieces[0] != "visualkv":
        return None
    if len(pieces) == 1 or pieces[1] in ("__init__", "__main__"):
        return TOP
    return LEVELS.get(pieces[1])


def level_of(path: Path) -> int:
    relative = path.relative_to(LIBRARY)
    name = relative.parts[0].removesuffix(".py")
    return TOP if name in ("__init__", "__main__") else LEVELS[name]


def upward_imports(path: Path, own: int | None = None) -> list[str]:
    """The imports in `path` that point to a higher level of the library (`own`: the file's level, by default
    read from where it lies in visualkv/)."""
    own = level_of(path) if own is None else own
    return sorted(m for m in _imports(path) if (level := level_of_module(m)) is not None and level > own)


LIBRARY_FILES = sorted(LIBRARY.rglob("*.py"))


def test_every_library_module_has_a_level():
    parts = {p.relative_to(LIBRARY).parts[0].removesuffix(".py") for p in LIBRARY_FILES}
    unplaced = parts - set(LEVELS) - {"__init__", "__main__"}
    assert not unplaced, f"parts of visualkv/ with no level in LEVELS: {sorted(unplaced)}"


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=lambda p: str(p.relative_to(LIBRARY)))
def test_imports_point_down(path):
    assert upward_imports(path) == [], f"{path.relative_to(REPO)} imports from a higher level"


def test_the_rule_catches_an_upward_import(tmp_path):
    """The check itself can fail: a kv module importing the runtime, the methods (inside a function) or the
    package's public names is upward; importing models or errors is not."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from visualkv.runtime.engine import Engine\nfrom visualkv import ChatSession, errors\n"
        "from visualkv.models.base import ModelAdapter\n\ndef f():\n    import visualkv.methods\n"
    )
    assert upward_imports(probe, own=LEVELS["kv"]) == ["visualkv", "visualkv.methods", "visualkv.runtime.engine"]
    assert upward_imports(probe, own=TOP) == []


def test_the_library_has_no_relative_imports():
    relative = {str(p.relative_to(LIBRARY)): lines for p in LIBRARY_FILES if (lines := _relative_imports(p))}
    assert relative == {}


def test_methods_never_import_the_runtime():
    for path in (LIBRARY / "methods").rglob("*.py"):
        assert not any(name.startswith("visualkv.runtime") for name in _imports(path)), path


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=lambda p: str(p.relative_to(LIBRARY)))
def test_the_library_never_imports_gradio_or_the_app(path):
    assert not any(name.split(".")[0] in ("gradio", "ui") for name in _imports(path)), path
