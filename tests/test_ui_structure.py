"""The app's code stays readable: no function in ui/ or app.py runs longer than a screen."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80


def _app_files() -> list[Path]:
    return [REPO / "app.py", *sorted((REPO / "ui").glob("*.py"))]


def _long_functions(path: Path) -> list[str]:
    """'file:line name (n lines)' for each function or method in `path` longer than the limit."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_the_app_files_are_found():
    names = {path.name for path in _app_files()}
    assert {"app.py", "layout.py", "chat.py", "compare.py", "views.py"} <= names, names


def test_no_function_in_the_app_is_longer_than_a_screen():
    too_long = [entry for path in _app_files() for entry in _long_functions(path)]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"
