"""Block-by-block prefill with nothing evicted against one whole forward (`bench fidelity`): how far the logits
and the greedy tokens move."""

from __future__ import annotations

from pathlib import Path

from visualkv.bench.tables.format import FAMILY_ALIASES, load, render
from visualkv.bench.tables.measured import BLOCKWISE, FULL, METHODS, PREFILL, paths

FIDELITY_RESULTS = ("fidelity_image_bench-qwen2.5-vl.json", "fidelity_video_bench-qwen2.5-vl.json")


def blockwise_logits_against_one_forward(results: Path) -> str:
    """The bench model on an image and a video, one row per JSON (the `full` method's row)."""
    rows, sources = [], []
    for name in FIDELITY_RESULTS:
        d = load(name, results)
        r = next(r for r in d["rows"] if r["method"] == "full")
        what = f"video, {d['size']:g} frames" if d["video"] else f"image, {d['size']:g} MP"
        rows.append(
            [
                what,
                str(r["blocks"]),
                f"{r['max_abs_logit_diff']:.2g}",
                f"{r['ref_logit_range']:.2f}",
                f"{r['cosine']:.5f}",
                "yes" if r["same_top1"] else "no",
                f"{r['greedy_token_agreement'] * 100:.0f} %",
            ]
        )
        sources.append((name, d))
    header = [f"input ({sources[0][1]['model']}, nothing evicted)", "blocks", "max \\|Δlogit\\|", "logit range"]
    return render([*header, "cosine", "same top-1", "greedy tokens equal"], rows, sources)


def blockwise_logits_per_family(results: Path) -> str:
    """The same per newer family (tiny aliases): the worst over the methods the JSON holds."""
    body, sources = [], []
    for alias in FAMILY_ALIASES:
        for kind in ("image", "video"):
            name = f"fidelity_{kind}_{alias}.json"
            if not (results / name).exists():
                continue
            d = load(name, results)
            sources.append((name, d))
            rows = d["rows"]
            size = format(d["size"], "g")
            body.append(
                [
                    alias,
                    f"video, {size} frames" if d["video"] else f"image, {size} MP",
                    str(max(r["blocks"] for r in rows)),
                    f"{max(r['max_abs_logit_diff'] for r in rows):.2g}",
                    f"{rows[0]['ref_logit_range']:.2f}",
                    f"{min(r['cosine'] for r in rows):.5f}",
                    "yes" if all(r["same_top1"] for r in rows) else "no",
                    f"{min(r['greedy_token_agreement'] for r in rows) * 100:.0f} %",
                    ", ".join(r["method"] for r in rows),
                ]
            )
    header = ["tiny alias", "input", "blocks", "max \\|Δlogit\\|", "logit range", "cosine (min)", "same top-1"]
    return render([*header, "greedy tokens equal (min)", "methods"], body, sources)


TABLES = {
    "fidelity": blockwise_logits_against_one_forward,
    "families-fidelity": blockwise_logits_per_family,
}
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "fidelity": paths(PREFILL, FULL, BLOCKWISE),
    "families-fidelity": paths(PREFILL, METHODS),
}
