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
    "cli": 8,
}
TOP = 9  # visualkv/__init__.py and __main__.py: the public names and the entry point


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "visualkv":  # `from visualkv import media`: the part named
                names.update(f"visualkv.{alias.name}" for alias in node.names)
    return names


def part_of(module: str) -> str | None:
    """The library part a dotted module name belongs to ("visualkv.kv.cache" -> "kv"); None outside it."""
    pieces = module.split(".")
    if pieces[0] != "visualkv" or len(pieces) < 2:
        return None
    return pieces[1]


def level_of(path: Path) -> int:
    relative = path.relative_to(LIBRARY)
    name = relative.parts[0].removesuffix(".py")
    return TOP if name in ("__init__", "__main__") else LEVELS[name]


def upward_imports(path: Path) -> list[str]:
    """The imports in `path` that point to a higher level of the library."""
    own = level_of(path)
    bad = []
    for module in sorted(_imports(path)):
        part = part_of(module)
        if part is not None and part in LEVELS and LEVELS[part] > own:
            bad.append(module)
    return bad


LIBRARY_FILES = sorted(LIBRARY.rglob("*.py"))


def test_every_library_module_has_a_level():
    parts = {p.relative_to(LIBRARY).parts[0].removesuffix(".py") for p in LIBRARY_FILES}
    unplaced = parts - set(LEVELS) - {"__init__", "__main__"}
    assert not unplaced, f"parts of visualkv/ with no level in LEVELS: {sorted(unplaced)}"


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=lambda p: str(p.relative_to(LIBRARY)))
def test_imports_point_down(path):
    assert upward_imports(path) == [], f"{path.relative_to(REPO)} imports from a higher level"


def test_the_rule_catches_an_upward_import(tmp_path):
    """The check itself can fail: a kv module importing the runtime is upward."""
    fake = LIBRARY / "kv" / "cache.py"
    source = "from visualkv.runtime.engine import Engine\nimport visualkv.methods\n"
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    assert _imports(probe) == {"visualkv.runtime.engine", "visualkv.methods"}
    assert LEVELS[part_of("visualkv.runtime.engine")] > level_of(fake)


def test_methods_never_import_the_runtime():
    for path in (LIBRARY / "methods").rglob("*.py"):
        assert not any(part_of(name) == "runtime" for name in _imports(path)), path


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=lambda p: str(p.relative_to(LIBRARY)))
def test_the_library_never_imports_gradio_or_the_app(path):
    assert not any(name.split(".")[0] in ("gradio", "ui") for name in _imports(path)), path
