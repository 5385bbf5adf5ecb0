"""README / docs tables generated from the committed benchmark JSON (``python -m visualkv bench report``).

A document marks each generated table with a pair of HTML comments::

    <!-- figures:memory-image -->
    ...generated Markdown, never edited by hand...
    <!-- /figures:memory-image -->

`render_document` rewrites what lies between the markers from the JSON files under
``docs/results/``; `check_documents` reports every block whose text differs from what the JSON
gives (a test runs it, so README and JSON cannot drift apart). Every table ends with a source line:
the JSON file, the command that wrote it, the machine (cores or GPU, idle or loaded) and the commit
measured, from its ``provenance`` block (see :mod:`visualkv.bench.provenance`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from visualkv.bench.provenance import machine_label

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "docs" / "results"
#: every document with generated blocks (and every page whose prose tests/test_figures.py checks)
DOCUMENTS = (
    "README.md",
    "docs/RESULTS.md",
    "docs/ARCHITECTURE.md",
    "docs/CLI.md",
    "docs/APP.md",
    "docs/METHODS.md",
    "docs/SALICACHE.md",
    "docs/LIGHTKV.md",
    "docs/DEMO.md",
)
_BLOCK = re.compile(r"(<!-- figures:([\w-]+) -->\n)(.*?)(<!-- /figures:\2 -->)", re.DOTALL)
MIB = 2**20


def load(name: str, results: Path = RESULTS) -> dict[str, Any]:
    with open(results / name) as fh:
        return json.load(fh)


def source_line(*names_and_data: tuple[str, dict[str, Any]], prefix: str = "docs/results/") -> str:
    parts = []
    for name, data in names_and_data:
        prov = data.get("provenance") or {}
        command = prov.get("command") or data.get("command", "command not recorded")
        machine = machine_label(prov) if prov else data.get("machine", "machine not recorded")
        commit = f", commit `{prov['commit']}`" if prov.get("commit") else ""
        parts.append(f"[`{name}`]({prefix}{name}): `{command}` ({machine}{commit})")
    return "Source: " + "; ".join(parts) + "."


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _render(header: list[str], rows: list[list[str]], sources: list[tuple[str, dict]], *notes: str) -> str:
    """A table, then each note as its own paragraph, then the source line of `sources`."""
    return "\n\n".join(["\n".join(_table(header, rows)), *notes, source_line(*sources)])


def _mib(n: float) -> str:
    return f"{n / MIB:.2f} MiB"


def _x(v: float) -> str:
    return f"{v:.2f}×"


# -- tables ----------------------------------------------------------------------------------------
def _memory_columns(data: dict[str, Any]) -> dict[str, str]:
    rows, s, budget = data["rows"], data["summary"], data["budget"]
    largest = max(r["size"] for r in rows)
    at = {r["method"]: r for r in rows if r["size"] == largest}
    bw = "blockwise-snapkv"
    over = sorted(
        (r for r in rows if r["method"] == bw and r["visual_tokens"] > budget + (r["block_size"] or 0)),
        key=lambda r: r["size"],
    )
    full = sorted((r for r in rows if r["method"] == "full"), key=lambda r: r["size"])
    bw_growth = [s[m]["rss_growth_over_full_growth"] for m in ("blockwise-keydiff", bw) if m in s]
    return {
        "visual": f"{at['full']['visual_tokens']:,}",
        "peak": " / ".join(_mib(at[m]["peak_kv_bytes"]) for m in ("full", "post-snapkv", bw)),
        "final_ratio": _x(s[bw]["full_over_final_kv_largest"]),
        "peak_ratio": _x(s[bw]["full_over_peak_kv_largest"]),
        "flat": ", ".join(_mib(r["peak_kv_bytes"]) for r in over)
        + f" (spread {s[bw].get('peak_kv_spread_over_bound_sizes', 0) * 100:.1f} %)",
        "full_growth": f"{_mib(full[0]['peak_kv_bytes'])} → {_mib(full[-1]['peak_kv_bytes'])}",
        "bound": f"≤ {s[bw]['peak_over_bound_max']:.2f}" if "peak_over_bound_max" in s[bw] else "not recorded",
        "rss": f"+{s['full']['peak_rss_growth_bytes'] / MIB:.0f} MiB / "
        + " … ".join(f"+{s[m]['peak_rss_growth_bytes'] / MIB:.0f}" for m in ("blockwise-keydiff", bw) if m in s)
        + f" MiB ({min(bw_growth):.2f}–{max(bw_growth):.2f} of full's)",
        "sizes": ", ".join(f"{r['size']:g}" for r in full),
    }


def table_memory_image(results: Path) -> str:
    names = ["memory_image_tiny-qwen2.5-vl.json", "memory_image_bench-qwen2.5-vl.json"]
    data = [load(n, results) for n in names]
    cols = [_memory_columns(d) for d in data]
    labels = [
        ("visual tokens at the largest size (4K = 3840×2160)", "visual"),
        ("peak KV at 4K: full / post-snapkv / block-wise", "peak"),
        ("**full / block-wise, final KV at 4K**", "final_ratio"),
        ("**full / block-wise, peak KV at 4K**", "peak_ratio"),
        ("block-wise peak KV over the sizes > M + b", "flat"),
        ("full peak KV, smallest → largest size", "full_growth"),
        ("block-wise peak / ((M + b + protected) × layers)", "bound"),
        ("process peak RSS growth over the sweep: full / block-wise (KeyDiff … SnapKV)", "rss"),
        ("sizes (megapixels)", "sizes"),
    ]
    rows = [[label, cols[0][key], cols[1][key]] for label, key in labels]
    return _render(["figure", data[0]["model"], data[1]["model"]], rows, list(zip(names, data)))


def table_latency_image(results: Path) -> str:
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
    return _render([*header, "CPU-time ratios (hybrid / block-wise)"], rows, sources)


def _fidelity(results: Path, names: list[str]) -> str:
    """Block-wise against one forward with nothing evicted (`bench fidelity`), one row per JSON."""
    rows, sources = [], []
    for name in names:
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
    return _render([*header, "cosine", "same top-1", "greedy tokens equal"], rows, sources)


def table_fidelity(results: Path) -> str:
    return _fidelity(results, ["fidelity_image_bench-qwen2.5-vl.json", "fidelity_video_bench-qwen2.5-vl.json"])


def table_memory_video(results: Path) -> str:
    name = "memory_video_tiny-qwen2.5-vl.json"
    d = load(name, results)
    rows = []
    for size in sorted({r["size"] for r in d["rows"]}):
        at = {r["method"]: r for r in d["rows"] if r["size"] == size}
        bw = at.get("blockwise-snapkv") or at.get("blockwise-keydiff")
        rows.append(
            [
                f"{size:g}",
                f"{at['full']['visual_tokens']:,}",
                _mib(at["full"]["peak_kv_bytes"]),
                _mib(bw["peak_kv_bytes"]),
                _mib(bw["final_kv_bytes"]),
            ]
        )
    s = d["summary"]
    bw_name = "blockwise-snapkv" if "blockwise-snapkv" in s else "blockwise-keydiff"
    note = (
        f"Process peak RSS growth over the sweep: full +{s['full']['peak_rss_growth_bytes'] / MIB:.0f} MiB, "
        f"block-wise +{s[bw_name]['peak_rss_growth_bytes'] / MIB:.0f} MiB "
        f"({s[bw_name]['rss_growth_over_full_growth']:.2f} of full's)."
    )
    header = ["frames (1 fps)", "visual tokens", "full peak KV", "block-wise peak KV", "block-wise final KV"]
    return _render(header, rows, [(name, d)], note)


TIER_KEYS = ("skipped", "pruned", "int4", "int8", "full")
SALICACHE_RESULTS = (
    "salicache_tiny-qwen2.5-vl.json",
    "salicache_bench-qwen2.5-vl.json",
    "salicache_tiny-smolvlm2.json",
)


def table_salicache(results: Path) -> str:
    names = [n for n in SALICACHE_RESULTS if (results / n).exists()]
    data = [load(n, results) for n in names]

    def agree(d):
        g = d["greedy_agreement"]
        return (
            f"{round(g['positionwise'] * g['compared'])} / {g['compared']}"
            f" (first-token cosine {d['first_token_logits']['cosine']:.3f})"
        )

    def split(d):
        f = d["tier_fractions"]
        return " / ".join(f"{f[k] * 100:.1f}" for k in TIER_KEYS)

    labels = [
        ("**final KV bytes, full / salicache**", lambda d: f"**{d['kv_ratio_full_over_salicache']:.2f}×**"),
        (
            "**TTFT salicache / full** (one process)",
            lambda d: (
                f"**{d['ttft_ratio_salicache_over_full']:.2f}** "
                f"({d['ttft_seconds']['salicache']:.2f} s / {d['ttft_seconds']['full']:.2f} s)"
            ),
        ),
        ("greedy tokens equal to `full`", agree),
        (
            "vision encoder calls (Qwen: temporal patches; SmolVLM: frames)",
            lambda d: f"{d['vision_encoder_frames']['salicache']} of {d['vision_encoder_frames']['full']}",
        ),
        (
            "final KV bytes: full / salicache",
            lambda d: f"{d['final_kv_bytes']['full']:,} / {d['final_kv_bytes']['salicache']:,} B",
        ),
        ("tier split, % of visual tokens: skipped / pruned / INT4 / INT8 / FP", split),
        ("run", lambda d: machine_label(d.get("provenance"))),
    ]
    paper = data[0]["paper_tier_fractions"] if data else {}
    rows = [[label, *(f(d) for d in data)] for label, f in labels]
    notes = (
        ["Paper's split (LLaVA-1.6-Mistral-7B): " + " / ".join(f"{paper[k] * 100:.1f}" for k in TIER_KEYS) + "."]
        if paper
        else []
    )
    return _render(["figure", *(d["model"] for d in data)], rows, list(zip(names, data)), *notes)


def table_salicache_variants(results: Path) -> str:
    name = SALICACHE_RESULTS[0]
    d = load(name, results)
    rows = [
        [
            f"{v['variant']} (`{json.dumps(v['options'])}`)" if v["options"] else v["variant"],
            _x(v["kv_ratio_full_over_salicache"]),
            f"{v['first_token_cosine']:.4f}",
            f"{v['greedy_equal']} / {v['compared']}",
        ]
        for v in d.get("variants", [])
    ]
    header = ["variant", "KV full / salicache", "first-token logits cosine", "greedy tokens equal"]
    return _render(header, rows, [(name, d)])


def table_lightkv(results: Path) -> str:
    name = "latency_lightkv_quiet_bench-qwen2.5-vl.json"
    d = load(name, results)
    lk = d["lightkv"]
    t, c, kv = d["ttft_seconds"], d["cpu_seconds"], d["final_kv_bytes"]
    rows = [
        ["**final KV bytes**", _mib(kv["full"]), _mib(kv["lightkv"]), f"**{d['kv_ratios']['lightkv/full']:.3f}**"],
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
    return _render(["figure", "full", "LightKV", "LightKV / full"], rows, [(name, d)], note)


#: (label, dtype, head_dim) of the Sali-Cache bytes table (the 7B's head_dim from its config.json)
SALICACHE_BYTES_MODELS = (("tiny-*", "float32", "tiny-qwen2.5-vl"), ("bench-*", "float32", "bench-qwen2.5-vl"))


def table_salicache_bytes(results: Path) -> str:
    """Bytes per token and KV head of each Sali-Cache tier, and the KV shrink of a tier split: computed."""
    import torch

    from visualkv.kv.quant import QuantSpec, packed_bytes_per_token
    from visualkv.media.saliency import TierSpec
    from visualkv.methods.salicache import PAPER_TIER_FRACTIONS
    from visualkv.models.synthetic.tiny import TINY_SPECS

    models = [
        (label, getattr(torch, dtype), TINY_SPECS[alias].head_dim) for label, dtype, alias in SALICACHE_BYTES_MODELS
    ]
    models.append(("Qwen2.5-VL-7B", torch.bfloat16, 128))
    body, bf16 = [], {}
    for label, dtype, head_dim in models:
        full = head_dim * torch.empty((), dtype=dtype).element_size()
        cells = {bits: packed_bytes_per_token(head_dim, QuantSpec(bits=bits), dtype) for bits in (8, 4)}
        group = QuantSpec(bits=8).resolved(head_dim).group_size
        name = f"{label} ({str(dtype).removeprefix('torch.').replace('float32', 'fp32').replace('bfloat16', 'bf16')}, "
        body.append(
            [
                f"{name}{head_dim}, {group})",
                f"{full} B",
                *(f"{cells[b]} B ({cells[b] / full:.3g}×)" for b in (8, 4)),
            ]
        )
        bf16 = {b: cells[b] / full for b in (8, 4)}  # the last row: the real model
    paper = PAPER_TIER_FRACTIONS

    def shrink(full: float, int8: float, int4: float, r8: float, r4: float) -> float:
        return 1 / (full + int8 * r8 + int4 * r4)

    ours = TierSpec().fractions
    note = (
        f"Projection to {body[-1][0]}: at the paper's split the KV of the visual "
        f"tokens shrinks 1 / ({paper['full']:g} + {paper['int8']:g} · {bf16[8]:g} + {paper['int4']:g} · {bf16[4]:g}) "
        f"= **{shrink(paper['full'], paper['int8'], paper['int4'], bf16[8], bf16[4]):.2f}×** (the paper's bit count "
        f"says {shrink(paper['full'], paper['int8'], paper['int4'], 0.5, 0.25):.2f}×; scales and zero points cost "
        f"the difference); on a video with nothing to skip our default tiers ({' / '.join(f'{f:g}' for f in ours)} "
        f"FP / INT8 / INT4) give {shrink(*ours, bf16[8], bf16[4]):.2f}×."
    )
    header = ["model (dtype, head_dim, group)", "full", "INT8", "INT4"]
    source = (
        "Source: computed from `packed_bytes_per_token` (`visualkv/kv/quant.py`), `PAPER_TIER_FRACTIONS` and "
        "`TierSpec` (not measured)."
    )
    return "\n\n".join(["\n".join(_table(header, body)), note, source])


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


def table_lightkv_schedule(results: Path) -> str:
    """LightKV's default schedule per model depth: computed from the code, not measured."""
    from visualkv.methods.lightkv import LightKVConfig, merge_counts
    from visualkv.models.synthetic.tiny import TINY_SPECS

    body = []
    for label, family, depth in LIGHTKV_SCHEDULE_MODELS:
        depth = depth or TINY_SPECS[label].text_num_layers
        stages = LightKVConfig().resolve(family, depth)
        # visual KV kept, averaged over layers, if every stage keeps exactly (1 - P) of the visual tokens
        kept, fraction, previous = 0.0, 1.0, -1
        for layer, _, ratio in stages:
            kept += fraction * (layer - previous)
            fraction, previous = fraction * (1 - ratio), layer
        kept += fraction * (depth - 1 - previous)
        name = f"{label} ({depth})" if "layer" not in label else label
        body.append(
            [
                name,
                ", ".join(str(s[0]) for s in stages),
                ", ".join(str(s[1]) for s in stages),
                f"{kept / depth:.3g}",
            ]
        )
    # SmolVLM's 8 x 8 tiles under its default windows (they nest there, so the counts are exact)
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
    note = (
        f"On SmolVLM's 8×8 tiles the default windows are {', then '.join(sides)} tokens (the last is the whole "
        f"tile), P = {', '.join(f'{p:g}' for _, _, p in smol)}: {' → '.join(str(t) for t in tile)} tokens per tile."
    )
    header = ["model (depth)", "merge after layers", "windows", "visual KV kept (each stage keeps 1 − P)"]
    source = "Source: computed from `LightKVConfig().resolve(family, depth)` in `visualkv/methods/lightkv.py` (not measured)."
    return "\n\n".join(["\n".join(_table(header, body)), note, source])


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


def table_needle(results: Path) -> str:
    names = list(NEEDLE_RESULTS)
    data = [load(n, results) for n in names]
    columns = [
        ("full", "full", None),
        ("block-wise SnapKV 10 %", "blockwise-snapkv", 0.1),
        ("block-wise KeyDiff 10 %", "blockwise-keydiff", 0.1),
        ("post-SnapKV 10 %", "post-snapkv", 0.1),
        ("Sali-Cache 25 % of FP bytes", "salicache", 0.25),
        ("LightKV", "lightkv", None),
    ]
    rows = []
    for d in data:
        res = d["results"]
        sizes = sorted(
            {r["size"] for r in res if not r["size"].startswith("video")}, key=lambda s: int(s.split("x")[0])
        )
        for size in sizes:
            for setting in ("single", "followup"):
                cells = []
                for _, method, fraction in columns:
                    r = _needle_acc(res, method, size, setting, fraction)
                    if r is None and method == "salicache":  # 4K runs: one budget only
                        r = _needle_acc(res, method, size, setting, 0.1)
                        cells.append(
                            f"{r['accuracy'] * 100:.0f} % (at 10 %; entries kept {r['kept_fraction']:.2f})"
                            if r
                            else "—"
                        )
                        continue
                    if r is None:
                        cells.append("—")
                    elif method in ("salicache", "lightkv"):
                        cells.append(f"{r['accuracy'] * 100:.0f} % (entries kept {r['kept_fraction']:.2f})")
                    else:
                        cells.append(f"{r['accuracy'] * 100:.0f} %")
                n = (_needle_acc(res, "full", size, setting, None) or {}).get("n", "?")
                label = (
                    f"{size.replace('x', '×')} {'single question' if setting == 'single' else 'follow-up'} (n = {n})"
                )
                rows.append([label, *cells])
    return _render(["held-out accuracy", *(c[0] for c in columns)], rows, list(zip(names, data)))


# -- docs/DEMO.md: the needle tables in full ---------------------------------------------------------
NEEDLE_RESULTS = ("needle_small/needle.json", "needle_4k30/needle.json")


def _needle_all(results: Path) -> tuple[list[dict], list[tuple[str, dict]]]:
    data = [(n, load(n, results)) for n in NEEDLE_RESULTS]
    return [r for _, d in data for r in d["results"]], data


def _pct(r: dict | None) -> str:
    return f"{r['accuracy'] * 100:.0f} %" if r else ""


def _image_sizes(rows: list[dict]) -> list[str]:
    return sorted({r["size"] for r in rows if not r["size"].startswith("video")}, key=lambda s: int(s.split("x")[0]))


def table_needle_eviction(results: Path) -> str:
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
                    "follow-up" if setting == "followup" else setting,
                    *(_pct(_needle_acc(rows, m, size, setting, f)) for _, m, f in cols),
                ]
            )
    return _render(["size", "setting", *(c[0] for c in cols)], body, data)


def table_needle_video(results: Path) -> str:
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
    return _render([f"{size} (n = {n})", *(label for label, _ in methods)], body, data)


def table_needle_salicache_lightkv(results: Path) -> str:
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
                    "follow-up" if setting == "followup" else setting,
                    _pct(_needle_acc(rows, "full", size, setting, None)),
                    " / ".join(f"{_pct(r)} ({r['budget_fraction'] * 100:g} %: {r['kept_fraction']:.2f})" for r in sali),
                    f"{_pct(light)} ({light['kept_fraction']:.2f})" if light else "",
                ]
            )
    header = ["size", "setting", "full", "Sali-Cache (nominal fraction of FP bytes: entries kept)"]
    return _render([*header, "LightKV (entries kept)"], body, data)


def table_needle_by_kind(results: Path) -> str:
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
    return _render(["full cache, single / follow-up", *kinds], body, data)


FAMILY_ALIASES = ("tiny-qwen3-vl", "tiny-llava-onevision", "tiny-internvl3.5")


def _family_results(results: Path, pattern: str, sources: list[tuple[str, dict]]):
    """(alias, JSON) for each newer family whose `pattern.format(alias=...)` file exists; each is added to
    `sources` for the table's source line."""
    for alias in FAMILY_ALIASES:
        name = pattern.format(alias=alias)
        if (results / name).exists():
            d = load(name, results)
            sources.append((name, d))
            yield alias, d


def _matching_results(results: Path, pattern: str, sources: list[tuple[str, dict]]):
    """(name, JSON) of each result file matching the glob `pattern`, in name order; each is added to `sources`."""
    for path in sorted(results.glob(pattern)):
        d = load(path.name, results)
        sources.append((path.name, d))
        yield path.name, d


def table_families_4k(results: Path) -> str:
    """Peak and final KV at 4K per newer family (tiny aliases), full against block-wise."""
    body, sources = [], []
    for alias, d in _family_results(results, "memory_image_{alias}.json", sources):
        at = {r["method"]: r for r in d["rows"] if r["size"] == max(x["size"] for x in d["rows"])}
        full, bw = at["full"], at["blockwise-snapkv"]
        post = at.get("post-snapkv")
        peaks = " / ".join(_mib(r["peak_kv_bytes"]) for r in (full, post, bw) if r is not None)
        body.append(
            [
                alias,
                f"{full['visual_tokens']:,}",
                peaks,
                _x(full["peak_kv_bytes"] / bw["peak_kv_bytes"]),
                _x(full["final_kv_bytes"] / bw["final_kv_bytes"]),
            ]
        )
    header = ["tiny alias", "visual tokens", "peak KV full / post-snapkv / block-wise", "full / block-wise, peak"]
    return _render([*header, "full / block-wise, final"], body, sources)


def table_families_fidelity(results: Path) -> str:
    """Block-by-block prefill with nothing evicted against one whole prefill, per newer family (tiny aliases):
    the worst over the methods the JSON holds."""
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
    return _render([*header, "greedy tokens equal (min)", "methods"], body, sources)


def table_families_latency(results: Path) -> str:
    """TTFT of full, forced block-wise and hybrid prefill at 4K per newer family (tiny aliases)."""
    body, sources = [], []
    for alias, d in _family_results(results, "latency_image_{alias}.json", sources):
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
    return _render([*header, "block-wise / full, hybrid / full (min)", "(paired median)"], body, sources)


def table_memory_guard(results: Path) -> str:
    """The memory guard's estimate against measured memory (scripts/guard_check.py)."""
    return _memory_guard_rows(results, "memory_guard_cpu.json")


def table_memory_guard_families(results: Path) -> str:
    """The same on every family's tiny model, where a small tower makes the pixel copies show."""
    return _memory_guard_rows(results, "memory_guard_families_cpu.json")


def table_memory_guard_video(results: Path) -> str:
    """The same on a video (assets/example_video.webm), the bench model and every family's tiny model."""
    return _memory_guard_rows(results, "memory_guard_video_cpu.json")


def _memory_guard_rows(results: Path, name: str) -> str:
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
    return _render(header, body, [(name, d)])


def table_load(results: Path) -> str:
    """Eight sessions at once through the app's API (tests/test_load.py, recorded with VISUALKV_RECORD=1)."""
    name = "load_8_sessions.json"
    d = load(name, results)
    body = [
        [
            f"{d['sessions']} × {d['turns_per_session']}",
            f"{d['wall_seconds']:.1f} s",
            f"{d['server_rss_before_bytes'] / MIB:,.0f} MiB",
            f"{d['server_rss_peak_bytes'] / MIB:,.0f} MiB",
            f"{d['server_rss_after_close_bytes'] / MIB:,.0f} MiB",
            f"{d['after_over_before']:.3f}×",
        ]
    ]
    header = ["sessions × turns", "wall", "server RSS before", "peak", "after every session closed", "after / before"]
    return _render(header, body, [(name, d)])


DEMO_TRAINING = ROOT / "assets" / "visualkv-demo" / "training.json"


def table_demo_training(results: Path) -> str:
    """The demo model's training phases, from the log the training script wrote (scripts/train_demo.py)."""
    with open(DEMO_TRAINING) as fh:
        d = json.load(fh)
    phases = [k for k in d if k.startswith("phase")]
    kinds = ("color", "count", "presence", "quadrant", "when")
    body = []
    for phase in phases:
        p = d[phase]
        last = p["history"][-1]
        acc = last.get("tf_acc", {})
        body.append(
            [
                phase.removeprefix("phase"),
                str(p.get("stop_at_step") or last["step"]),
                f"{p['seconds'] / 60:.0f}",
                f"{last['loss']:.3f}",
                *(f"{acc[k] * 100:.0f} %" if k in acc else "—" for k in kinds),
            ]
        )
    params = {p["params"] for p in (d[k] for k in phases)}
    minutes = sum(d[k]["seconds"] for k in phases if k[len("phase")] in "123") / 60
    note = (
        f"{', '.join(f'{n:,}' for n in sorted(params))} parameters; phases 1-3 took {minutes:.0f} min and phase 4 "
        f"{sum(d[k]['seconds'] for k in phases if k.startswith('phase4')) / 60:.0f} min of wall-clock, one thread "
        f"per run (`threads` {', '.join(sorted({str(d[k]['args']['threads']) for k in phases}))}) on shared CPU "
        "cores. Accuracy per answer kind: teacher-forced answer tokens at the last log of each phase, on fresh training "
        "samples (not held out); phases 1-2 logged it with a bug that overstates it (the log's own note)."
    )
    header = ["phase", "steps", "minutes", "loss", *kinds]
    rel = DEMO_TRAINING.relative_to(ROOT)
    source = (
        f"Source: [`{rel.name}`]({rel}): `python scripts/train_demo.py` with each phase's arguments (stored in the "
        "file), one thread per run on shared CPU cores."
    )
    return "\n\n".join(["\n".join(_table(header, body)), note, source])


LONG_VIDEO_RESULTS = "memory_long_video_tiny-qwen2.5-vl.json"


def _clock_minutes(minutes: float) -> str:
    return f"{minutes:g} min"


def table_long_video(results: Path) -> str:
    """Hour-scale generated videos (`bench memory --video --minutes`): memory per length, each run in its own
    process; a refused run shows its reason."""
    d = load(LONG_VIDEO_RESULTS, results)
    lengths = sorted({r["minutes"] for r in d["rows"]})
    body = []
    for key, summary in d["summary"].items():
        kind, method = key.split("/", 1)
        rows = {r["minutes"]: r for r in d["rows"] if r["video_kind"] == kind and r["method"] == method}
        cells = []
        for m in lengths:
            r = rows.get(m)
            if r is None:
                cells.append("")
            elif "refused" in r:
                cells.append(f"refused ({r['frames']} frames)")
            else:
                cells.append(f"{_mib(r['peak_kv_bytes'])} / {r['peak_rss_bytes'] / MIB:.0f} MiB")
        longest = rows[max(summary["measured_minutes"])] if summary.get("measured_minutes") else None
        growth = summary.get("growth_minutes")
        body.append(
            [
                kind,
                f"`{method}`",
                *cells,
                f"{summary['peak_rss_growth'] * 100:+.1f} %" if growth else "",
                f"{summary['peak_kv_spread'] * 100:.1f} %" if growth else "",
                _mib(longest["final_kv_bytes"]) if longest else "",
                f"{longest['visual_tokens']:,}" if longest else "",
                f"{summary['ttft_seconds_per_hour']:.0f} s" if longest else "",
            ]
        )
    growth_from = d.get("growth_from_minutes") or lengths[0]
    header = ["video", "method", *(f"{_clock_minutes(m)}: peak KV / peak RSS" for m in lengths)]
    header += [
        f"peak RSS growth {_clock_minutes(growth_from)} → {_clock_minutes(lengths[-1])}",
        f"peak KV spread ({_clock_minutes(growth_from)} on)",
        "final KV (longest)",
        "visual tokens (longest)",
        "TTFT per hour of video",
    ]
    note = (
        f"Model `{d['model']}`, M = {d['budget']}, {d['fps']:g} frame per second of 640x360 video; `mix`: static "
        "shots, pans, cuts and a one-second event every two minutes, `moving`: every frame moves (nothing to skip)."
    )
    return _render(header, body, [(LONG_VIDEO_RESULTS, d)], note)


COMPOSE_RATIO_RESULTS = ("compose_ratio_tiny-qwen2.5-vl.json", "compose_ratio_bench-qwen2.5-vl.json")


def table_compose_ratio(results: Path) -> str:
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
                    _mib(r["alone"]["final_kv_bytes"]),
                    _mib(r["composed"]["final_kv_bytes"]),
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
    return _render(header, body, sources, note)


NEEDLE_COMPOSE_RESULTS = "needle_compose/needle.json"


def table_needle_compose(results: Path) -> str:
    """Needle-video accuracy (demo model) and KV held: block-wise KeyDiff alone against composed with Sali-Cache."""
    d = load(NEEDLE_COMPOSE_RESULTS, results)
    alone, composed = d["methods"][0], d["methods"][-1]
    body = []
    fractions = sorted({r["budget_fraction"] for r in d["results"] if r["method"] == alone})
    for fraction in fractions:
        for question in sorted({r["question"] for r in d["results"]}):
            a = next(
                r
                for r in d["results"]
                if r["method"] == alone and r["budget_fraction"] == fraction and r["question"] == question
            )
            c = next(
                r
                for r in d["results"]
                if r["method"] == composed and r["budget_fraction"] == fraction and r["question"] == question
            )
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
    return _render(header, body, [(NEEDLE_COMPOSE_RESULTS, d)], f"n = {n} held-out needle videos per row.")


def table_vision_launches(results: Path) -> str:
    """Operations a released Qwen vision tower dispatches per input: transformers' per-window loop vs batched
    chunks (scripts/vision_launches.py, widths scaled down, structure as released)."""
    body, sources = [], []
    for _, d in _matching_results(results, "vision_launches_*.json", sources):
        for r in d["rows"]:
            stock, batched = r["stock"], r["batched"]
            body.append(
                [
                    f"`{d['shape']}`",
                    f"{r['input']} ({r['patches']:,} patches)",
                    f"{stock['ops']:,} → {batched['ops']:,} ({batched['ops'] / stock['ops']:.2f}×)",
                    f"{stock['attention_calls']:,} → {batched['attention_calls']:,}",
                    f"{stock['host_reads']} → {batched['host_reads']}",
                    f"{r['cpu_seconds_median']['stock']:.1f} → {r['cpu_seconds_median']['batched']:.1f}",
                    f"{r['max_abs_difference']:.1e}",
                ]
            )
    header = ["tower", "input", "dispatched ops (≈ GPU kernel launches)", "attention calls", "host reads"]
    header += ["CPU s at the scaled width", "max abs difference"]
    widths = ", ".join(sorted({str(d["vision"]["hidden_size_scaled_to"]) for _, d in sources}))
    note = (
        f"Depth, heads, patch, windows and full-attention layers as released; hidden size scaled to {widths} "
        "(MLP alike) so the tower runs on a CPU: counts depend on the structure and the input only. At that width "
        "the CPU time is compute, not dispatch, and does not show the saving; launches are what a GPU pays for."
    )
    return _render(header, body, sources, note)


FRAME_RESIZE_RESULTS = "frame_resize_memory.json"


def table_frame_resize(results: Path) -> str:
    """Peak RSS of a block-wise prefill of a 1080p video: frames at their decoded size against frames resized at
    decode (scripts/frame_resize_memory.py, one fresh process per run)."""
    d = load(FRAME_RESIZE_RESULTS, results)
    body = []
    for model in dict.fromkeys(r["model"] for r in d["rows"]):
        runs = {r["run"]: r for r in d["rows"] if r["model"] == model}
        plain, resized = runs["decoded size"], runs["resized at decode"]
        read = resized["frame_read_by_vision"]
        body.append(
            [
                f"`{model}`",
                f"{read[1]}×{read[0]}" + ("" if read != resized["decoded_frame"] else " (not resized)"),
                f"{resized['visual_tokens']:,}",
                f"{resized['per_token_table_bytes_per_visual_token']:.0f} B",
                " / ".join(f"{r['peak_growth_bytes'] / MIB:.0f} MiB" for r in (plain, resized)),
                f"{(resized['peak_growth_bytes'] - plain['peak_growth_bytes']) / plain['peak_growth_bytes'] * 100:+.0f} %",
            ]
        )
    v = d["video"]
    header = ["model", "frame the vision side reads", "visual tokens", "per-token tables per visual token"]
    header += ["peak RSS growth: decoded size / resized at decode", "change"]
    note = (
        f"`{d['method']}`, M = {d['budget']}, {v['seconds']} s of {v['width']}x{v['height']} video ({v['kind']}: every "
        f"frame pans) at {v['fps']:g} fps, decoded lazily; peak RSS growth over the prefill and the first token, after "
        "a warm-up, in a fresh process per run. *Decoded size*: `resize_video_at_decode` off. Per-token tables: the "
        "prepared input's ids, positions and masks and the layout, text tokens' share included."
    )
    return _render(header, body, [(FRAME_RESIZE_RESULTS, d)], note)


def table_prefill_launches(results: Path) -> str:
    """Operations a whole prefill dispatches, transformers' generate against each method (scripts/prefill_launches.py)."""
    body, sources = [], []
    for _, d in _matching_results(results, "prefill_launches_*.json", sources):
        ref = d["rows"][0]
        for r in d["rows"]:
            blocks = f"{r.get('blocks')} block{'' if r.get('blocks') == 1 else 's'}"
            ahead = f", vision ahead {r['vision_ahead']}" if r.get("vision_ahead", 1) > 1 else ""
            label = r["case"] if "prefill" not in r else f"`{r['case']}` ({r['prefill']}, {blocks}{ahead})"
            kernels = f"{r['kernels']:,} ({r['kernels'] / ref['kernels']:.2f}×)" if "kernels" in r else "n/a"
            parts = r.get("kernels_by_part")
            split = " / ".join(f"{n:,}" for n in parts.values()) if parts else "n/a"
            body.append(
                [
                    f"`{d['shape']}`, "
                    + (f"{d['image']} image" if d.get("image") else f"video, {d['video_frames']} frames 640x360"),
                    label,
                    f"{r['ops']:,} ({r['ops'] / ref['ops']:.2f}×)",
                    kernels,
                    split,
                    f"{r['attention_calls']:,}",
                ]
            )
    header = [
        "model, input",
        "case",
        "dispatched ops to the first token (vs generate)",
        "of which launch a GPU kernel (not views)",
        "kernels: vision tower / decoder layers / rest",
        "attention calls",
    ]
    structures = {}  # per shape, as its first file records it
    for _, d in sources:
        structures.setdefault(d["shape"], (d["structure"], d.get("budget")))
    shapes = "; ".join(
        f"`{shape}`: {st.get('text_layers')} LLM layers, {st.get('vision_blocks')} vision blocks, "
        f"{st.get('heads')} heads / {st.get('kv_heads')} KV heads, LLM {st.get('text_width')} wide, vision "
        f"{st.get('vision_width')}, M = {budget}"
        for shape, (st, budget) in structures.items()
    )
    note = (
        f"Released depths and layer structure (windows, GQA or none, as released) at narrow widths ({shapes}); "
        "processor, vision tower, prefill and first logits. Counts depend on the structure "
        "and the input, not on the widths: every dispatched op costs host time, the kernel-launching ones also a "
        "GPU launch (what a launch-bound GPU pays for). The rest: the method's scoring and eviction, the cache, "
        "embeddings, and host-side work (processor, block plans) that launches nothing on a GPU."
    )
    return _render(header, body, sources, note)


PACKED_DECODE_RESULTS = "packed_decode_shape-qwen2.5-vl-7b.json"


def table_packed_decode(results: Path) -> str:
    """One decode step's attention per layer over Sali-Cache's packed tiers, dequantized through float32 and by one
    addcmul per tensor into one buffer (what a step runs), beside `full` (scripts/packed_decode.py)."""
    d = load(PACKED_DECODE_RESULTS, results)
    bf16_weights = d["decoder_weight_bytes_bf16"]
    body = []
    for dtype in dict.fromkeys(r["dtype"] for r in d["rows"]):
        weights = bf16_weights * {"float32": 2, "bfloat16": 1, "float16": 1}[dtype]
        rows = [r for r in d["rows"] if r["dtype"] == dtype]
        full = next(r for r in rows if r["case"] == "full")
        for r in rows:
            step = r["bytes_moved_per_token"] + weights
            difference = r.get("max_abs_difference")
            body.append(
                [
                    dtype,
                    f"`{r['case']}`",
                    _mib(r["kv_bytes_held_per_layer"]),
                    f"{r['bytes_moved_per_layer'] / MIB:.1f} MiB ({r['bytes_moved_per_layer'] / full['bytes_moved_per_layer']:.2f}×)",
                    f"{r['kernels_per_layer']} ({r['kernels_per_layer'] / full['kernels_per_layer']:.1f}×)",
                    f"{r['cpu_ms_per_layer_median']:.1f}",
                    "n/a" if difference is None else f"{difference:.1e}",
                    _x(step / (full["bytes_moved_per_token"] + weights)),
                ]
            )
    header = [
        "dtype",
        "case",
        "KV held per layer",
        "bytes its kernels move per layer (vs full)",
        "kernels per layer (vs full)",
        "CPU ms per layer",
        "max abs difference",
        "a step's bytes with the weights, vs full",
    ]
    a, t = d["attention"], d["tiers"]
    note = (
        f"`{d['shape']}`'s attention ({a['kv_heads']} KV heads, {a['query_group']} query heads each, head_dim "
        f"{a['head_dim']}, {a['layers']} layers) over the entries Sali-Cache keeps of a 4K image ({d['visual_tokens']:,} "
        f"visual tokens: {t['full']:,} full precision, {t['int8']:,} INT8, {t['int4']:,} INT4, {t['pruned']:,} pruned; "
        f"`full` holds them all) and {d['text_tokens']} text tokens: one new token's attention in one layer. Bytes: "
        "what the kernels read and write (`OpCounter.bytes_moved`; an operand of another dtype counted once, as a CUDA "
        "kernel casts it as it reads, where a CPU copies it first); the last column adds, over "
        f"{a['layers']} layers, the decoder weights every step reads ({bf16_weights / 1e9:.1f} GB in bfloat16). "
        "bfloat16 is the GPU case; there a step of this size pays a few microseconds per kernel as well as its "
        "bytes, so both are shown. "
        "CPU ms: median of interleaved repeats, one thread, this CPU (bfloat16 matmuls are slow on it). Max abs "
        "difference: from float32 attention over the exact quantized values."
    )
    bf16 = {r["case"]: r for r in d["rows"] if r["dtype"] == "bfloat16"}
    summary = ""
    if {"full", "salicache", "salicache, float32 dequantize"} <= set(bf16):
        full, addcmul, chain = bf16["full"], bf16["salicache"], bf16["salicache, float32 dequantize"]

        def step(r: dict) -> float:
            return (r["bytes_moved_per_token"] + bf16_weights) / (full["bytes_moved_per_token"] + bf16_weights)

        summary = (
            f"In bfloat16 a Sali-Cache step's attention moves {addcmul['bytes_moved_per_layer'] / full['bytes_moved_per_layer']:.1f}× "
            f"`full`'s bytes in {addcmul['kernels_per_layer'] / full['kernels_per_layer']:.1f}× its kernels (dequantizing "
            f"through float32: {chain['bytes_moved_per_layer'] / full['bytes_moved_per_layer']:.1f}× in "
            f"{chain['kernels_per_layer'] / full['kernels_per_layer']:.1f}×); with the weights, a bandwidth-bound step "
            f"moves {step(addcmul):.2f}× `full`'s bytes ({step(chain):.2f}× through float32)."
        )
    sources = [(PACKED_DECODE_RESULTS, d)]
    return _render(header, body, sources, *(n for n in (note, summary) if n))


GPU_RESULTS = "gpu/gpu_shape-qwen2.5-vl-7b.json"
GPU_NO_WARMUP_RESULTS = "gpu/gpu_shape-qwen2.5-vl-7b.no-warmup.json"  # the same bench measured from a cold process


def table_gpu(results: Path) -> str:
    """`bench gpu` on shape-qwen2.5-vl-7b: its own table and the GPU targets judged on its rows."""
    from visualkv.bench import gpu, gpu_targets  # torch and the models: only when this table is drawn

    d = load(GPU_RESULTS, results)
    note = (
        f"torch {d['torch']}, transformers {d['transformers']}; the model built in {d['load_seconds']:.1f} s "
        f"({d['weights_bytes'] / 2**30:.2f} GiB of bf16 weights); every case run once untimed first "
        f"({d['warmup_seconds']:.0f} s)."
    )
    targets = _without_first_column(gpu_targets.markdown(d), "issue")
    return "\n\n".join([gpu.markdown_table(d), targets, note, source_line((GPU_RESULTS, d))])


def _without_first_column(markdown: str, header: str) -> str:
    """`markdown` with the first column of its table dropped where that column is `header` (the targets table's
    tracker column: the target itself says what is judged)."""
    lines = markdown.split("\n")
    if not lines or not lines[0].startswith(f"| {header} |"):
        return markdown
    out = []
    for line in lines:
        out.append("|" + line.split("|", 2)[2] if line.startswith("|") else line)
    return "\n".join(out)


HEADLINE_METHODS = ("transformers-generate", "full", "blockwise-keydiff", "salicache", "lightkv")


def table_headline(results: Path) -> str:
    """README's headline: on one GPU and a 7B shape, what each method holds, how soon it answers and how fast it
    decodes, each beside transformers' own `generate` on the same input (from `bench gpu`'s JSON)."""
    d = load(GPU_RESULTS, results)
    body = []
    for row in d["cases"]:
        if row.get("case", row["method"]) not in HEADLINE_METHODS or "ttft_seconds" not in row:
            continue
        vs = row["vs_generate"]
        what = "4K image" if row["input"] == "image" else f"{row['video_seconds']:g}-s video"
        decode = f"{row['decode_tokens_per_second']:.0f}"
        body.append(
            [
                f"{what} ({row['visual_tokens']:,} visual tokens)",
                f"`{row['method']}`",
                f"{row['peak_over_weights_bytes'] / MIB:,.0f} MiB ({vs['peak_over_weights_bytes']:.3f}×)",
                f"{row['ttft_seconds']:.2f} s ({vs['ttft_seconds']:.2f}×)",
                f"{decode} tok/s ({vs['decode_tokens_per_second']:.1f}×)",
            ]
        )
    cfg, info = d["config"], d["model_info"]
    header = ["input", "method", "GPU peak over the weights (vs generate)", "time to first token", "decode"]
    note = (
        f"`{cfg['model']}`: {info['layers']} decoder layers, {info['kv_heads']} KV heads, the released configuration "
        f"with random {info['dtype']} weights (memory and speed only; answers are noise), on {d['machine']}; torch "
        f"{d['torch']}, transformers {d['transformers']}. Budget M = {cfg['budget']} visual entries per layer and KV "
        f"head, {cfg['new_tokens']} new tokens, every case once untimed first, the CUDA peak reset before each; "
        "`transformers-generate` is transformers' own processor and `model.generate`. Every method and variant: "
        "docs/RESULTS.md."
    )
    return _render(header, body, [(GPU_RESULTS, d)], note)


def table_gpu_warmup(results: Path) -> str:
    """The first cases of a cold process pay one-off CUDA costs: the same bench without and with the warm-up."""
    cold, warm = load(GPU_NO_WARMUP_RESULTS, results), load(GPU_RESULTS, results)

    def rows(d: dict[str, Any]) -> dict[str, dict]:
        return {(r["input"], r.get("case", r["method"])): r for r in d["cases"] if "ttft_seconds" in r}

    cold_rows, warm_rows = rows(cold), rows(warm)
    body = []
    for key, c in list(cold_rows.items())[:3]:  # the first three cases ran cold; later ones were warm anyway
        w = warm_rows[key]
        body.append(
            [
                f"{key[0]}, {key[1]}",
                f"{c['ttft_seconds']:.2f} s",
                f"{w['ttft_seconds']:.2f} s",
                f"{c['decode_tokens_per_second']:.1f}",
                f"{w['decode_tokens_per_second']:.1f}",
            ]
        )
    header = ["first cases of the run", "TTFT cold", "TTFT warmed up", "decode tok/s cold", "warmed up"]
    return _render(header, body, [(GPU_NO_WARMUP_RESULTS, cold), (GPU_RESULTS, warm)])


BLOCK_ATTENTION_RESULTS = ("block_attention_7b_cpu_float32.json", "block_attention_7b_cpu_bfloat16.json")


def table_block_attention(results: Path) -> str:
    """One layer's attention for a block after cached entries: transformers' function with a mask (K/V repeated
    to every query head) against `block_attention` (scripts/block_attention.py), per dtype and case."""
    sources = [(name, load(name, results)) for name in BLOCK_ATTENTION_RESULTS]
    body = []
    for _, d in sources:
        for (q, n_past), rows in _grouped(d["rows"], lambda r: (r["q"], r["n_past"])).items():
            stock, ours = (next(r for r in rows if r["kernel"] == k) for k in ("transformers", "visualkv"))
            body.append(
                [
                    d["dtype"],
                    f"{q:,} after {n_past:,}",
                    f"{_mib(stock['kv_bytes'])}",
                    f"{stock['transient_bytes'] / MIB:,.1f} → {ours['transient_bytes'] / MIB:,.1f} MiB",
                    f"{stock['median_ms']:,.0f} → {ours['median_ms']:,.0f} ({_x(ours['median_ms'] / stock['median_ms'])})",
                    f"{ours['max_abs_diff']:.1e}",
                ]
            )
    geo = sources[0][1]["geometry"]
    header = [
        "dtype",
        "queries after entries",
        "K + V of the layer",
        "transient of one call",
        "ms per call",
        "max abs difference",
    ]
    note = (
        f"`{sources[0][1]['shape']}`'s attention ({geo['heads']} query heads, {geo['kv_heads']} KV heads, head_dim "
        f"{geo['head_dim']}), one layer, random entries: transformers' `sdpa_attention_forward` with the lower-right "
        "bool mask → `block_attention.attend` (this CPU: the same mask with `enable_gqa`). Transient: the "
        "growth of the peak RSS of a fresh process over its inputs for one call. ms: median of 5 interleaved repeats. "
        "1,024 after 1,024 is a block-wise block at M = 1024; 16 after 10,565 / 76,544 a follow-up question over "
        "`full`'s cache of a 4K image / the 512-s video."
    )
    return _render(header, body, sources, note)


#: times from a run with glibc's default allocator, memory from one with its mmap threshold pinned (`--pin-mmap`)
FOLLOWUP_ATTENTION_RESULTS = (
    "followup_attention_bench-qwen2.5-vl.json",
    "followup_attention_bench-qwen2.5-vl_pinned.json",
)


def table_followup_attention(results: Path) -> str:
    """A follow-up question end to end: a dense mask tensor (transformers' path) against the lower-right marker
    (scripts/followup_attention.py): TTFT from the default run, peak RSS growth from the pinned one."""
    timed, pinned = (load(name, results) for name in FOLLOWUP_ATTENTION_RESULTS)
    cases = (("tensor mask", "tensor mask"), ("lower-right marker", "marker"))
    body = [
        [
            label,
            f"{timed['summary'][case]['entries_per_layer']:,}",
            f"{timed['summary'][case]['followup_ttft_median_s']:.3f} s",
            f"{pinned['summary'][case]['followup_rss_growth_median_bytes'] / MIB:,.1f} MiB",
        ]
        for label, case in cases
    ]
    header = ["follow-up attention", "entries per layer after", "TTFT (median)", "peak RSS growth of the turn (median)"]
    ttft = {case: timed["summary"][case]["followup_ttft_median_s"] for _, case in cases}
    runs = sum(len(r["followup_ttft_s"]) for r in timed["runs"]["marker"])
    note = (
        f"`{timed['model']}`, `{timed['method']}` over a {timed['image']} synthetic image, then {runs} follow-up "
        "questions per case, two sessions alternating in one process (fresh each repeat): the marker's follow-up TTFT "
        f"is {_x(ttft['marker'] / ttft['tensor mask'])} of the tensor mask's. The RSS growth comes from a second run "
        "with glibc's mmap threshold pinned at 64 KiB (otherwise glibc serves a turn's transients from memory earlier "
        "turns freed, and neither case shows any); its times are not used (every large allocation then costs fresh "
        "pages)."
    )
    return _render(header, body, [(name, d) for name, d in zip(FOLLOWUP_ATTENTION_RESULTS, (timed, pinned))], note)


def _grouped(rows: list[dict], key: Callable[[dict], Any]) -> dict[Any, list[dict]]:
    out: dict[Any, list[dict]] = {}
    for row in rows:
        out.setdefault(key(row), []).append(row)
    return out


#: tables computed from the code (no benchmark JSON): their source line says so
COMPUTED = {"lightkv-schedule", "salicache-bytes"}

TABLES: dict[str, Callable[[Path], str]] = {
    "memory-image": table_memory_image,
    "latency-image": table_latency_image,
    "fidelity": table_fidelity,
    "memory-video": table_memory_video,
    "salicache": table_salicache,
    "salicache-variants": table_salicache_variants,
    "salicache-bytes": table_salicache_bytes,
    "lightkv": table_lightkv,
    "lightkv-schedule": table_lightkv_schedule,
    "demo-training": table_demo_training,
    "needle": table_needle,
    "needle-eviction": table_needle_eviction,
    "needle-video": table_needle_video,
    "needle-salicache-lightkv": table_needle_salicache_lightkv,
    "needle-by-kind": table_needle_by_kind,
    "families-4k": table_families_4k,
    "families-fidelity": table_families_fidelity,
    "families-latency": table_families_latency,
    "memory-guard": table_memory_guard,
    "memory-guard-families": table_memory_guard_families,
    "memory-guard-video": table_memory_guard_video,
    "load": table_load,
    "long-video": table_long_video,
    "compose-ratio": table_compose_ratio,
    "needle-compose": table_needle_compose,
    "vision-launches": table_vision_launches,
    "prefill-launches": table_prefill_launches,
    "packed-decode": table_packed_decode,
    "block-attention": table_block_attention,
    "followup-attention": table_followup_attention,
    "frame-resize": table_frame_resize,
    "headline": table_headline,
    "gpu": table_gpu,
    "gpu-warmup": table_gpu_warmup,
}


# -- documents -------------------------------------------------------------------------------------
def render_document(text: str, results: Path = RESULTS, in_docs: bool = False) -> str:
    """`text` with every marked block regenerated (unknown table names raise KeyError).

    in_docs: the document lives in docs/, so links to the JSON are relative to it."""

    def sub(m: re.Match) -> str:
        table = TABLES[m.group(2)](results)
        if in_docs:
            table = table.replace("](docs/results/", "](results/").replace("](assets/", "](../assets/")
        return f"{m.group(1)}{table}\n{m.group(4)}"

    return _BLOCK.sub(sub, text)


def blocks_in(text: str) -> list[str]:
    return [m.group(2) for m in _BLOCK.finditer(text)]


def check_documents(root: Path = ROOT, results: Path = RESULTS) -> list[str]:
    """Names ("README.md: memory-image") of generated blocks that disagree with the JSON."""
    stale = []
    for doc in DOCUMENTS:
        path = root / doc
        if not path.exists():
            continue
        text = path.read_text()
        fresh = render_document(text, results, in_docs=doc.startswith("docs/"))
        if fresh != text:
            old = {m.group(2): m.group(3) for m in _BLOCK.finditer(text)}
            new = {m.group(2): m.group(3) for m in _BLOCK.finditer(fresh)}
            stale += [f"{doc}: {name}" for name in old if old[name] != new.get(name)]
    return stale


def write_documents(root: Path = ROOT, results: Path = RESULTS) -> list[str]:
    """Regenerate every marked block in place; returns the documents that changed."""
    changed = []
    for doc in DOCUMENTS:
        path = root / doc
        if not path.exists():
            continue
        text = path.read_text()
        fresh = render_document(text, results, in_docs=doc.startswith("docs/"))
        if fresh != text:
            path.write_text(fresh)
            changed.append(doc)
    return changed


# -- prose -----------------------------------------------------------------------------------------
#: a tracker reference in prose ("issue 11", "issues 11 and 14", "PR #3", "#12"): history belongs in git
ISSUE_REFERENCE = re.compile(r"\b(?:issues?|PR|pull request)\s*#?\d+|(?<![\w/&#])#\d+\b", re.IGNORECASE)
README_MAX_LINES = 400


def prose_of(text: str) -> str:
    """`text` with the content of every generated block left out (the blocks' markers stay), line count kept."""
    return _BLOCK.sub(lambda m: m.group(1) + "\n" * m.group(3).count("\n") + m.group(4), text)


def issue_references(root: Path = ROOT) -> list[str]:
    """ "doc:line: text" for each line of the documents' own prose (generated blocks aside) that cites a tracker
    number."""
    found = []
    for doc in DOCUMENTS:
        path = root / doc
        if not path.exists():
            continue
        for number, line in enumerate(prose_of(path.read_text()).splitlines(), start=1):
            if ISSUE_REFERENCE.search(line):
                found.append(f"{doc}:{number}: {line.strip()}")
    return found
