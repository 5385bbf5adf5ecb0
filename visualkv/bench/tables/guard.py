"""The memory guard's estimate against the memory a run really took (scripts/guard_check.py)."""

from __future__ import annotations

from pathlib import Path

from visualkv.bench.tables.format import MIB, load, render
from visualkv.bench.tables.measured import MEDIA, METHODS, PREFILL, SESSION, paths

FAMILIES_IMAGE = "memory_guard_families_cpu.json"  # every family's tiny model × every method, the 4K image
FAMILIES_VIDEO = "memory_guard_video_cpu.json"  # the same on assets/example_video.webm


def guard_estimate_against_measured(results: Path) -> str:
    """The bench model and its methods on a 4K image."""
    return _guard_rows(results, "memory_guard_cpu.json")


#: the two-sided range the guard's whole estimate holds against the measured RSS growth
GUARD_RANGE = (0.9, 1.35)


def guard_estimate_per_family(results: Path) -> str:
    """Every family's tiny model and every method, on the 4K image and on a video: the whole estimate over the
    measured RSS growth (the bytes of each run are in the JSON)."""
    runs = {"image": load(FAMILIES_IMAGE, results), "video": load(FAMILIES_VIDEO, results)}
    ratio, models, methods = {}, {}, {}
    for media, data in runs.items():
        for r in data["results"]:
            models[r["model"]] = methods[r["method"]] = None
            ratio[(r["model"], r["method"], media)] = r.get("whole_ratio")
    body = [[f"`{method}`", *(_cell(ratio, model, method) for model in models)] for method in methods]
    values = [v for v in ratio.values() if v is not None]
    low, high = GUARD_RANGE
    out: dict[tuple[str, str], list] = {}  # (method, media) -> (model, ratio) of its runs outside the range
    for (model, method, media), v in ratio.items():
        if v is None or not low <= v <= high:
            out.setdefault((method, media), []).append((model, v))
    outside = [
        f"`{method}` ({media}) on {', '.join(m for m, _ in runs_out)}: {_span([v for _, v in runs_out])}"
        for (method, media), runs_out in out.items()
    ]
    note = (
        f"{len(values)} runs ({len(models)} models × {len(methods)} methods × image and video): estimate / measured "
        f"from {min(values):.2f} to {max(values):.2f}; outside {low}-{high} or failed: "
        + ("; ".join(outside) if outside else "none")
        + "."
    )
    header = ["method (image / video)", *models]
    remeasured = [
        f"{u['runs']} runs of `{name}` measured again at commit `{u['commit']}`: `{u['command']}`."
        for name, media in ((FAMILIES_IMAGE, "image"), (FAMILIES_VIDEO, "video"))
        for u in runs[media].get("updates", [])
    ]
    return render(header, body, [(FAMILIES_IMAGE, runs["image"]), (FAMILIES_VIDEO, runs["video"])], note, *remeasured)


def _span(values: list) -> str:
    done = [v for v in values if v is not None]
    failed = f"{len(values) - len(done)} failed" if len(done) < len(values) else ""
    shown = f"{min(done):.3f}" if len(done) == 1 else f"{min(done):.3f}-{max(done):.3f}" if done else ""
    return ", ".join(part for part in (shown, failed) if part)


def _cell(ratio: dict, model: str, method: str) -> str:
    pair = [ratio.get((model, method, media), "absent") for media in ("image", "video")]
    return " / ".join("failed" if v is None else v if isinstance(v, str) else f"{v:.2f}" for v in pair)


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
}
GUARD_CODE = paths(PREFILL, SESSION, METHODS, MEDIA)
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "memory-guard": GUARD_CODE,
    "memory-guard-families": GUARD_CODE,
}
