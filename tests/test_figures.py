"""README and docs tables are generated from the committed JSON (`python -m visualkv bench report`)."""

from __future__ import annotations

import json
import shutil

from visualkv.bench import figures
from visualkv.bench.provenance import finish, machine_label, start
from visualkv.bench.tables import gpu as gpu_tables
from visualkv.bench.tables import lightkv as lightkv_tables
from visualkv.bench.tables.format import source_line


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


def test_the_zerogpu_section_shows_the_slice_fit_and_each_examples_duration():
    assert {"zerogpu-fit", "zerogpu-durations"} <= set(figures.blocks_in(_read("docs/APP.md")))


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
    assert "commit `54679a1`)" in gpu_tables.headline_memory_and_speed(
        figures.RESULTS
    )  # the GPU run's provenance names it


def test_computed_schedule_table_follows_the_code(monkeypatch):
    """The LightKV schedule table is the code's schedule: change the paper schedule and the table changes."""
    from visualkv.methods import lightkv

    before = lightkv_tables.lightkv_default_schedule(figures.RESULTS)
    assert "| Qwen2.5-VL-7B (28) | 11, 16, 21 | 6, 4, 2 | 0.589 |" in before
    schedules = dict(lightkv.PAPER_SCHEDULES)
    schedules["qwen2_5_vl"] = lightkv.PaperSchedule(28, (10, 17, 22), (6, 4, 2), (0.5, 0.5, 0.5))
    monkeypatch.setattr(lightkv, "PAPER_SCHEDULES", schedules)
    assert "| Qwen2.5-VL-7B (28) | 9, 16, 21 | 6, 4, 2 |" in lightkv_tables.lightkv_default_schedule(figures.RESULTS)


def test_provenance_says_idle_or_loaded_from_the_load_average(monkeypatch):
    """Idle while both readings stay at or below cores + 0.5; the end reading alone can make a run loaded."""
    from visualkv.bench import provenance

    prov = start(["bench", "latency"])
    assert prov["command"] == "python -m visualkv bench latency"
    monkeypatch.setattr(provenance, "_loadavg", lambda: 1.0)  # the end-of-run reading, fixed
    busy = finish({**prov, "cpu_cores": 2, "load_start": 3.4})
    assert busy["condition"] == "loaded" and machine_label(busy).startswith("2 CPU cores, loaded")
    quiet = finish({**prov, "cpu_cores": 2, "load_start": 2.5})  # exactly at the bound: still idle
    assert quiet["condition"] == "idle" and machine_label(quiet).startswith("2 CPU cores, idle")
    monkeypatch.setattr(provenance, "_loadavg", lambda: 2.6)  # a competitor arrived during the run
    assert finish({**prov, "cpu_cores": 2, "load_start": 0.5})["condition"] == "loaded"
    monkeypatch.setattr(provenance, "_loadavg", lambda: None)  # no reading at either end
    assert finish({**prov, "cpu_cores": 2, "load_start": None})["condition"] == "unknown"


def test_provenance_names_the_commit_and_hashes_the_diff_of_a_dirty_tree(tmp_path):
    import hashlib
    import subprocess

    from visualkv.bench.provenance import git_state

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "r.json").write_text("{}\n")
    git("add", "a.py", "docs/results/r.json")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    sha = git("rev-parse", "HEAD").strip()
    clean = git_state(str(tmp_path))
    assert clean == {"commit": sha[:7], "commit_sha": sha, "dirty": False, "diff_sha256": None}
    (results / "r.json").write_text('{"rows": []}\n')  # a result an earlier bench of the same run rewrote
    assert git_state(str(tmp_path)) == clean
    (tmp_path / "a.py").write_text("x = 2\n")  # the code measured is no longer that commit
    dirty = git_state(str(tmp_path))
    diff = git("diff", "HEAD", "--", "a.py")
    assert dirty["dirty"] is True and dirty["commit"] == sha[:7] + "+changes" and dirty["commit_sha"] == sha
    assert dirty["diff_sha256"] == hashlib.sha256(diff.encode()).hexdigest()
    assert git_state(str(tmp_path / "nowhere"))["commit_sha"] is None


def test_a_source_line_says_when_the_figures_came_from_a_dirty_tree():
    clean = {"provenance": {"command": "python -m visualkv bench x", "commit": "abc1234", "dirty": False}}
    assert source_line(("x.json", clean)).endswith("commit `abc1234`).")
    dirty = {"provenance": {**clean["provenance"], "commit": "abc1234+changes", "dirty": True}}
    dirty["provenance"]["diff_sha256"] = "0123456789abcdef" * 4
    line = source_line(("x.json", dirty))
    assert "commit `abc1234` from a dirty tree (diff sha256 `0123456789ab`)" in line
    legacy = {"provenance": {"command": "python -m visualkv bench x", "commit": "abc1234+changes"}}  # no `dirty` field
    assert "commit `abc1234` from a dirty tree)" in source_line(("x.json", legacy))


# -- the GPU tables, on the committed one-run file and on a file in the repeats format --


def test_headline_on_the_one_run_file_states_speed_against_full_only():
    table = gpu_tables.headline_memory_and_speed(figures.RESULTS)
    assert "| time to first token, s (vs full) | decode tok/s (vs full) |" in table
    assert "vs better generate" not in table and "(7.0×)" not in table  # no speed ratio against that generate
    lines = {line.split(" | ")[1]: line for line in table.splitlines() if line.startswith("| 4K image")}
    assert "| 2,462 MiB (1.000×) | — (not a fair speed reference: below) |" in lines["`transformers-generate`"]
    # full's image row: 1.11 s, 68 tok/s; block-wise KeyDiff 2.48 s and 105.7 tok/s in the committed JSON
    assert "| 337 MiB (0.137×) | 2.48 (2.24×) | 106 (1.55×) |" in lines["`blockwise-keydiff`"]
    assert "was not warmed on the measured shapes nor run with a pinned attention backend" in table


def _committed(kind: str, method: str, key: str) -> float:
    """A figure of the committed one-run GPU file."""
    d = json.loads((figures.RESULTS / gpu_tables.GPU_RESULTS).read_text())
    return next(r[key] for r in d["cases"] if r["input"] == kind and r.get("case", r["method"]) == method)


def _repeats_format_file(tmp_path):
    """The committed GPU file rewritten in the repeats format: each figure 5 % either side of its old value, a
    `generate-static` row per input at half generate's TTFT and 7x its decode rate, the fair-reference config."""
    from visualkv.bench import gpu
    from visualkv.bench.device_peaks import device_peak
    from visualkv.bench.limits import ModelWork

    d = json.loads((figures.RESULTS / gpu_tables.GPU_RESULTS).read_text())
    rows = []
    for row in d["cases"]:
        row = {k: v for k, v in row.items() if not k.startswith("vs_")}
        if row["method"] == "transformers-generate":
            static = {**row, "method": "generate-static", "ttft_seconds": row["ttft_seconds"] / 2}
            static["decode_tokens_per_second"] = row["decode_tokens_per_second"] * 7
            rows += [{**row, "method": "generate"}, static]
        else:
            rows.append(row)
    for row in rows:
        for key in ("ttft_seconds", "decode_tokens_per_second", "peak_over_weights_bytes"):
            if row.get(key) is not None:
                v = row[key]
                row[key] = {"median": v, "min": 0.95 * v, "max": 1.05 * v, "n": 3}
    work = ModelWork(630_000_000, 45_000_000, 6_500_000_000, 545_000_000, 28, 28, 128, 4, 14_000_000_000)
    for label in dict.fromkeys(gpu.input_label(r) for r in rows):
        same = [r for r in rows if gpu.input_label(r) == label]
        gpu._add_ratios(same)
        gpu._add_limits(same, work, device_peak("NVIDIA H200"))
    d["cases"] = rows
    d["config"].update(repeats=3, sdpa_backends=list(gpu.PINNED_SDPA_BACKENDS), ttft=gpu.TTFT_DEFINITION)
    d["work"], d["device_peaks"] = (
        {"decode_bytes_per_token": work.decode_bytes_per_token},
        {
            "bf16_flops_per_second": 989.5e12,
            "memory_bytes_per_second": 4.8e12,
            "source": "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)",
        },
    )
    (tmp_path / "gpu").mkdir()
    (tmp_path / gpu_tables.GPU_RESULTS).write_text(json.dumps(d))
    return tmp_path


def test_headline_in_the_repeats_format_shows_ranges_and_both_references(tmp_path):
    table = gpu_tables.headline_memory_and_speed(_repeats_format_file(tmp_path))
    assert "| time to first token, s (vs full; vs better generate) |" in table
    lines = {line.split(" | ")[1]: line for line in table.splitlines() if line.startswith("| 4K image")}
    ttft = _committed("image", "blockwise-keydiff", "ttft_seconds")  # 2.48 s
    # over full's 1.11 s; over generate-static's 2.10 / 2 = 1.05 s
    assert f"| {ttft:.2f} ({0.95 * ttft:.2f}–{1.05 * ttft:.2f}) (2.24×; 2.36×) |" in lines["`blockwise-keydiff`"]
    # decode 105.7 tok/s: over full's 68.0 and over generate-static's 9.78 x 7 = 68.5 tok/s
    assert "| 106 (100–111) (1.55×; 1.54×) |" in lines["`blockwise-keydiff`"]
    assert "`generate-static`" in table and "`transformers-generate`" not in table
    assert "then 3 times: median (min–max)" in table and "FLASH_ATTENTION, EFFICIENT_ATTENTION, MATH" in table


def test_gpu_table_in_the_repeats_format_has_ratios_ranges_and_limits(tmp_path):
    table = gpu_tables.gpu_methods_and_targets(_repeats_format_file(tmp_path))
    header = table.splitlines()[0]
    assert "TTFT / decode vs full" in header and "TTFT / decode vs better generate" in header
    assert "share of limits: TTFT / decode" in header
    keydiff = next(
        line for line in table.splitlines() if line.startswith("| image") and "| blockwise-keydiff |" in line
    )
    ttft = _committed("image", "blockwise-keydiff", "ttft_seconds")
    assert f"| {ttft:.2f} ({0.95 * ttft:.2f}–{1.05 * ttft:.2f}) |" in keydiff
    assert "| 2.24× / 1.55× | 2.36× / 1.54× |" in keydiff
    # decode ceiling 4.8e12 / 14e9 = 342.9 tok/s: 105.7 tok/s is 31 % of it
    assert keydiff.endswith("/ 31% |")
    assert "Share of limits: TTFT against the FLOPs" in table and "13.04 GiB of weights read per token" in table
    assert "No fair reference" not in table and "no fair reference" not in table
    # decode over full's: 1.55x by the medians, 0.95 / 1.05 of that for the worst repeats: 1.41x, still met
    assert "| decode tok/s ≥ full's | image | blockwise-keydiff | 1.55× | 1.41× | ≥ 1.00× | met |" in table


def test_gpu_table_on_the_one_run_file_judges_no_speed_against_generate():
    table = gpu_tables.gpu_methods_and_targets(figures.RESULTS)
    assert "TTFT / decode vs better generate" not in table.splitlines()[0]
    assert "no fair reference" in table and "No fair reference" in table
    assert "| 2.24× / 1.55× |" in table  # block-wise KeyDiff's image row against full's
