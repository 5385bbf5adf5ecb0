"""Sali-Cache and LightKV beside EVS and VisionZip on the same needle scenes (scripts/evidence_needle.py).

Every figure comes from the one evidence-needle run: each (case, method, budget) answered on the demo model, with
the turn's TTFT and its peak and final KV bytes, the methods alternating case by case in one process. Rows at one
budget keep the same fraction of the visual tokens (`visualkv.bench.needle.kept_share_options`), so they read
side by side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from visualkv.bench.tables.evidence import EVIDENCE_CODE, EVIDENCE_RESULTS
from visualkv.bench.tables.format import load, render

KIB = 1024
#: the case kinds of the needle run, by the `video` flag of a row
KINDS = {False: "images", True: "videos"}


def _cells(rows: list[dict[str, Any]]) -> list[str]:
    """kept (measured), accuracy, mean peak KV, mean KV after the turn, mean TTFT over `rows`; dashes if none."""
    if not rows:
        return ["—"] * 5

    def mean(key: str) -> float:
        return float(np.mean([r[key] for r in rows]))

    return [
        f"{mean('kept_fraction'):.2f}",
        f"{sum(r['correct'] for r in rows) / len(rows):.0%} ({len(rows)})",
        f"{mean('peak_kv_bytes') / KIB:.0f} KiB",
        f"{mean('final_kv_bytes') / KIB:.0f} KiB",
        f"{mean('ttft_seconds'):.2f} s",
    ]


def _means(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Accuracy, mean KV after the answer and mean TTFT of `rows`."""
    return {
        "accuracy": sum(r["correct"] for r in rows) / len(rows),
        "final_kv_bytes": float(np.mean([r["final_kv_bytes"] for r in rows])),
        "ttft_seconds": float(np.mean([r["ttft_seconds"] for r in rows])),
    }


def _of(d: dict[str, Any], method: str, video: bool) -> dict[float | None, dict[str, float]]:
    """Budget fraction -> `_means` of `method`'s rows on the images (video False) or the videos."""
    out: dict[float | None, list[dict[str, Any]]] = {}
    for r in d["rows"]:
        if r["method"] == method and r["video"] == video:
            out.setdefault(r["budget_fraction"], []).append(r)
    return {f: _means(rows) for f, rows in out.items()}


def comparison(d: dict[str, Any], focal: str, others: tuple[str, ...], video: bool) -> str:
    """One sentence: how `focal` compares with `others` on the images or the videos. A method with budgets is
    compared budget by budget (means over the budgets both ran); one with one setting against the others' largest
    budget. Empty where `focal` or every other has no row there."""
    kind, mine = KINDS[video], _of(d, focal, video)
    theirs = {m: _of(d, m, video) for m in others}
    theirs = {m: t for m, t in theirs.items() if t}
    if not mine or not theirs:
        return ""
    if list(mine) == [None]:  # one setting: against each other's largest budget
        pairs = {m: ([mine[None]], [t[max(t)]]) for m, t in theirs.items()}
        at = f"at its one setting, against each at its largest budget ({max(max(t) for t in theirs.values()):.0%})"
    else:
        pairs = {m: ([mine[f] for f in mine if f in t], [t[f] for f in mine if f in t]) for m, t in theirs.items()}
        at = f"over the {len(mine)} budgets, means of the per-budget figures"

    def avg(runs: list[dict[str, float]], key: str) -> float:
        return float(np.mean([r[key] for r in runs]))

    parts = []
    for m, (a, b) in pairs.items():
        parts.append(
            f"against `{m}`, accuracy {avg(a, 'accuracy'):.0%} to {avg(b, 'accuracy'):.0%}, KV after the answer "
            f"{avg(a, 'final_kv_bytes') / avg(b, 'final_kv_bytes'):.2f}× and TTFT "
            f"{avg(a, 'ttft_seconds') / avg(b, 'ttft_seconds'):.2f}× `{m}`'s"
        )
    return f"On the {kind}, `{focal}` " + "; ".join(parts) + f" ({at})."


def _points(d: dict[str, Any], methods: tuple[str, ...]) -> list[tuple[str, float | None]]:
    """(method, budget fraction) of `methods` present in the run: `full` and fixed points first, then by budget."""
    present = dict.fromkeys((r["method"], r["budget_fraction"]) for r in d["rows"] if r["method"] in methods)
    fixed = [p for p in present if p[0] == "full" or p[1] is None]
    by_budget = sorted((p for p in present if p not in fixed), key=lambda p: (p[1], methods.index(p[0])))
    return sorted(fixed, key=lambda p: methods.index(p[0])) + by_budget


def side_by_side(results: Path, methods: tuple[str, ...], kinds: tuple[bool, ...]) -> str:
    """One row per (method, budget) of `methods`, grouped by budget; per case kind of `kinds` (False: images,
    True: videos) its measured kept share, accuracy (answers), mean peak KV, KV after the turn and TTFT; then how
    the first method after `full` compares with the rest, per kind."""
    d = load(EVIDENCE_RESULTS, results)
    focal, *others = (m for m in methods if m != "full")
    sentences = [comparison(d, focal, tuple(others), video) for video in kinds]
    body = []
    for method, fraction in _points(d, methods):
        mine = [r for r in d["rows"] if r["method"] == method and r["budget_fraction"] == fraction]
        budget = "all" if method == "full" else "one setting" if fraction is None else f"{fraction:.0%}"
        cells = [c for video in kinds for c in _cells([r for r in mine if r["video"] == video])]
        body.append([budget, f"`{method}`", *cells])
    header = ["budget", "method"]
    for video in kinds:
        kind = KINDS[video]
        header += [f"{kind}: kept", f"{kind}: accuracy (answers)", f"{kind}: peak KV", f"{kind}: KV after"]
        header.append(f"{kind}: TTFT")
    n = {video: len({r["seed"] for r in d["rows"] if r["video"] == video}) for video in kinds}
    only = [m for m in d.get("video_only", []) if m in methods]
    note = (
        f"Model `{d['model']}`, "
        + " and ".join(f"{n[video]} held-out {KINDS[video]}" for video in kinds)
        + ", one question each; every method answers the same cases in one process, alternating case by case. "
        "*kept*: the measured share of visual entries held (mean over layers and heads); *KV after*: the cache "
        "after the answer; means over the cases. "
        + (
            "`salicache` holds f/2 of the tokens at full precision, f/2 at INT8 and f at INT4 (the needle "
            "benchmark's operating point). "
            if "salicache" in methods
            else ""
        )
        + (
            f"{', '.join(f'`{m}`' for m in only)} runs on the videos only (a still image has no previous frame). "
            if only
            else ""
        )
        + (
            "`evs` keeps at least each video's first frame whole (vLLM's rule), so below that share it holds more "
            "than the budget. "
            if "evs" in methods
            else ""
        )
        + "The figures are this loaded CPU's: compare rows, not absolutes."
    )
    return render(header, body, [(EVIDENCE_RESULTS, d)], " ".join(x for x in sentences if x), note)


def salicache_beside_evs_and_visionzip(results: Path) -> str:
    """Sali-Cache, EVS and VisionZip at the same kept share on the needle videos, with `full`."""
    return side_by_side(results, ("full", "salicache", "evs", "visionzip"), (True,))


def lightkv_beside_evs_and_visionzip(results: Path) -> str:
    """LightKV's one merge setting, EVS and VisionZip at each budget on the needle images and videos, with `full`."""
    return side_by_side(results, ("full", "lightkv", "evs", "visionzip"), (False, True))


TABLES = {
    "salicache-baselines": salicache_beside_evs_and_visionzip,
    "lightkv-baselines": lightkv_beside_evs_and_visionzip,
}
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "salicache-baselines": EVIDENCE_CODE,
    "lightkv-baselines": EVIDENCE_CODE,
}
