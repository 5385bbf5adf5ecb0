"""The memory guard's estimate against the memory a run really took (scripts/guard_check.py)."""

from __future__ import annotations

from pathlib import Path

from visualkv.bench.tables.format import MIB, load, render
from visualkv.bench.tables.measured import MEDIA, METHODS, PREFILL, SESSION, paths


def guard_estimate_against_measured(results: Path) -> str:
    """The bench model and its methods on a 4K image."""
    return _guard_rows(results, "memory_guard_cpu.json")


def guard_estimate_per_family(results: Path) -> str:
    """The same on every family's tiny model and every method, where a small tower makes the pixel copies show."""
    return _guard_rows(results, "memory_guard_families_cpu.json")


def guard_estimate_on_video(results: Path) -> str:
    """The same on a video (assets/example_video.mp4, the file it was measured on), the bench model and every family's tiny model."""
    return _guard_rows(results, "memory_guard_video_cpu.json")


def _guard_rows(results: Path, name: str) -> str:
    d = load(name, results)
    models = len({r["model"] for r in d["results"]}) > 1
    body = []
    for r in d["results"]:
        e, m = r["estimate"], r["measured"]
        ahead = f" (vision ahead {r['vision_ahead']})" if r.get("vision_ahead", 1) > 1 else ""
        body.append(
            [
                *([r["model"]] if models else []),
                f"`{r['method']}`{ahead}",
                f"{e['kv_bytes'] / MIB:.1f} / {e['kv_allocated_bytes'] / MIB:.1f} / {e['peak_bytes'] / MIB:.1f} MiB",
                " / ".join(f"{m[k] / MIB:.1f}" for k in ("peak_kv_bytes", "peak_allocated_bytes", "rss_growth_bytes"))
                + " MiB",
                f"{r['whole_ratio']:.2f}",
            ]
        )
    header = [
        *(["model"] if models else []),
        "method",
        "estimate: KV held / allocated / whole",
        "measured: `peak_kv_bytes` / `peak_allocated_bytes` / RSS growth",
        "whole: estimate / measured",
    ]
    return render(header, body, [(name, d)])


TABLES = {
    "memory-guard": guard_estimate_against_measured,
    "memory-guard-families": guard_estimate_per_family,
    "memory-guard-video": guard_estimate_on_video,
}
GUARD_CODE = paths(PREFILL, SESSION, METHODS, MEDIA)
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "memory-guard": GUARD_CODE,
    "memory-guard-families": GUARD_CODE,
    "memory-guard-video": GUARD_CODE,
}
