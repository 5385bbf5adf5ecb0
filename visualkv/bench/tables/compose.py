"""Composition: block-wise KeyDiff with Sali-Cache against block-wise KeyDiff alone at the same budget, in KV held
(scripts/compose_ratio.py) and in needle-video accuracy (`bench needle`)."""

from __future__ import annotations

from pathlib import Path

from visualkv.bench.tables.format import load, mib, render
from visualkv.bench.tables.measured import COMPOSED, DECODE, PREFILL, SESSION, paths

COMPOSE_RATIO_RESULTS = ("compose_ratio_tiny-qwen2.5-vl.json", "compose_ratio_bench-qwen2.5-vl.json")
NEEDLE_COMPOSE_RESULTS = "needle_compose/needle.json"


def composed_against_keydiff_kv(results: Path) -> str:
    """Final KV of block-wise KeyDiff + Sali-Cache against block-wise KeyDiff alone at the same M
    (scripts/compose_ratio.py, the example video)."""
    body, sources = [], []
    for name in COMPOSE_RATIO_RESULTS:
        if not (results / name).exists():
            continue
        d = load(name, results)
        sources.append((name, d))
        for r in d["rows"]:
            tiers = r["composed"].get("tiers") or {}
            body.append(
                [
                    f"`{d['model']}`",
                    f"{r['fraction'] * 100:.0f} % ({r['budget']:,})",
                    mib(r["alone"]["final_kv_bytes"]),
                    mib(r["composed"]["final_kv_bytes"]),
                    f"{r['final_ratio']:.2f}×",
                    f"{r['peak_ratio']:.2f}×",
                    f"{tiers.get('skipped', 0):,} / {tiers.get('pruned', 0):,}",
                ]
            )
    first = sources[0][1] if sources else {}
    header = ["model", "M (share of the visual tokens)", "block-wise KeyDiff alone: final KV", "composed: final KV"]
    header += ["final ratio", "peak ratio", "tokens skipped / pruned"]
    note = (
        f"`{first.get('composed', '')}` with tiers {first.get('composed_options', {}).get('tiers', '')} on "
        f"{first.get('media', '')}: {first.get('visual_tokens', 0):,} visual tokens."
    )
    return render(header, body, sources, note)


def composed_needle_accuracy(results: Path) -> str:
    """Needle-video accuracy (demo model) and KV held: block-wise KeyDiff alone against composed with Sali-Cache."""
    d = load(NEEDLE_COMPOSE_RESULTS, results)
    alone, composed = d["methods"][0], d["methods"][-1]

    def result(method: str, fraction: float, question: str) -> dict:
        return next(
            r
            for r in d["results"]
            if r["method"] == method and r["budget_fraction"] == fraction and r["question"] == question
        )

    body = []
    fractions = sorted({r["budget_fraction"] for r in d["results"] if r["method"] == alone})
    for fraction in fractions:
        for question in sorted({r["question"] for r in d["results"]}):
            a, c = result(alone, fraction, question), result(composed, fraction, question)
            body.append(
                [
                    f"{fraction * 100:.0f} %",
                    question,
                    f"{a['accuracy'] * 100:.0f} %",
                    f"{c['accuracy'] * 100:.0f} %",
                    f"{(c['accuracy'] - a['accuracy']) * 100:+.0f}",
                    f"{c['mean_final_kv_bytes'] / a['mean_final_kv_bytes']:.2f}×",
                ]
            )
    n = d["results"][0]["n"]
    header = ["M", "question", f"`{alone}`", f"`{composed}`", "points", "final KV ratio (composed / alone)"]
    return render(header, body, [(NEEDLE_COMPOSE_RESULTS, d)], f"n = {n} held-out needle videos per row.")


TABLES = {
    "compose-ratio": composed_against_keydiff_kv,
    "needle-compose": composed_needle_accuracy,
}
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "compose-ratio": paths(PREFILL, SESSION, COMPOSED),
    "needle-compose": paths(PREFILL, DECODE, SESSION, COMPOSED),
}
