"""Does evidence recall predict answer quality? The demo model's needle scenes, every method, several budgets.

    python scripts/evidence_needle.py --images 30 --videos 10 --fractions 0.01,0.02,0.05,0.1,0.25 \\
        --json docs/results/evidence_needle.json --svg docs/results/evidence_needle.svg
    python scripts/evidence_needle.py --redraw   # the SVG again from the committed JSON

Each held-out case (`visualkv.bench.needle`: an image scene's first question, a video's colour question) runs
once per method and budget with `SessionConfig(evidence=True)`: its evidence recall (the share of the
uncompressed model's attention from the answer to the visual tokens that the compressed cache kept) against
whether the greedy answer is right. Reported: Spearman's rank correlation of recall with correctness over all
questions (and over the compressed ones alone), accuracy by recall bucket, and per method its mean recall and
accuracy, `blockwise-random` giving the chance level. Methods without a token budget keep the same fraction of
the visual tokens through their own options (`visualkv.bench.needle.kept_share_options`); EVS runs on the videos
only. Each row also records the turn's TTFT and its peak and final KV bytes. The SVG is drawn here from the JSON's
numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METHODS = (
    "full",
    "blockwise-snapkv",
    "blockwise-keydiff",
    "post-snapkv",
    "blockwise-random",
    "salicache",
    "lightkv",
    "evs",
    "fastv",
    "visionzip",
    "streamingllm",
    "pyramidkv",
)
#: recall buckets (lower bounds; the last one is the exact 1.0 of nothing lost)
BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9)


def ranks(values: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their positions), 1-based."""
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    out = np.empty(len(values))
    start = 0
    while start < len(values):
        end = start
        while end + 1 < len(values) and sorted_values[end + 1] == sorted_values[start]:
            end += 1
        out[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return out


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rho: Pearson's correlation of the average ranks; None when either side is constant."""
    rx, ry = ranks(np.asarray(x, dtype=float)), ranks(np.asarray(y, dtype=float))
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def bucket_of(recall: float) -> str:
    if recall >= 1.0:
        return "1.0 (nothing lost)"
    low = max(b for b in BUCKETS if recall >= b)
    high = next((b for b in BUCKETS if b > low), 1.0)
    return f"[{low:g}, {high:g})"


def run_case(adapter, case, media, method: str, fraction: float | None, options: dict) -> dict:
    from visualkv.bench.scenes import answer_matches
    from visualkv.methods import method_traits
    from visualkv.runtime.session import ChatSession, SessionConfig

    n_visual = int(adapter.prepare(media, "?").layout.n_visual)
    budget = max(1, round(fraction * n_visual)) if method_traits(method).needs_budget else None
    config = SessionConfig(method=method, budget=budget, max_new_tokens=6, method_options=dict(options), evidence=True)
    session = ChatSession(adapter, config)
    record = session.ask(case.first.question, media)
    report = session.report()
    return {
        "size": case.size,
        "video": case.video,
        "seed": case.scene.seed,
        "method": method,
        "budget_fraction": fraction,
        "budget": budget,
        "n_visual": n_visual,
        "kept_fraction": round(float(session.retained().mean()), 4),
        "question": case.first.question,
        "kind": case.first.kind,
        "expected": case.first.answer,
        "answer": record.answer,
        "correct": bool(answer_matches(record.answer, case.first.answer)),
        "evidence_recall": session.evidence.recall,
        # the turn's prefill time and KV bytes (the evidence pass runs after the turn: neither counts it)
        "ttft_seconds": round(record.ttft_seconds, 4),
        "peak_kv_bytes": report["peak_kv_bytes"],
        "final_kv_bytes": report["final_kv_bytes"],
        "full_kv_bytes": report["full_kv_bytes"],
    }


def summarise(rows: list[dict]) -> dict:
    """Spearman's rho (all questions; compressed ones alone), accuracy by recall bucket, per-method means."""
    recall = [r["evidence_recall"] for r in rows]
    correct = [float(r["correct"]) for r in rows]
    compressed = [r for r in rows if r["method"] != "full"]
    buckets = []
    for label in [*(bucket_of(b) for b in BUCKETS), bucket_of(1.0)]:
        inside = [r for r in rows if bucket_of(r["evidence_recall"]) == label]
        if inside:
            acc = sum(r["correct"] for r in inside) / len(inside)
            buckets.append({"bucket": label, "n": len(inside), "accuracy": round(acc, 4)})
    per_method = []
    for method in dict.fromkeys(r["method"] for r in rows):
        for fraction in dict.fromkeys(r["budget_fraction"] for r in rows if r["method"] == method):
            mine = [r for r in rows if r["method"] == method and r["budget_fraction"] == fraction]
            per_method.append(
                {
                    "method": method,
                    "budget_fraction": fraction,
                    "n": len(mine),
                    "mean_recall": round(float(np.mean([r["evidence_recall"] for r in mine])), 4),
                    "accuracy": round(sum(r["correct"] for r in mine) / len(mine), 4),
                    "kept_fraction": round(float(np.mean([r["kept_fraction"] for r in mine])), 4),
                }
            )
    return {
        "n": len(rows),
        "spearman": spearman(recall, correct),
        "spearman_compressed": spearman(
            [r["evidence_recall"] for r in compressed], [float(r["correct"]) for r in compressed]
        ),
        "n_compressed": len(compressed),
        "accuracy_by_recall": buckets,
        "per_method": per_method,
    }


def svg_figure(summary: dict, rows: list[dict]) -> str:
    """Left: each question's recall (x) against right / wrong (jittered rows). Right: accuracy per recall bucket."""
    width, height, pad = 820, 345, 50
    out = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
            'font-size="12">'
        ),
        f'<rect width="{width}" height="{height}" fill="white"/>',
        (
            f'<text x="{pad}" y="22" font-size="14">Evidence recall vs correctness (visualkv-demo needle scenes, '
            f"n = {summary['n']}, Spearman ρ = {_fmt(summary['spearman'])})</text>"
        ),
    ]
    left, plot_w, top, plot_h = pad, 360, 50, 220
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>')
    rng = np.random.default_rng(0)
    colours = {True: "#2ca02c", False: "#d62728"}
    for r in rows:
        x = left + r["evidence_recall"] * plot_w
        lane = top + (plot_h * 0.3 if r["correct"] else plot_h * 0.75) + rng.uniform(-28, 28)
        out.append(f'<circle cx="{x:.1f}" cy="{lane:.1f}" r="3" fill="{colours[r["correct"]]}" fill-opacity="0.55"/>')
    out.append(f'<text x="{left + 6}" y="{top + 16}" fill="#2ca02c">right</text>')
    out.append(f'<text x="{left + 6}" y="{top + plot_h - 8}" fill="#d62728">wrong</text>')
    for tick in (0, 0.25, 0.5, 0.75, 1.0):
        x = left + tick * plot_w
        out.append(f'<text x="{x:.1f}" y="{top + plot_h + 16}" text-anchor="middle">{tick:g}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h + 34}" text-anchor="middle">evidence recall</text>')
    bars = summary["accuracy_by_recall"]
    left2, plot_w2 = left + plot_w + 70, 330
    out.append(f'<rect x="{left2}" y="{top}" width="{plot_w2}" height="{plot_h}" fill="none" stroke="#999"/>')
    step = plot_w2 / max(1, len(bars))
    for i, bar in enumerate(bars):
        h = bar["accuracy"] * plot_h
        x = left2 + i * step + step * 0.15
        out.append(
            f'<rect x="{x:.1f}" y="{top + plot_h - h:.1f}" width="{step * 0.7:.1f}" height="{h:.1f}" fill="#1f77b4"/>'
        )
        label = bar["bucket"].replace(" (nothing lost)", "")
        centre = x + step * 0.35
        for line, text in enumerate((label, f"n={bar['n']}")):
            y = top + plot_h + 14 + 12 * line
            out.append(f'<text x="{centre:.1f}" y="{y}" text-anchor="middle" font-size="10">{text}</text>')
        out.append(
            f'<text x="{centre:.1f}" y="{top + plot_h - h - 4:.1f}" text-anchor="middle" font-size="10">'
            f"{bar['accuracy']:.0%}</text>"
        )
    out.append(
        f'<text x="{left2 + plot_w2 / 2}" y="{top + plot_h + 46}" text-anchor="middle">accuracy by recall bucket</text>'
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    from visualkv.bench import provenance
    from visualkv.bench.needle import VIDEO_ONLY, make_cases, make_video_cases, method_points
    from visualkv.bench.scenes import scene_media, video_media
    from visualkv.models.registry import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=30, help="held-out 560x315 image scenes")
    p.add_argument("--videos", type=int, default=10, help="held-out video scenes")
    p.add_argument("--fractions", default="0.01,0.02,0.05,0.1,0.25", help="budgets as fractions of the visual tokens")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--json", default="docs/results/evidence_needle.json")
    p.add_argument("--svg", default="docs/results/evidence_needle.svg")
    p.add_argument("--redraw", action="store_true", help="only redraw --svg from the figures in --json")
    args = p.parse_args(argv)
    if args.redraw:
        with open(args.json) as fh:
            saved = json.load(fh)
        with open(args.svg, "w") as fh:
            fh.write(svg_figure(saved, saved["rows"]))
        return 0
    prov = provenance.start()
    prov["command"] = "python scripts/evidence_needle.py " + " ".join(sys.argv[1:] if argv is None else argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    adapter = load_model("visualkv-demo")
    cases = make_cases((560, 315), args.images) + make_video_cases(args.videos)
    points = method_points(args.methods.split(","), fractions)
    rows, t0 = [], time.perf_counter()
    for i, case in enumerate(cases):
        media = video_media(case.scene) if case.video else scene_media(case.scene)
        for method, fraction, options in points:
            if method in VIDEO_ONLY and not case.video:
                continue
            rows.append(run_case(adapter, case, media, method, fraction, options))
        print(f"[{i + 1}/{len(cases)}] {case.size} seed {case.scene.seed} ({time.perf_counter() - t0:.0f} s)")
    summary = summarise(rows)
    out = {
        "kind": "evidence_needle",
        "model": "visualkv-demo",
        "fractions": fractions,
        "video_only": [m for m in VIDEO_ONLY if m in args.methods.split(",")],
        "options": {f"{m}@{f}": o for m, f, o in points if o},
        **summary,
        "rows": rows,
    }
    out["seconds"] = round(time.perf_counter() - t0, 1)
    provenance.save_json(out, args.json, prov)
    with open(args.svg, "w") as fh:
        fh.write(svg_figure(summary, rows))
    print(f"Spearman rho {_fmt(summary['spearman'])} (compressed only {_fmt(summary['spearman_compressed'])})")
    for bucket in summary["accuracy_by_recall"]:
        print(f"  recall {bucket['bucket']:>20}: accuracy {bucket['accuracy']:.0%} (n={bucket['n']})")
    print("saved", args.json, args.svg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
