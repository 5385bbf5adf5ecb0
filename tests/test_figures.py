"""README and docs tables are generated from the committed JSON (`python -m visualkv bench report`)."""

from __future__ import annotations

import json
import shutil

from visualkv.bench import figures
from visualkv.bench.provenance import finish, machine_label, start


def test_readme_and_docs_tables_match_the_committed_json():
    stale = figures.check_documents()
    assert not stale, f"out of date (run `python -m visualkv bench report`): {stale}"


def test_readme_shows_the_headline_and_results_holds_every_table():
    readme = figures.blocks_in((figures.ROOT / "README.md").read_text())
    assert readme == ["headline"]  # one generated table on the front door; the rest lives in docs/
    results = set(figures.blocks_in((figures.ROOT / "docs" / "RESULTS.md").read_text()))
    assert {
        "gpu",
        "memory-image",
        "latency-image",
        "fidelity",
        "memory-video",
        "salicache",
        "lightkv",
        "needle",
        "memory-guard",
        "memory-guard-families",
        "memory-guard-video",
        "block-attention",
        "followup-attention",
        "long-video",
        "load",
    } <= results


def test_every_table_is_in_a_document_and_every_document_is_listed():
    """A table function no document shows is dead code; a docs page outside DOCUMENTS is never checked."""
    shown = {name for doc in figures.DOCUMENTS for name in figures.blocks_in(_read(doc))}
    assert set(figures.TABLES) - shown == set()
    pages = {f"docs/{p.name}" for p in (figures.ROOT / "docs").glob("*.md")}
    assert pages <= set(figures.DOCUMENTS)


def _read(doc: str) -> str:
    path = figures.ROOT / doc
    return path.read_text() if path.exists() else ""


def test_readme_is_a_front_door():
    lines = (figures.ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= figures.README_MAX_LINES, f"README.md has {len(lines)} lines: move detail to docs/"


def test_no_tracker_numbers_in_the_documents_prose():
    assert figures.issue_references() == []


def test_a_tracker_number_in_prose_is_found_but_not_inside_a_generated_block(tmp_path):
    (tmp_path / "docs").mkdir()
    readme = "# x\n\nFaster since issue 11 landed.\n\n<!-- figures:load -->\n| issue 11 |\n<!-- /figures:load -->\n"
    (tmp_path / "README.md").write_text(readme)
    assert figures.issue_references(root=tmp_path) == ["README.md:3: Faster since issue 11 landed."]
    (tmp_path / "README.md").write_text(readme.replace("since issue 11 landed", "with a device cache"))
    assert figures.issue_references(root=tmp_path) == []


def test_a_changed_json_value_makes_the_check_fail(tmp_path):
    """The check compares figures, not just markers: edit one number in a copy of the results."""
    results = tmp_path / "results"
    shutil.copytree(figures.RESULTS, results)
    path = results / "memory_image_bench-qwen2.5-vl.json"
    data = json.loads(path.read_text())
    data["summary"]["blockwise-snapkv"]["full_over_peak_kv_largest"] = 3.0
    path.write_text(json.dumps(data))
    assert "docs/RESULTS.md: memory-image" in figures.check_documents(results=results)


def test_a_hand_edited_table_makes_the_check_fail(tmp_path):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    text = (figures.ROOT / "docs" / "RESULTS.md").read_text()
    edited = text.replace(
        "| **full / block-wise, final KV at 4K** | 9.99×", "| **full / block-wise, final KV at 4K** | 12×"
    )
    assert edited != text
    (root / "docs" / "RESULTS.md").write_text(edited)
    assert figures.check_documents(root=root) == ["docs/RESULTS.md: memory-image"]


def test_every_table_names_its_json_command_machine_and_commit_where_recorded():
    for name, build in figures.TABLES.items():
        table = build(figures.RESULTS)
        if name in figures.COMPUTED:
            assert "Source: computed from `" in table and "(not measured)" in table, name
            continue
        assert "Source: [`" in table and "`python " in table, name
        assert "command not recorded" not in table and "machine not recorded" not in table, name
    assert "commit `54679a1`)" in figures.table_headline(figures.RESULTS)  # the GPU run's provenance names it


def test_computed_schedule_table_follows_the_code(monkeypatch):
    """The LightKV schedule table is the code's schedule: change the paper schedule and the table changes."""
    from visualkv.methods import lightkv

    before = figures.table_lightkv_schedule(figures.RESULTS)
    assert "| Qwen2.5-VL-7B (28) | 11, 16, 21 | 6, 4, 2 | 0.589 |" in before
    schedules = dict(lightkv.PAPER_SCHEDULES)
    schedules["qwen2_5_vl"] = lightkv.PaperSchedule(28, (10, 17, 22), (6, 4, 2), (0.5, 0.5, 0.5))
    monkeypatch.setattr(lightkv, "PAPER_SCHEDULES", schedules)
    assert "| Qwen2.5-VL-7B (28) | 9, 16, 21 | 6, 4, 2 |" in figures.table_lightkv_schedule(figures.RESULTS)


def test_provenance_says_idle_or_loaded_from_the_load_average():
    prov = start(["bench", "latency"])
    assert prov["command"] == "python -m visualkv bench latency"
    busy = finish({**prov, "cpu_cores": 2, "load_start": 3.4})
    assert busy["condition"] == "loaded" and machine_label(busy).startswith("2 CPU cores, loaded")
    quiet = finish({**prov, "cpu_cores": 64, "load_start": 1.0})
    assert quiet["condition"] in ("idle", "loaded")  # load_end is this machine's, read now


def test_provenance_commit_says_when_the_tree_differs_from_it(tmp_path):
    import subprocess

    from visualkv.bench.provenance import _git_commit

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "r.json").write_text("{}\n")
    git("add", "a.py", "docs/results/r.json")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    clean = _git_commit(str(tmp_path))
    assert clean and "+" not in clean
    (results / "r.json").write_text('{"rows": []}\n')  # a result an earlier bench of the same run rewrote
    assert _git_commit(str(tmp_path)) == clean
    (tmp_path / "a.py").write_text("x = 2\n")  # the code measured is no longer that commit
    assert _git_commit(str(tmp_path)) == clean + "+changes"
    assert _git_commit(str(tmp_path / "nowhere")) is None
