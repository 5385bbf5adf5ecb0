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
        if set(by_fraction) <= {None, 1.0}:  # one operating point (full, LightKV's merge setting)
            (r,) = by_fraction.values()
            cell = f"{r['mean_recall']:.2f} / {r['accuracy']:.0%} (kept {r['kept_fraction']:.2f})"
            body.append([f"`{method}`", *([cell] * len(fractions))])
            continue
        body.append(
            [f"`{method}`"]
            + [
                f"{by_fraction[f]['mean_recall']:.2f} / {by_fraction[f]['accuracy']:.0%}" if f in by_fraction else ""
                for f in fractions
            ]
        )
    header = ["method (recall / accuracy)", *(f"budget {f:.0%}" for f in fractions)]
    note = (
        "Each cell: mean evidence recall / accuracy over the same questions; a method with one operating point "
        "shows it in every column, with its measured fraction of visual entries kept."
    )
    return render(header, body, [(EVIDENCE_RESULTS, d)], note)


TABLES = {"evidence-buckets": accuracy_by_recall, "evidence-methods": recall_and_accuracy_by_method}
EVIDENCE_CODE = paths(PREFILL, DECODE, SESSION, METHODS, ("visualkv/runtime/evidence.py",))
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "evidence-buckets": EVIDENCE_CODE,
    "evidence-methods": EVIDENCE_CODE,
}
