"""The architecture's import rules, checked on the source: the library never imports gradio, methods
never import the engine (they use the services the prefill context offers)."""

from __future__ import annotations

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parent.parent / "visualkv"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_methods_never_import_the_engine():
    for path in (LIBRARY / "methods").glob("*.py"):
        assert not any(name == "visualkv.engine" or name.startswith("visualkv.engine.") for name in _imports(path)), (
            path
        )


def test_the_library_never_imports_gradio():
    for path in LIBRARY.rglob("*.py"):
        assert not any(name.split(".")[0] == "gradio" for name in _imports(path)), path
