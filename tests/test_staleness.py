"""A generated table measured before the last change to the code it measures says so, naming both commits
(`visualkv.bench.staleness`); a table measured at or after that change carries no such note."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from visualkv.bench import figures
from visualkv.bench.staleness import NOTE_PREFIX, History

if shutil.which("git") is None:
    pytest.skip("needs git", allow_module_level=True)
BLOCK = re.compile(r"<!-- figures:([\w-]+) -->\n(.*?)<!-- /figures:\1 -->", re.DOTALL)


def git(root, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=root,
        capture_output=True,
        text=True,
        check=check,
    )


def _measured_commits(block: str) -> tuple[list[str], int]:
    """(the commits the block's source line names, how many of its files name none)."""
    source = next(p for p in reversed(block.strip().split("\n\n")) if p.startswith("Source: "))
    commits = re.findall(r"commit `([0-9a-f]{7,40})`", source)
    return commits, source.count("[`") - len(commits)


def _expected_stale(paths: tuple[str, ...], block: str) -> tuple[bool, str, list[str]]:
    """From git itself: (stale?, the newest commit touching `paths`, the measured commits that predate it)."""
    last = git(figures.ROOT, "log", "-1", "--format=%H", "--", *paths).stdout.strip()
    commits, unrecorded = _measured_commits(block)
    older = [c for c in commits if git(figures.ROOT, "merge-base", "--is-ancestor", last, c, check=False).returncode]
    return bool(older or unrecorded), last, older


def test_each_table_measured_before_its_code_changed_says_so_and_no_other_does():
    shallow = git(figures.ROOT, "rev-parse", "--is-shallow-repository", check=False)
    if shallow.returncode or shallow.stdout.strip() != "false":
        pytest.skip("needs git and the full history (in a shallow clone: git fetch --unshallow)")
    for doc in figures.DOCUMENTS:
        for name, block in BLOCK.findall((figures.ROOT / doc).read_text()):
            paths, where = figures.MEASURES[name]
            has_note = block.startswith(NOTE_PREFIX)
            if not paths:
                assert not has_note, f"{doc}: {name} measures no code but carries a staleness note"
                continue
            stale, last, older = _expected_stale(paths, block)
            assert has_note == stale, f"{doc}: {name}: stale={stale} but note={has_note} (run bench report)"
            if stale:
                note = block.split("\n\n")[0]
                assert f"`{last[:7]}`" in note and where in note, f"{doc}: {name}: {note}"
                assert all(f"`{c[:7]}`" in note for c in older), f"{doc}: {name}: {note}"


def test_every_table_declares_the_code_it_measures():
    assert set(figures.MEASURES) == set(figures.TABLES)
    unmeasured = {name for name, (paths, _) in figures.MEASURES.items() if not paths}
    assert unmeasured == figures.COMPUTED | {"demo-training"}  # computed from the code, or the demo weights' log
    missing = {p for paths, _ in figures.MEASURES.values() for p in paths if not (figures.ROOT / p).exists()}
    assert not missing


@pytest.fixture
def repo(tmp_path):
    """A checkout whose README shows the `load` table, measured at its first commit (the code `app.py`)."""
    root = tmp_path / "repo"
    results = root / "docs" / "results"
    results.mkdir(parents=True)
    (root / "app.py").write_text("first = 1\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-qm", "code")
    measured = git(root, "rev-parse", "HEAD").stdout.strip()
    data = json.loads((figures.RESULTS / "load_8_sessions.json").read_text())
    data["provenance"] = {"command": "python -m pytest tests/test_load.py", "commit": measured[:7], "dirty": False}
    (results / "load_8_sessions.json").write_text(json.dumps(data))
    (root / "README.md").write_text("# x\n\n<!-- figures:load -->\n<!-- /figures:load -->\n")
    figures.write_documents(root=root, results=results)
    git(root, "add", ".")
    git(root, "commit", "-qm", "results")
    return root, measured


def _readme(root) -> str:
    return (root / "README.md").read_text()


def test_a_change_to_the_measured_code_after_the_run_brings_the_note_and_the_check_asks_for_it(repo):
    root, measured = repo
    results = root / "docs" / "results"
    assert NOTE_PREFIX not in _readme(root)  # measured at the code's last change: no note
    assert figures.check_documents(root=root, results=results) == []
    fresh = _readme(root)
    (root / "app.py").write_text("first = 2\n")
    git(root, "commit", "-qam", "change the code")
    changed = git(root, "rev-parse", "HEAD").stdout.strip()
    assert figures.check_documents(root=root, results=results) == ["README.md: load"]
    figures.write_documents(root=root, results=results)
    note = _readme(root).split("<!-- figures:load -->\n")[1].split("\n\n")[0]
    assert note.startswith(NOTE_PREFIX) and f"`{measured[:7]}`" in note and f"`{changed[:7]}`" in note
    assert figures.check_documents(root=root, results=results) == []
    (root / "README.md").write_text(fresh)  # the note removed by hand
    assert figures.check_documents(root=root, results=results) == ["README.md: load"]


def test_a_note_on_a_table_measured_at_its_code_fails_the_check(repo):
    root, _ = repo
    readme = _readme(root).replace("<!-- figures:load -->\n", f"<!-- figures:load -->\n{NOTE_PREFIX} Old.\n\n")
    (root / "README.md").write_text(readme)
    assert figures.check_documents(root=root, results=root / "docs" / "results") == ["README.md: load"]


def test_a_run_at_a_commit_outside_the_history_or_unrecorded_is_noted(repo):
    root, _ = repo
    results = root / "docs" / "results"
    path = results / "load_8_sessions.json"
    data = json.loads(path.read_text())
    data["provenance"]["commit"] = "abcdef0"
    path.write_text(json.dumps(data))
    figures.write_documents(root=root, results=results)
    assert "at commit `abcdef0` (not in this checkout's history)" in _readme(root)
    del data["provenance"]["commit"]
    path.write_text(json.dumps(data))
    figures.write_documents(root=root, results=results)
    assert "at a commit not recorded (1 of 1 files)" in _readme(root)


def test_a_shallow_clone_keeps_the_notes_it_carries_unchecked(repo, tmp_path):
    root, _ = repo
    (root / "app.py").write_text("first = 2\n")
    git(root, "commit", "-qam", "change the code")
    figures.write_documents(root=root, results=root / "docs" / "results")
    git(root, "commit", "-qam", "notes")
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{root}", str(shallow))
    assert History.read(shallow) is None
    results = shallow / "docs" / "results"
    assert figures.check_documents(root=shallow, results=results) == []
    figures.write_documents(root=shallow, results=results)
    assert _readme(shallow) == _readme(root) and NOTE_PREFIX in _readme(shallow)
    shutil.rmtree(shallow / ".git")  # no checkout at all: the same
    assert History.read(shallow) is None
    assert figures.check_documents(root=shallow, results=results) == []
