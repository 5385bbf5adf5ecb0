"""The library installs as a package (`pip install -e .`, or a wheel): its metadata and contents."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[1]


def _requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def test_pyproject_dependencies_are_requirements_txt():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["app"]
    assert sorted(declared) == sorted(_requirement_lines(ROOT / "requirements.txt"))
    assert not any(line.startswith("gradio") for line in project["dependencies"])  # the library never imports it


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="setuptools absent: no wheel to build")
def test_the_wheel_holds_the_library_and_its_command(tmp_path):
    source = tmp_path / "src"  # a copy: a build writes build/ and *.egg-info beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "visualkv", source / "visualkv", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["-w", str(tmp_path / "dist"), str(source)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("visualkv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "visualkv").rglob("*.py")}
    assert modules <= names, sorted(modules - names)  # every module of the library, subpackages too
    assert not {n for n in names if n.startswith(("ui/", "tests/", "scripts/", "assets/", "app.py"))}
    info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "visualkv = visualkv.cli.main:main" in zipfile.ZipFile(wheel).read(info).decode()
