"""LightKV: KV held, TTFT and CPU time against `full` (`bench latency --lightkv`), and its default merge schedule
per model depth (computed from the code)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from visualkv.bench.tables.format import load, mib, render, render_with_source
from visualkv.bench.tables.measured import FULL, LIGHTKV, PREFILL, SESSION, paths

LIGHTKV_RESULTS = "latency_lightkv_quiet_bench-qwen2.5-vl.json"
#: (label, family, depth): depths from each model's config.json (Hub) or its `TinySpec` (offline aliases)
LIGHTKV_SCHEDULE_MODELS = (
    ("Qwen2.5-VL-7B", "qwen2_5_vl", 28),
    ("Qwen2.5-VL-3B", "qwen2_5_vl", 36),
    ("bench-qwen2.5-vl", "qwen2_5_vl", None),
    ("an 8-layer Qwen", "qwen2_5_vl", 8),
    ("tiny-qwen2.5-vl", "qwen2_5_vl", None),
    ("SmolVLM2-500M", "smolvlm", 32),
    ("SmolVLM2-2.2B", "smolvlm", 24),
    ("tiny-smolvlm2", "smolvlm", None),
)


def lightkv_against_full(results: Path) -> str:
    """Final KV, TTFT, CPU time and decoder FLOPs of LightKV over `full` on the bench model, and its stages."""
    d = load(LIGHTKV_RESULTS, results)
    lk = d["lightkv"]
    t, c, kv = d["ttft_seconds"], d["cpu_seconds"], d["final_kv_bytes"]
    rows = [
        ["**final KV bytes**", mib(kv["full"]), mib(kv["lightkv"]), f"**{d['kv_ratios']['lightkv/full']:.3f}**"],
        [
            f"**TTFT** (min of {len(d['ttft_runs']['full'])})",
            f"{t['full']:.2f} s",
            f"{t['lightkv']:.2f} s",
            f"**{d['ratios']['lightkv/full']:.3f}**",
        ],
        ["process CPU time", f"{c['full']:.1f} s", f"{c['lightkv']:.1f} s", f"{d['cpu_ratios']['lightkv/full']:.3f}"],
        ["decoder FLOPs (estimate)", "", "", f"−{lk['flops']['reduction'] * 100:.1f} %"],
    ]
    stages = lk["stages"]
    tokens = " → ".join([f"{stages[0]['tokens_in']:,}"] + [f"{s['tokens_out']:,}" for s in stages])
    note = (
        f"Merge after layers {', '.join(str(s) for s in lk['layers'])}, windows "
        f"{'-'.join(str(w) for w in lk['windows'])}, P = {', '.join(f'{r:g}' for r in lk['ratios'])}. "
        f"Visual tokens per stage {tokens}; ξ + merging overhead {lk['overhead_seconds']['total']:.2f} s "
        f"({lk['overhead_seconds']['total'] / t['lightkv'] * 100:.0f} % of TTFT), measured inside the method."
    )
    return render(["figure", "full", "LightKV", "LightKV / full"], rows, [(LIGHTKV_RESULTS, d)], note)


def _kept_over_layers(stages: list[tuple], depth: int) -> float:
    """Visual KV kept, averaged over layers, if every stage keeps exactly (1 - P) of the visual tokens."""
    kept, fraction, previous = 0.0, 1.0, -1
    for layer, _, ratio in stages:
        kept += fraction * (layer - previous)
        fraction, previous = fraction * (1 - ratio), layer
    kept += fraction * (depth - 1 - previous)
    return kept / depth


def _smolvlm_tile_note() -> str:
    """SmolVLM's 8 x 8 tiles under its default windows (they nest there, so the counts are exact)."""
    from visualkv.methods.lightkv import LightKVConfig, merge_counts

    rows, cols = np.divmod(np.arange(64), 8)
    tile, sides, survivors, previous_ids = [64], [], None, None
    smol = LightKVConfig().resolve("smolvlm", 32)
    for _, windows, ratio in smol:
        ids = (rows * windows // 8) * windows + cols * windows // 8
        if survivors is None:
            counts = np.bincount(ids, minlength=windows * windows)
        else:
            parent = np.zeros(len(survivors), dtype=np.int64)
            parent[previous_ids] = ids
            counts = np.bincount(parent, weights=survivors, minlength=windows * windows).astype(np.int64)
        survivors, previous_ids = counts - merge_counts(counts, ratio), ids
        tile.append(int(survivors.sum()))
        sides.append(f"{8 // windows}×{8 // windows}")
    return (
        f"On SmolVLM's 8×8 tiles the default windows are {', then '.join(sides)} tokens (the last is the whole "
        f"tile), P = {', '.join(f'{p:g}' for _, _, p in smol)}: {' → '.join(str(t) for t in tile)} tokens per tile."
    )


def lightkv_default_schedule(results: Path) -> str:
    """LightKV's default schedule per model depth: computed from the code, not measured."""
    from visualkv.methods.lightkv import LightKVConfig
    from visualkv.models.synthetic.tiny import TINY_SPECS

    body = []
    for label, family, depth in LIGHTKV_SCHEDULE_MODELS:
        depth = depth or TINY_SPECS[label].text_num_layers
        stages = LightKVConfig().resolve(family, depth)
        name = f"{label} ({depth})" if "layer" not in label else label
        body.append(
            [
                name,
                ", ".join(str(s[0]) for s in stages),
                ", ".join(str(s[1]) for s in stages),
                f"{_kept_over_layers(stages, depth):.3g}",
            ]
        )
    header = ["model (depth)", "merge after layers", "windows", "visual KV kept (each stage keeps 1 − P)"]
    source = "Source: computed from `LightKVConfig().resolve(family, depth)` in `visualkv/methods/lightkv.py` (not measured)."
    return render_with_source(header, body, _smolvlm_tile_note(), source)


TABLES = {
    "lightkv": lightkv_against_full,
    "lightkv-schedule": lightkv_default_schedule,
}
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`); a table computed from the code
#: measures nothing
MEASURES = {
    "lightkv": paths(PREFILL, SESSION, FULL, LIGHTKV),
    "lightkv-schedule": (),
}
