"""Evidence recall against answer correctness on the demo model's needle scenes (scripts/evidence_needle.py)."""

from __future__ import annotations

from pathlib import Path

from visualkv.bench.tables.format import load, render
from visualkv.bench.tables.measured import DECODE, METHODS, PREFILL, SESSION, paths

EVIDENCE_RESULTS = "evidence_needle.json"


def accuracy_by_recall(results: Path) -> str:
    """Accuracy per evidence-recall bucket over every (question, method, budget), and Spearman's rho."""
    d = load(EVIDENCE_RESULTS, results)
    body = [[b["bucket"], f"{b['accuracy']:.0%}", str(b["n"])] for b in d["accuracy_by_recall"]]
    note = (
        f"Spearman's rank correlation of evidence recall with correctness: ρ = {d['spearman']:.2f} over "
        f"{d['n']} answers ({d['spearman_compressed']:.2f} over the {d['n_compressed']} of compressed methods)."
    )
    return render(["evidence recall", "accuracy", "answers"], body, [(EVIDENCE_RESULTS, d)], note)


def recall_and_accuracy_by_method(results: Path) -> str:
    """Per method, mean evidence recall / accuracy at each budget (fraction of the visual tokens)."""
    d = load(EVIDENCE_RESULTS, results)
    fractions = d["fractions"]
    rows: dict[str, dict] = {}
    for r in d["per_method"]:
        rows.setdefault(r["method"], {})[r["budget_fraction"]] = r
    body = []
    for method, by_fraction in rows.items():
        label = f"`{method}`" + _ROW_NOTES.get(method, "")
        if method in d.get("video_only", []):
            label += " (videos only)"
        if set(by_fraction) <= {None, 1.0}:  # one operating point (full, LightKV's merge setting)
            (r,) = by_fraction.values()
            cell = f"{r['mean_recall']:.2f} / {r['accuracy']:.0%} (kept {r['kept_fraction']:.2f})"
            body.append([label, *([cell] * len(fractions))])
            continue
        body.append(
            [label]
            + [
                f"{by_fraction[f]['mean_recall']:.2f} / {by_fraction[f]['accuracy']:.0%}" if f in by_fraction else ""
                for f in fractions
            ]
        )
    header = ["method (recall / accuracy)", *(f"budget {f:.0%}" for f in fractions)]
    note = (
        "Each cell: mean evidence recall / accuracy over the same questions; a method with one operating point "
        "shows it in every column, with its measured fraction of visual entries kept. Methods without a token "
        "budget keep the column's fraction through their own options (`visualkv.bench.needle.kept_share_options`)."
    )
    return render(header, body, [(EVIDENCE_RESULTS, d)], note, *_kept_notes(d, rows))


#: what a row's label adds about where its method keeps the column's fraction
_ROW_NOTES = {"fastv": " (all tokens below layer K)"}


def _kept_notes(d: dict, rows: dict[str, dict]) -> list[str]:
    """Sentences on the methods that do not hold the column's fraction everywhere: FastV (every visual token in
    the layers before K) and the video-only ones (their cells cover the videos alone)."""
    notes = []
    if "fastv" in rows:
        held = ", ".join(
            f"{r['kept_fraction']:.2f} at {f:.0%}" for f, r in sorted(rows["fastv"].items(), key=lambda x: x[0])
        )
        notes.append(
            "`fastv` keeps every visual token in the layers before K and the column's fraction from K on; its "
            f"measured share of visual entries over all layers: {held}."
        )
    only = [m for m in d.get("video_only", []) if m in rows]
    if only:
        n = len({r["seed"] for r in d["rows"] if r["video"]})
        names = ", ".join(f"`{m}`" for m in only)
        notes.append(f"{names}: the {n} videos only (a still image has no previous frame, so it keeps every token).")
    if "evs" in rows:
        notes.append(
            "`evs` keeps at least each video's first frame whole (vLLM's rule), so below that share it holds more "
            "than the column's fraction."
        )
    return notes


TABLES = {"evidence-buckets": accuracy_by_recall, "evidence-methods": recall_and_accuracy_by_method}
EVIDENCE_CODE = paths(PREFILL, DECODE, SESSION, METHODS, ("visualkv/runtime/evidence.py",))
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "evidence-buckets": EVIDENCE_CODE,
    "evidence-methods": EVIDENCE_CODE,
}
