"""Held-out needle accuracy of the demo model (`bench needle`): each method and budget on images of each size,
single questions and follow-ups, and on a video."""

from __future__ import annotations

from pathlib import Path

from visualkv.bench.tables.format import load, render
from visualkv.bench.tables.measured import DECODE, METHODS, PREFILL, SESSION, paths

NEEDLE_RESULTS = ("needle_small/needle.json", "needle_4k30/needle.json")
#: (column, method, budget fraction) of `needle_accuracy`
NEEDLE_COLUMNS = (
    ("full", "full", None),
    ("block-wise SnapKV 10 %", "blockwise-snapkv", 0.1),
    ("block-wise KeyDiff 10 %", "blockwise-keydiff", 0.1),
    ("post-SnapKV 10 %", "post-snapkv", 0.1),
    ("Sali-Cache 25 % of FP bytes", "salicache", 0.25),
    ("LightKV", "lightkv", None),
)


def _needle_acc(results: list[dict], method: str, size: str, setting: str, fraction: float | None) -> dict | None:
    for r in results:
        if (
            r["method"] == method
            and r["size"] == size
            and r["setting"] == setting
            and (fraction is None or abs(r["budget_fraction"] - fraction) < 1e-9)
            and not r.get("question")
        ):
            return r
    return None


def _needle_all(results: Path) -> tuple[list[dict], list[tuple[str, dict]]]:
    data = [(n, load(n, results)) for n in NEEDLE_RESULTS]
    return [r for _, d in data for r in d["results"]], data


def _pct(r: dict | None) -> str:
    return f"{r['accuracy'] * 100:.0f} %" if r else ""


def _image_sizes(rows: list[dict]) -> list[str]:
    return sorted({r["size"] for r in rows if not r["size"].startswith("video")}, key=lambda s: int(s.split("x")[0]))


def _setting_label(setting: str) -> str:
    return "follow-up" if setting == "followup" else setting


def _accuracy_cell(res: list[dict], method: str, size: str, setting: str, fraction: float | None) -> str:
    """One cell of `needle_accuracy`: the accuracy, with the entries kept for the methods that keep another share."""
    r = _needle_acc(res, method, size, setting, fraction)
    if r is None and method == "salicache":  # 4K runs: one budget only
        r = _needle_acc(res, method, size, setting, 0.1)
        return f"{r['accuracy'] * 100:.0f} % (at 10 %; entries kept {r['kept_fraction']:.2f})" if r else "—"
    if r is None:
        return "—"
    if method in ("salicache", "lightkv"):
        return f"{r['accuracy'] * 100:.0f} % (entries kept {r['kept_fraction']:.2f})"
    return f"{r['accuracy'] * 100:.0f} %"


def needle_accuracy(results: Path) -> str:
    """Each method at one budget, per image size and setting."""
    names = list(NEEDLE_RESULTS)
    data = [load(n, results) for n in names]
    rows = []
    for d in data:
        res = d["results"]
        for size in _image_sizes(res):
            for setting in ("single", "followup"):
                cells = [_accuracy_cell(res, method, size, setting, fraction) for _, method, fraction in NEEDLE_COLUMNS]
                n = (_needle_acc(res, "full", size, setting, None) or {}).get("n", "?")
                label = (
                    f"{size.replace('x', '×')} {'single question' if setting == 'single' else 'follow-up'} (n = {n})"
                )
                rows.append([label, *cells])
    return render(["held-out accuracy", *(c[0] for c in NEEDLE_COLUMNS)], rows, list(zip(names, data)))


def needle_accuracy_by_eviction_budget(results: Path) -> str:
    """The eviction methods at 5, 10 and 25 % of the visual tokens."""
    rows, data = _needle_all(results)
    cols = [("full", "full", None)] + [
        (f"{label} {f * 100:g} %", m, f)
        for label, m in (
            ("SnapKV", "blockwise-snapkv"),
            ("KeyDiff", "blockwise-keydiff"),
            ("post-SnapKV", "post-snapkv"),
        )
        for f in (0.05, 0.1, 0.25)
    ]
    body = []
    for size in _image_sizes(rows):
        for setting in ("single", "followup"):
            n = (_needle_acc(rows, "full", size, setting, None) or {}).get("n", "?")
            body.append(
                [
                    f"{size} (n = {n})",
                    _setting_label(setting),
                    *(_pct(_needle_acc(rows, m, size, setting, f)) for _, m, f in cols),
                ]
            )
    return render(["size", "setting", *(c[0] for c in cols)], body, data)


def needle_video_accuracy(results: Path) -> str:
    """Each method and budget on the needle videos, per question."""
    rows, data = _needle_all(results)
    video = [r for r in rows if r["size"].startswith("video")]
    if not video:
        return "No video rows in the committed JSON."
    size = video[0]["size"]

    def cell(method: str, question: str) -> str:
        found = sorted(
            (r for r in video if r["method"] == method and r.get("question") == question),
            key=lambda r: r["budget_fraction"],
        )
        return " / ".join(_pct(r) for r in found)

    methods = [
        ("full", "full"),
        ("SnapKV 5 / 10 / 25 %", "blockwise-snapkv"),
        ("KeyDiff 5 / 10 / 25 %", "blockwise-keydiff"),
        ("post-SnapKV 5 / 10 / 25 %", "post-snapkv"),
        ("Sali-Cache 5 / 10 / 25 %", "salicache"),
        ("LightKV", "lightkv"),
    ]
    n = video[0]["n"]
    body = [[q, *(cell(m, q) for _, m in methods)] for q in ("color", "when")]
    return render([f"{size} (n = {n})", *(label for label, _ in methods)], body, data)


def needle_accuracy_salicache_lightkv(results: Path) -> str:
    """Sali-Cache at each nominal budget and LightKV, with the share of entries each kept."""
    rows, data = _needle_all(results)
    body = []
    for size in _image_sizes(rows):
        for setting in ("single", "followup"):
            sali = sorted(
                (r for r in rows if r["method"] == "salicache" and r["size"] == size and r["setting"] == setting),
                key=lambda r: r["budget_fraction"],
            )
            light = _needle_acc(rows, "lightkv", size, setting, None)
            body.append(
                [
                    size,
                    _setting_label(setting),
                    _pct(_needle_acc(rows, "full", size, setting, None)),
                    " / ".join(f"{_pct(r)} ({r['budget_fraction'] * 100:g} %: {r['kept_fraction']:.2f})" for r in sali),
                    f"{_pct(light)} ({light['kept_fraction']:.2f})" if light else "",
                ]
            )
    header = ["size", "setting", "full", "Sali-Cache (nominal fraction of FP bytes: entries kept)"]
    return render([*header, "LightKV (entries kept)"], body, data)


def needle_accuracy_by_question_kind(results: Path) -> str:
    """The full cache's accuracy per question kind and size, single question / follow-up."""
    rows, data = _needle_all(results)
    kinds = ("color", "quadrant", "presence", "count")
    body = []
    for size in _image_sizes(rows):
        cells = []
        for kind in kinds:
            vals = [
                (_needle_acc(rows, "full", size, s, None) or {}).get("by_kind", {}).get(kind)
                for s in ("single", "followup")
            ]
            cells.append(" / ".join("—" if v is None else f"{v * 100:.0f} %" for v in vals))
        body.append([size, *cells])
    return render(["full cache, single / follow-up", *kinds], body, data)


TABLES = {
    "needle": needle_accuracy,
    "needle-eviction": needle_accuracy_by_eviction_budget,
    "needle-video": needle_video_accuracy,
    "needle-salicache-lightkv": needle_accuracy_salicache_lightkv,
    "needle-by-kind": needle_accuracy_by_question_kind,
}
NEEDLE_CODE = paths(PREFILL, DECODE, SESSION, METHODS)
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "needle": NEEDLE_CODE,
    "needle-eviction": NEEDLE_CODE,
    "needle-video": NEEDLE_CODE,
    "needle-salicache-lightkv": NEEDLE_CODE,
    "needle-by-kind": NEEDLE_CODE,
}
