"""The baselines side by side at one kept share of the visual tokens: each method configured for a fraction f
keeps f on a tiny model, `bench memory --kept-share` records it per run, and the tables that compare the methods
read the committed JSON's figures (written out here by hand)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import get_adapter
from tests.test_bench import _assert_provenance
from tests.test_cli import _run
from visualkv.bench.needle import kept_share_options, method_points
from visualkv.bench.synthetic import video_media
from visualkv.runtime.session import ChatSession, SessionConfig


def _session(method: str, fraction: float, media, budget: int | None = None) -> ChatSession:
    config = SessionConfig(
        method=method, budget=budget, max_new_tokens=1, method_options=kept_share_options(method, fraction)
    )
    session = ChatSession(get_adapter("tiny-qwen2.5-vl"), config)
    session.ask("What happens in the video?", media)
    return session


@pytest.mark.parametrize("method", ["evs", "visionzip"])
def test_an_entry_stage_set_to_a_share_keeps_that_share_of_a_video(method):
    """EVS (pruning rate 1 - f) and VisionZip (f split dominant / contextual) hold f of the video's tokens in every
    layer: 8 frames of 224x168 (4 temporal patches), where f = 0.5 is above EVS's first-frame floor."""
    session = _session(method, 0.5, video_media(8, 224, 168, fps=1.0, seed=2))
    per_layer = session.retained_per_layer()  # (layers, n_visual) keep fraction over the heads
    assert np.allclose(per_layer.mean(axis=1), 0.5, atol=0.01), per_layer.mean(axis=1)


def test_fastv_set_to_a_share_keeps_it_from_layer_k_and_everything_below():
    session = _session("fastv", 0.25, video_media(8, 224, 168, fps=1.0, seed=2))
    held = session.retained_per_layer().mean(axis=1)  # per layer
    k = session.method.pruning_layer(len(held))
    assert np.all(held[:k] == 1.0) and np.allclose(held[k:], 0.25, atol=0.01), held


def test_every_method_gets_one_point_per_fraction_but_full_and_lightkv():
    points = method_points(["full", "evs", "fastv", "visionzip", "streamingllm", "lightkv"], [0.1, 0.25])
    assert [(m, f) for m, f, _ in points] == [
        ("full", 1.0),
        ("evs", 0.1),
        ("evs", 0.25),
        ("fastv", 0.1),
        ("fastv", 0.25),
        ("visionzip", 0.1),
        ("visionzip", 0.25),
        ("streamingllm", 0.1),
        ("streamingllm", 0.25),
        ("lightkv", None),
    ]
    options = {(m, f): o for m, f, o in points}
    assert options[("evs", 0.25)] == {"pruning_rate": 0.75}
    assert options[("fastv", 0.1)] == {"ratio": 0.9}
    assert options[("visionzip", 0.25)] == pytest.approx({"dominant": 0.25 * 54 / 64, "contextual": 0.25 * 10 / 64})
    assert options[("streamingllm", 0.1)] == {}  # a budget method: M = f x the visual tokens instead


def test_memory_bench_at_one_kept_share(tmp_path, capsys):
    """`--kept-share` gives a budget method M = f x the input's visual tokens and an entry stage its options;
    EVS is not run on a still image; the JSON is named for the share."""
    code, _, err = _run(
        capsys,
        "bench",
        "memory",
        "--sizes",
        "0.4",
        "--methods",
        "full,evs,visionzip,streamingllm",
        "--kept-share",
        "0.25",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    data = json.loads((tmp_path / "memory_image_tiny-qwen2.5-vl_kept0.25.json").read_text())
    _assert_provenance(data, "--kept-share 0.25")
    assert data["kept_share"] == 0.25 and data["budget"] is None
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"full", "visionzip", "streamingllm"}
    n = rows["full"]["visual_tokens"]
    assert rows["streamingllm"]["budget"] == round(0.25 * n) and rows["visionzip"]["budget"] is None
    assert rows["visionzip"]["method_options"] == pytest.approx(
        {"dominant": 0.25 * 54 / 64, "contextual": 0.25 * 10 / 64}
    )
    for method in ("visionzip", "streamingllm"):
        assert rows[method]["kept_fraction"] == pytest.approx(0.25, abs=0.02)
        assert rows[method]["final_kv_bytes"] < rows["full"]["final_kv_bytes"] / 2
    assert rows["full"]["kept_fraction"] == 1.0


def test_kept_share_must_be_a_fraction(tmp_path, capsys):
    from tests.test_cli import _assert_one_line_error

    code, _, err = _run(capsys, "bench", "memory", "--kept-share", "0", "--out", str(tmp_path))
    _assert_one_line_error(code, err, "--kept-share", "(0, 1]")


def _needle_row(method: str, fraction, video: bool, seed: int, correct: bool, kept: float, kib: int, ttft: float):
    return {
        "method": method,
        "budget_fraction": fraction,
        "video": video,
        "seed": seed,
        "correct": correct,
        "kept_fraction": kept,
        "evidence_recall": kept,
        "peak_kv_bytes": 2 * kib * 1024,
        "final_kv_bytes": kib * 1024,
        "ttft_seconds": ttft,
    }


def test_the_side_by_side_tables_read_each_method_on_the_same_cases(tmp_path):
    """Hand-written needle rows: one image and two videos; EVS on the videos only."""
    from visualkv.bench.tables import baselines, evidence

    rows = [
        _needle_row("full", 1.0, False, 0, True, 1.0, 100, 2.0),
        _needle_row("full", 1.0, True, 0, True, 1.0, 300, 4.0),
        _needle_row("full", 1.0, True, 1, True, 1.0, 500, 6.0),
        _needle_row("salicache", 0.1, True, 0, True, 0.2, 30, 1.0),
        _needle_row("salicache", 0.1, True, 1, False, 0.2, 50, 2.0),
        _needle_row("evs", 0.1, True, 0, False, 0.1, 40, 3.0),
        _needle_row("evs", 0.1, True, 1, False, 0.14, 60, 3.0),
        _needle_row("visionzip", 0.1, False, 0, True, 0.1, 10, 1.5),
        _needle_row("visionzip", 0.1, True, 0, True, 0.1, 20, 0.5),
        _needle_row("visionzip", 0.1, True, 1, True, 0.1, 40, 0.5),
        _needle_row("lightkv", None, False, 0, True, 0.7, 70, 1.0),
        _needle_row("lightkv", None, True, 0, True, 0.7, 200, 2.0),
        _needle_row("lightkv", None, True, 1, False, 0.7, 400, 2.0),
        _needle_row("fastv", 0.1, False, 0, False, 0.33, 30, 1.0),
    ]
    per_method = [
        {"method": "fastv", "budget_fraction": 0.1, "n": 1, "mean_recall": 0.2, "accuracy": 0.0, "kept_fraction": 0.33},
        {"method": "evs", "budget_fraction": 0.1, "n": 2, "mean_recall": 0.12, "accuracy": 0.0, "kept_fraction": 0.12},
    ]
    data = {
        "model": "visualkv-demo",
        "fractions": [0.1],
        "video_only": ["evs"],
        "per_method": per_method,
        "rows": rows,
        "provenance": {"command": "python scripts/evidence_needle.py --images 1 --videos 2", "cpu_cores": 2},
    }
    (tmp_path / "evidence_needle.json").write_text(json.dumps(data))

    sali = baselines.salicache_beside_evs_and_visionzip(tmp_path)
    assert "| all | `full` | 1.00 | 100% (2) | 800 KiB | 400 KiB | 5.00 s |" in sali
    assert "| 10% | `salicache` | 0.20 | 50% (2) | 80 KiB | 40 KiB | 1.50 s |" in sali
    assert "| 10% | `evs` | 0.12 | 0% (2) | 100 KiB | 50 KiB | 3.00 s |" in sali
    assert "| 10% | `visionzip` | 0.10 | 100% (2) | 60 KiB | 30 KiB | 0.50 s |" in sali
    assert "images" not in sali.split("\n\n")[0]  # Sali-Cache's table: the videos alone
    assert (
        "On the videos, `salicache` against `evs`, accuracy 50% to 0%, KV after the answer 0.80× and TTFT 0.50× "
        "`evs`'s; against `visionzip`, accuracy 50% to 100%, KV after the answer 1.33× and TTFT 3.00× `visionzip`'s"
    ) in sali

    light = baselines.lightkv_beside_evs_and_visionzip(tmp_path)
    assert "| one setting | `lightkv` | 0.70 | 100% (1) | 140 KiB | 70 KiB | 1.00 s | 0.70 | 50% (2) | 600 KiB" in light
    assert "| 10% | `evs` | — | — | — | — | — | 0.12 | 0% (2) |" in light
    # one setting: against the others' largest budget; on the images EVS has no row
    assert "On the images, `lightkv` against `visionzip`, accuracy 100% to 100%, KV after the answer 7.00×" in light
    assert "On the videos, `lightkv` against `evs`, accuracy 50% to 0%, KV after the answer 6.00×" in light
    assert "1 held-out images and 2 held-out videos" in light and "`evs` runs on the videos only" in light

    methods = evidence.recall_and_accuracy_by_method(tmp_path)
    assert "| `fastv` (all tokens below layer K) | 0.20 / 0% |" in methods
    assert "| `evs` (videos only) | 0.12 / 0% |" in methods
    assert "over all layers: 0.33 at 10%." in methods and "`evs`: the 2 videos only" in methods


def test_the_kept_share_memory_table_shows_each_methods_gain_over_full(tmp_path):
    from visualkv.bench.tables import memory

    def row(method: str, size: float, peak_mib: float, final_mib: float, kept: float) -> dict:
        return {
            "method": method,
            "size": size,
            "visual_tokens": 1000 * int(size),
            "kept_fraction": kept,
            "peak_kv_bytes": peak_mib * 2**20,
            "final_kv_bytes": final_mib * 2**20,
            "ttft_seconds": 1.25,
        }

    prov = {"command": "python -m visualkv bench memory --kept-share 0.1 --video", "cpu_cores": 2}
    video = {
        "model": "tiny-qwen2.5-vl",
        "video": True,
        "kept_share": 0.1,
        "rows": [row("full", 8, 1, 1, 1.0), row("full", 32, 4, 4, 1.0), row("fastv", 32, 2, 1, 0.3)],
        "provenance": prov,
    }
    (tmp_path / "memory_video_tiny-qwen2.5-vl_kept0.1.json").write_text(json.dumps(video))
    table = memory.kv_memory_at_equal_kept_share(tmp_path)
    line = "| video, 32 frames (32,000 visual tokens) | `fastv` (all tokens below layer K) | 0.30 | 2.00 MiB | 1.00 MiB"
    assert line + " | 2.00× | 4.00× | 1.25 s |" in table
    assert "keep 10% of the visual tokens" in table and "8 frames" not in table  # the largest input only
