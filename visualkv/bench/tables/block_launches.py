"""Kernel launches and host reads per prefill block, for videos of 2, 4 and 8 blocks (scripts/block_launches.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from visualkv.bench.tables.format import matching_results, render
from visualkv.bench.tables.measured import BLOCKWISE, PREFILL, SESSION, paths


def _span(values: list[float], digits: int = 0) -> str:
    """ "v" when every value is the same, else "lowest–highest"."""
    low, high = min(values), max(values)
    return f"{low:,.{digits}f}" if low == high else f"{low:,.{digits}f}–{high:,.{digits}f}"


def _row(d: dict[str, Any], r: dict[str, Any]) -> list[str]:
    """One method and number of blocks: the first block, then the span over every later block."""
    layers = d["structure"]["text_layers"]
    first, later = r["per_block"][0], r["per_block"][1:]

    def over_later(key: str, per: int = 1) -> str:
        return _span([b[key] / per for b in later], 1 if per > 1 else 0)

    return [
        f"`{d['shape']}`",
        f"`{r['method']}`",
        str(r["blocks"]),
        f"{first['layer_kernels'] / layers:.1f} / {over_later('layer_kernels', layers)}",
        over_later("vision_kernels"),
        over_later("vision_attention_calls"),
        over_later("embedding_kernels"),
        f"{over_later('vision_reads')} / {over_later('layer_reads')}",
    ]


def block_launches(results: Path) -> str:
    """Per-block launches and reads of the block-wise methods, by number of blocks (scripts/block_launches.py)."""
    body, sources = [], []
    for _, d in matching_results(results, "block_launches_*.json", sources):
        body += [_row(d, r) for r in d["rows"]]
    header = [
        "model",
        "method",
        "blocks",
        "layer-loop kernels per layer: first block / later blocks",
        "vision tower kernels per block",
        "vision attention calls per block",
        "other embedding ops per block",
        "host reads per block: vision tower / layer loop",
    ]
    structures = "; ".join(
        f"`{d['shape']}`: {d['structure']['text_layers']} LLM layers, {d['structure']['vision_blocks']} vision "
        f"blocks, a {d['video']['frame_size']} video, {d['video']['tokens_per_block']} tokens (one temporal patch) "
        f"per block, M = {d['budget']}"
        for _, d in sources
    )
    note = (
        f"Released depths and layer structure at narrow widths ({structures}): every block after the first evicts "
        "as much as it adds, so the blocks are alike. A single number is the same for every later block; a cost "
        "that grew with the cache or the blocks before would show as a span, or as a number that changes with the "
        "blocks. Kernels: dispatched ATen operations that launch a GPU kernel (views excluded); the layer loop holds "
        "the decoder layers and the method's scoring and eviction. Other embedding ops: the block's token embeddings "
        "and their scatter, with host-side work on host tensors (the processor's patches, the tower's grid indices) "
        "that launches nothing on a GPU. Host reads: reads of tensor values inside the tower and from the first "
        "decoder layer on (a GPU sync each): the tower's are its chunk layouts' boundaries, one per distinct "
        "`cu_seqlens` (windows, whole frames) and call."
    )
    return render(header, body, sources, note)


TABLES = {"block-launches": block_launches}
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "block-launches": paths(PREFILL, SESSION, BLOCKWISE),
}
