"""Operations dispatched (≈ GPU kernel launches) by a released model's structure at narrow widths: the vision
tower per window against batched (scripts/vision_launches.py) and a whole prefill per method
(scripts/prefill_launches.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from visualkv.bench.tables.format import matching_results, render
from visualkv.bench.tables.measured import METHODS, PREFILL, SESSION, paths


def vision_tower_launches(results: Path) -> str:
    """Operations a released Qwen vision tower dispatches per input: transformers' per-window loop vs batched
    chunks (scripts/vision_launches.py, widths scaled down, structure as released)."""
    body, sources = [], []
    for _, d in matching_results(results, "vision_launches_*.json", sources):
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
    return render(header, body, sources, note)


def _prefill_row(d: dict[str, Any], r: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """One case of one file: its ops and kernels, each over transformers' generate's (`ref`)."""
    blocks = f"{r.get('blocks')} block{'' if r.get('blocks') == 1 else 's'}"
    ahead = f", vision ahead {r['vision_ahead']}" if r.get("vision_ahead", 1) > 1 else ""
    label = r["case"] if "prefill" not in r else f"`{r['case']}` ({r['prefill']}, {blocks}{ahead})"
    kernels = f"{r['kernels']:,} ({r['kernels'] / ref['kernels']:.2f}×)" if "kernels" in r else "n/a"
    parts = r.get("kernels_by_part")
    split = " / ".join(f"{n:,}" for n in parts.values()) if parts else "n/a"
    return [
        f"`{d['shape']}`, "
        + (f"{d['image']} image" if d.get("image") else f"video, {d['video_frames']} frames 640x360"),
        label,
        f"{r['ops']:,} ({r['ops'] / ref['ops']:.2f}×)",
        kernels,
        split,
        f"{r['attention_calls']:,}",
    ]


def _prefill_shapes(sources: list[tuple[str, dict]]) -> str:
    """Each shape's structure and budget, as its first file records it."""
    structures = {}
    for _, d in sources:
        structures.setdefault(d["shape"], (d["structure"], d.get("budget")))
    return "; ".join(
        f"`{shape}`: {st.get('text_layers')} LLM layers, {st.get('vision_blocks')} vision blocks, "
        f"{st.get('heads')} heads / {st.get('kv_heads')} KV heads, LLM {st.get('text_width')} wide, vision "
        f"{st.get('vision_width')}, M = {budget}"
        for shape, (st, budget) in structures.items()
    )


def prefill_launches(results: Path) -> str:
    """Operations a whole prefill dispatches, transformers' generate against each method (scripts/prefill_launches.py)."""
    body, sources = [], []
    for _, d in matching_results(results, "prefill_launches_*.json", sources):
        body += [_prefill_row(d, r, d["rows"][0]) for r in d["rows"]]
    header = [
        "model, input",
        "case",
        "dispatched ops to the first token (vs generate)",
        "of which launch a GPU kernel (not views)",
        "kernels: vision tower / decoder layers / rest",
        "attention calls",
    ]
    note = (
        f"Released depths and layer structure (windows, GQA or none, as released) at narrow widths "
        f"({_prefill_shapes(sources)}); processor, vision tower, prefill and first logits. Counts depend on the structure "
        "and the input, not on the widths: every dispatched op costs host time, the kernel-launching ones also a "
        "GPU launch (what a launch-bound GPU pays for). The rest: the method's scoring and eviction, the cache, "
        "embeddings, and host-side work (processor, block plans) that launches nothing on a GPU."
    )
    return render(header, body, sources, note)


TABLES = {
    "vision-launches": vision_tower_launches,
    "prefill-launches": prefill_launches,
}
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "vision-launches": ("visualkv/attention/vision.py", "visualkv/attention/patch.py"),
    "prefill-launches": paths(PREFILL, SESSION, METHODS),
}
