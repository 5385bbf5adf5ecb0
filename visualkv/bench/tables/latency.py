"""Time to first token on CPU (`bench latency`): one full forward against forced block-wise and hybrid prefill."""

from __future__ import annotations

import os
import re
from pathlib import Path

from visualkv.bench.provenance import machine_label
from visualkv.bench.tables.format import family_results, load, render
from visualkv.bench.tables.measured import BLOCKWISE, FULL, PREFILL, SESSION, paths


def ttft_hybrid_and_blockwise(results: Path) -> str:
    """The bench model at 4K, one row per recorded run (each file's machine and load)."""
    names = [n for n in sorted(os.listdir(results)) if re.fullmatch(r"latency_image_bench-qwen2\.5-vl.*\.json", n)]
    rows, sources = [], []
    for name in names:
        d = load(name, results)
        if "hybrid/full" not in d["ratios"]:
            continue
        t = d["ttft_seconds"]
        rows.append(
            [
                machine_label(d.get("provenance")),
                f"{t['full']:.2f} s",
                f"{t['hybrid']:.2f} s",
                f"{t['blockwise']:.2f} s",
                f"**{d['ratios']['hybrid/full']:.2f}**",
                f"{d['ratios']['blockwise/full']:.2f}",
                f"{d['cpu_ratios']['hybrid/full']:.2f} / {d['cpu_ratios']['blockwise/full']:.2f}",
            ]
        )
        sources.append((name, d))
    header = ["run", "TTFT full", "hybrid", "forced block-wise", "hybrid / full", "block-wise / full"]
    return render([*header, "CPU-time ratios (hybrid / block-wise)"], rows, sources)


def ttft_per_family(results: Path) -> str:
    """TTFT of full, forced block-wise and hybrid prefill at 4K per newer family (tiny aliases)."""
    body, sources = [], []
    for alias, d in family_results(results, "latency_image_{alias}.json", sources):
        t = d["ttft_seconds"]
        body.append(
            [
                alias,
                machine_label(d.get("provenance")),
                f"{t['full']:.2f} s",
                f"{t['blockwise']:.2f} s",
                f"{t['hybrid']:.2f} s",
                f"{d['ratios']['blockwise/full']:.2f} / {d['ratios']['hybrid/full']:.2f}",
                f"{d['paired_median_ratios']['blockwise/full']:.2f} / {d['paired_median_ratios']['hybrid/full']:.2f}",
            ]
        )
    header = ["tiny alias", "run", "TTFT full", "forced block-wise", "hybrid"]
    return render([*header, "block-wise / full, hybrid / full (min)", "(paired median)"], body, sources)


TABLES = {
    "latency-image": ttft_hybrid_and_blockwise,
    "families-latency": ttft_per_family,
}
LATENCY_CODE = paths(PREFILL, SESSION, FULL, BLOCKWISE)
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "latency-image": LATENCY_CODE,
    "families-latency": LATENCY_CODE,
}
