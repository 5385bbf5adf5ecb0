"""Style gates CI runs with the tests: `ruff check` and `ruff format --check` over the project."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff(args):
    out = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]
