"""Sali-Cache (`bench salicache`): KV held, TTFT and answers against `full`, its variants, and the bytes each
precision tier costs (computed from the code)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from visualkv.bench.provenance import machine_label
from visualkv.bench.tables.format import load, render, render_with_source, times
from visualkv.bench.tables.measured import DECODE, FULL, PREFILL, SALICACHE, SESSION, paths

TIER_KEYS = ("skipped", "pruned", "int4", "int8", "full")
SALICACHE_RESULTS = (
    "salicache_tiny-qwen2.5-vl.json",
    "salicache_bench-qwen2.5-vl.json",
    "salicache_tiny-smolvlm2.json",
)
#: (label, dtype, head_dim) of the Sali-Cache bytes table (the 7B's head_dim from its config.json)
SALICACHE_BYTES_MODELS = (("tiny-*", "float32", "tiny-qwen2.5-vl"), ("bench-*", "float32", "bench-qwen2.5-vl"))


def _greedy_agreement(d: dict[str, Any]) -> str:
    g = d["greedy_agreement"]
    return (
        f"{round(g['positionwise'] * g['compared'])} / {g['compared']}"
        f" (first-token cosine {d['first_token_logits']['cosine']:.3f})"
    )


def _tier_split(d: dict[str, Any]) -> str:
    f = d["tier_fractions"]
    return " / ".join(f"{f[k] * 100:.1f}" for k in TIER_KEYS)


def _ttft_ratio(d: dict[str, Any]) -> str:
    return (
        f"**{d['ttft_ratio_salicache_over_full']:.2f}** "
        f"({d['ttft_seconds']['salicache']:.2f} s / {d['ttft_seconds']['full']:.2f} s)"
    )


#: (row label, cell of one model's JSON) of `salicache_against_full`
SALICACHE_ROWS = (
    ("**final KV bytes, full / salicache**", lambda d: f"**{d['kv_ratio_full_over_salicache']:.2f}×**"),
    ("**TTFT salicache / full** (one process)", _ttft_ratio),
    ("greedy tokens equal to `full`", _greedy_agreement),
    (
        "vision encoder calls (Qwen: temporal patches; SmolVLM: frames)",
        lambda d: f"{d['vision_encoder_frames']['salicache']} of {d['vision_encoder_frames']['full']}",
    ),
    (
        "final KV bytes: full / salicache",
        lambda d: f"{d['final_kv_bytes']['full']:,} / {d['final_kv_bytes']['salicache']:,} B",
    ),
    ("tier split, % of visual tokens: skipped / pruned / INT4 / INT8 / FP", _tier_split),
    ("run", lambda d: machine_label(d.get("provenance"))),
)


def salicache_against_full(results: Path) -> str:
    """One column per model: KV ratio, TTFT ratio, greedy agreement, vision calls and the tier split."""
    names = [n for n in SALICACHE_RESULTS if (results / n).exists()]
    data = [load(n, results) for n in names]
    paper = data[0]["paper_tier_fractions"] if data else {}
    rows = [[label, *(f(d) for d in data)] for label, f in SALICACHE_ROWS]
    notes = (
        ["Paper's split (LLaVA-1.6-Mistral-7B): " + " / ".join(f"{paper[k] * 100:.1f}" for k in TIER_KEYS) + "."]
        if paper
        else []
    )
    return render(["figure", *(d["model"] for d in data)], rows, list(zip(names, data)), *notes)


def salicache_variants(results: Path) -> str:
    """Each variant's options, KV ratio and agreement with `full` on the tiny model."""
    name = SALICACHE_RESULTS[0]
    d = load(name, results)
    rows = [
        [
            f"{v['variant']} (`{json.dumps(v['options'])}`)" if v["options"] else v["variant"],
            times(v["kv_ratio_full_over_salicache"]),
            f"{v['first_token_cosine']:.4f}",
            f"{v['greedy_equal']} / {v['compared']}",
        ]
        for v in d.get("variants", [])
    ]
    header = ["variant", "KV full / salicache", "first-token logits cosine", "greedy tokens equal"]
    return render(header, rows, [(name, d)])


def _tier_bytes_rows() -> tuple[list[list[str]], dict[int, float]]:
    """One row per model: bytes per token and KV head at full precision, INT8 and INT4; and the last model's (the
    real one's) INT8 and INT4 bytes over full precision's."""
    import torch

    from visualkv.kv.quant import QuantSpec, packed_bytes_per_token
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
    return body, bf16


def salicache_tier_bytes(results: Path) -> str:
    """Bytes per token and KV head of each Sali-Cache tier, and the KV shrink of a tier split: computed."""
    from visualkv.media.saliency import TierSpec
    from visualkv.methods.salicache import PAPER_TIER_FRACTIONS

    body, bf16 = _tier_bytes_rows()
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
    return render_with_source(header, body, note, source)


TABLES = {
    "salicache": salicache_against_full,
    "salicache-variants": salicache_variants,
    "salicache-bytes": salicache_tier_bytes,
}
SALICACHE_CODE = paths(PREFILL, DECODE, SESSION, FULL, SALICACHE)
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`); a table computed from the code
#: measures nothing
MEASURES = {
    "salicache": SALICACHE_CODE,
    "salicache-variants": SALICACHE_CODE,
    "salicache-bytes": (),
}
